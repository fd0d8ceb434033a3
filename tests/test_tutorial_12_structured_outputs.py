"""Tutorial 12 constrains the shipped model step by step: this test pins the facts its page
relies on.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/12_structured_outputs.txt``; here every row of the three step tables is
recounted by an independent xgrammar matcher (built from the tokenizer, not from the
engine's manager): the allowed count the tutorial read from the step's bitmask equals the
matcher's count after the tokens chosen before it, the chosen token is one of them, the
listed tokens are exactly the allowed ones, and each part's output fits its constraint.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
from tutorial_runner import tutorial_output

PARTS = 3
SCRIPT = Path(__file__).resolve().parents[1] / "tutorials" / "12_structured_outputs.py"


def _tutorial():
    """The script as a module (its ``main`` does not run): the constraints it used."""
    spec = importlib.util.spec_from_file_location("tutorial_12", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parts(out: str) -> list[tuple[str, list[tuple[int, int, str, str]], str]]:
    """(header line, rows (step, allowed, chosen text, listed tokens or ''), output line) per part."""
    parts = []
    for block in out.split("\n== part ")[1:]:
        lines = block.splitlines()
        rows = []
        for line in lines:
            m = re.match(r"^\s*(\d+) \|\s+(\d+) \| ('.*?'|\".*?\")\s+\| ('.*?'|\".*?\")(?:  \{(.*)\})?$", line)
            if m:
                rows.append((int(m[1]), int(m[2]), ast.literal_eval(m[3]), m[5] or ""))
        output = next(line for line in lines if line.startswith("output "))
        parts.append((lines[0], rows, output))
    return parts


@pytest.mark.slow
def test_tutorial_12_allowed_counts_are_an_independent_matchers():
    xgr = pytest.importorskip("xgrammar")
    from tinyvllm.models.tokenizer import load_tokenizer
    from tinyvllm.stdlib_tiny import STDLIB_TINY
    from tinyvllm.structured_output.backend_xgrammar import choice_as_grammar

    out = tutorial_output("12_structured_outputs.py")
    vocab = int(re.search(r"vocabulary (\d+) tokens", out).group(1))
    tok = load_tokenizer(STDLIB_TINY)
    eos = tok.eos_token_id
    text_to_id: dict[str, list[int]] = {}
    for t in range(vocab):
        text_to_id.setdefault(tok.decode([t]), []).append(t)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos]))
    parts = _parts(out)
    assert len(parts) == PARTS, out
    for (header, rows, output), (_, _, constraint, _) in zip(parts, _tutorial().PARTS):
        if constraint.choice is not None:
            grammar = compiler.compile_grammar(choice_as_grammar(constraint.choice))
        elif constraint.regex is not None:
            grammar = compiler.compile_regex(constraint.regex)
        else:
            grammar = compiler.compile_json_schema(json.dumps(constraint.json), any_whitespace=not constraint.disable_any_whitespace)
        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, vocab)
        assert rows, header
        for step, allowed, chosen, listed in rows:
            matcher.fill_next_token_bitmask(mask)
            ids = [t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
            assert allowed == len(ids), f"{header}: step {step} printed {allowed} allowed, the matcher allows {len(ids)}"
            if listed:
                assert sorted(ast.literal_eval("[" + listed + "]")) == sorted(tok.decode([t]) for t in ids), step
            candidates = [t for t in text_to_id[chosen] if t in ids]
            assert len(candidates) == 1, f"{header}: step {step}: {chosen!r} is not one allowed token"
            assert matcher.accept_token(candidates[0]), step
        assert rows[-1][2] == tok.decode([eos]) and rows[-1][1] == 1, "each part ends once only EOS is allowed"
        assert matcher.is_terminated()
        assert "finish_reason 'stop'" in output and output.endswith(": yes"), output
    assert "compiled grammars in the manager's cache: 3" in out
