"""The docs say what the code does: stale sentences stay gone, the glossary defines its terms.

Issue 41 named sentences that went stale when speculative decoding landed (or were wrong
from the start). Each is listed here with the page it was on, so a test failure names the
page and the phrase that came back. The glossary must define (as a row of its names
table) every term the issue found missing, and each definition must link the page that
explains it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (file, phrase): each phrase was wrong or misleading where it stood (issue 41).
STALE: list[tuple[str, str]] = [
    # tracing.md: seed 001 draws no such figure (appendix U2.1 elides the step).
    ("docs/tracing.md", "seed 001 shows the rows of the persistent batch"),
    # kv_cache_manager.md: allocate_slots reserves lookahead slots for drafts (NOTE 5).
    ("docs/kv_cache_manager.md", "tinyvllm has no lookahead slots"),
    # scheduler.md: speculative decoding is built, not left out.
    ("docs/scheduler.md", "**Speculative decoding.** A running request may be scheduled"),
    # logits_processor_plugins.md and loader.py NOTE 1: EngineConfig.speculative_config exists.
    ("docs/logits_processor_plugins.md", "has no speculative decoding yet"),
    ("src/tinyvllm/sample/logits_processors/loader.py", "has no speculative decoding yet"),
    ("src/tinyvllm/sample/logits_processors/loader.py", "tinyvllm has none; tests use a fake"),
    # glossary.md: a uniform decode batch has 1 + k tokens per request under speculation.
    ("docs/glossary.md", "one token each in tinyvllm (no speculative decoding)"),
    # spec_decode.md: on a GPU a step with no drafts is not uniform at 1 + k (PIECEWISE).
    ("docs/spec_decode.md", "a step with no drafts is an ordinary decode step"),
    # spec_decode.md: seed 001's [2, 3, 1] are draft counts, not rows with the bonus.
    ("docs/spec_decode.md", "The document's numbers are the rows per request. Ours are the same"),
    # spec_decode.md: vLLM V1's EAGLE drafts by argmax (draft_probs=None): one-hot too.
    ("docs/spec_decode.md", "EAGLE (a draft distribution that is not one-hot)"),
    # spec_decode.md: `B C` first occurred at position 1, not 0.
    ("docs/spec_decode.md", "The suffixes `B C` and `A B C` occurred before, at position 0"),
    # spec_decode.md: "three describe" named two documents.
    ("docs/spec_decode.md", "but three describe what the engine does with"),
    # cuda_graphs_capture.md: the uniform query length is 1 + k with speculation.
    ("docs/cuda_graphs_capture.md", "the uniform query length (1)"),
    # cuda_graphs_backends.md: the recorded speed-up is 7.45, not 7.5.
    ("docs/cuda_graphs_backends.md", "4.03 ms (7.5x)"),
    # cuda_graphs_wrapper.md: a replay of the same graph overwrites its output too.
    ("docs/cuda_graphs_wrapper.md", "valid until a graph of another shape runs"),
    # failure_and_bad_input.md: "32 cached tokens" came from nowhere.
    ("docs/failure_and_bad_input.md", '"hit" 32 cached tokens'),
    # rotary.md: vLLM's fused q/k norm + rope is an opt-in compile pass, not Qwen3's default.
    ("docs/rotary.md", "For Qwen3 vLLM also fuses the q/k norms"),
]

# What issue 41 found missing from the index's map of the modules.
INDEX_MAP = ("spec_decode/", "rejection_sampler.py", "trace/", "penalties.py", "bad_words.py", "logprobs.py", "validation.py")

# The terms issue 41 found missing from the glossary, and the page each must link.
GLOSSARY_TERMS: dict[str, str] = {
    "draft": "spec_decode.md",
    "bonus row": "spec_decode.md",
    "proposer": "spec_decode.md",
    "rejection sampler": "spec_decode.md",
    "acceptance rate": "spec_decode.md",
    "logprob": "sampler_logprobs.md",
    "rank": "sampler_logprobs.md",
    "penalty": "sampler_penalties.md",
    "device wait": "device_syncs.md",
    "trace": "tracing.md",
}


def _text(relpath: str) -> str:
    return " ".join((ROOT / relpath).read_text(encoding="utf-8").split())  # line breaks as spaces


@pytest.mark.parametrize(("relpath", "phrase"), STALE, ids=[f"{p}:{s[:40]}" for p, s in STALE])
def test_a_stale_sentence_does_not_come_back(relpath: str, phrase: str) -> None:
    came_back = phrase in _text(relpath)
    assert not came_back, f"{relpath} says again: {phrase!r} (issue 41)"


def _glossary_rows() -> dict[str, str]:
    """The names table: the first cell of each row (the term) -> the rest of the row."""
    rows = {}
    for line in (ROOT / "docs/glossary.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\|\s*([^|]+?)\s*\|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


@pytest.mark.parametrize("term", sorted(GLOSSARY_TERMS))
def test_the_glossary_defines_the_term_and_links_its_page(term: str) -> None:
    rows = _glossary_rows()
    defined = term in rows
    assert defined, f"docs/glossary.md defines no {term!r} (a row '| {term} | ... |')"
    page = GLOSSARY_TERMS[term]
    assert re.search(rf"\]\({re.escape(page)}(#[^)]*)?\)", rows[term]), f"the glossary's {term!r} links no {page}"


def test_the_glossary_says_a_uniform_decode_batch_has_1_plus_k_tokens() -> None:
    definition = _glossary_rows()["uniform decode batch"]
    assert "1 + k" in definition, definition


@pytest.mark.parametrize("name", INDEX_MAP)
def test_the_index_map_names_the_module(name: str) -> None:
    assert name in (ROOT / "docs/index.md").read_text(encoding="utf-8"), f"docs/index.md's map does not name {name}"
