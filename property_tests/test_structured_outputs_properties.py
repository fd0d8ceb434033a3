"""Hypothesis over structured outputs on the shipped model: what a grammar promises, checked
by an independent xgrammar matcher.

For regexes, JSON schemas and choice lists built from small building blocks, the shipped model
(``stdlib_tiny``, CPU) samples seeded completions (temperature 1) under each constraint, next to
two unconstrained requests (one greedy, one seeded). Then:

- every emitted token sequence is one the grammar allows, token by token, for a
  ``xgrammar.GrammarMatcher`` built here from the model folder's own tokenizer and config,
  with xgrammar directly (not through ``tinyvllm.structured_output``);
- every family is bounded (bounded repeats and lengths, compact JSON), and ``max_tokens`` is
  more than its longest text in bytes, so every output stops; one that stops ends with the EOS
  and the independent matcher is then terminated (the text is complete). JSON with any
  whitespace (the default) is not bounded: an output cut by ``max_tokens`` is checked as a prefix;
- a regex output matches in full (``re.fullmatch``), a JSON output parses and satisfies its
  schema (checked here by ``conforms``), a choice output is one of the choices;
- the unconstrained neighbours give exactly the tokens they give alone;
- under async scheduling with n-gram drafts (which no grammar cuts there), repeated regexes
  give the plain engine's tokens, neighbour included.

One engine serves every example (``engine()``); the example counts keep the file under a
minute on two cores.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm import LLM, SamplingParams
from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.stdlib_tiny import STDLIB_TINY

xgr = pytest.importorskip("xgrammar")

PROMPTS = ("x = ", "Email: ", "answer: ", "def f():\n    return ")
NEIGHBOUR_TOKENS = 10


@functools.cache
def engine() -> LLM:
    return LLM(torch_threads=1, max_num_seqs=16)


@functools.cache
def independent_compiler() -> xgr.GrammarCompiler:
    """xgrammar over the model folder's tokenizer, vocabulary size and EOS, read here."""
    from transformers import AutoTokenizer

    folder = Path(STDLIB_TINY)
    config = json.loads((folder / "config.json").read_text())
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(str(folder)), vocab_size=config["vocab_size"],
        stop_token_ids=eos if isinstance(eos, list) else [eos],
    )  # fmt: skip
    return xgr.GrammarCompiler(info, max_threads=1)


def eos_ids() -> set[int]:
    eos = json.loads((Path(STDLIB_TINY) / "generation_config.json").read_text())["eos_token_id"]
    return set(eos if isinstance(eos, list) else [eos])


@functools.cache
def alone(prompt: str, seed: int | None) -> tuple[int, ...]:
    """An unconstrained request's tokens when it runs by itself (greedy when ``seed`` is None)."""
    [out] = engine().generate([prompt], [neighbour_params(seed)], use_tqdm=False)
    return tuple(out.outputs[0].token_ids)


def neighbour_params(seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(temperature=0, max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)


def run_and_check(constraint: StructuredOutputsParams, compiled, max_bytes: int, prompt: str, seed: int,
                  neighbour: tuple[str, int], bounded: bool = True) -> list[str]:  # fmt: skip
    """Two seeded constrained requests and two unconstrained neighbours in one batch; the
    checks every family shares. Returns the texts of the constrained outputs that stopped
    (with ``bounded``, every one must)."""
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_bytes + 1, structured_outputs=constraint)
              for i in range(2)]  # fmt: skip
    neighbour_prompt, neighbour_seed = neighbour
    outs = engine().generate(
        [prompt, prompt, neighbour_prompt, neighbour_prompt],
        [*params, neighbour_params(None), neighbour_params(neighbour_seed)], use_tqdm=False,
    )  # fmt: skip
    texts = []
    for out in outs[:2]:
        completion = out.outputs[0]
        ids = list(completion.token_ids)
        matcher = xgr.GrammarMatcher(compiled)
        for i, token in enumerate(ids):
            assert matcher.accept_token(token), f"{constraint}: token {i} ({token}) of {ids} is not allowed"
        if completion.finish_reason == "length" and not bounded:
            assert len(ids) == max_bytes + 1 and not matcher.is_terminated(), (constraint, ids)
            continue  # a valid prefix, cut by max_tokens
        assert completion.finish_reason == "stop", (constraint, completion)  # bounded: it must stop
        assert ids and ids[-1] in eos_ids() and matcher.is_terminated(), (constraint, ids)
        texts.append(completion.text)
    assert tuple(outs[2].outputs[0].token_ids) == alone(neighbour_prompt, None)
    assert tuple(outs[3].outputs[0].token_ids) == alone(neighbour_prompt, neighbour_seed)
    assert not engine().engine.has_unfinished_requests()
    engine().engine.structured_output_manager.check_invariants()
    return texts


prompts = st.sampled_from(PROMPTS)
seeds = st.integers(0, 2**16)
neighbours = st.tuples(st.sampled_from(PROMPTS[:2]), st.integers(0, 3))


# -- regexes -----------------------------------------------------------------------------------

# Each block is (pattern, the most bytes it matches).
CLASSES = ("[a-z]", "[0-9]", "[A-Z]", "[a-f0-9]", "[xyz_]")
quantified = st.tuples(st.sampled_from(CLASSES), st.integers(0, 2), st.integers(0, 3)).map(
    lambda t: (f"{t[0]}{{{t[1]},{t[1] + t[2]}}}", t[1] + t[2])
)
literal = st.sampled_from([("-", 1), ("@", 1), (r"\.", 1), ("ab", 2), ("id", 2), (":", 1), (" ", 1)])
WORDS = ("ab", "cd", "yes", "no", "42", "x")
alternation = st.lists(st.sampled_from(WORDS), min_size=2, max_size=3, unique=True).map(
    lambda words: ("(" + "|".join(words) + ")", max(map(len, words)))
)
optional = st.sampled_from(WORDS).map(lambda w: (f"({w})?", len(w)))
regexes = st.lists(st.one_of(quantified, literal, alternation, optional), min_size=1, max_size=4).map(
    lambda blocks: ("".join(p for p, _ in blocks), sum(n for _, n in blocks))
)


@settings(max_examples=20, deadline=None)
@given(regex=regexes, prompt=prompts, seed=seeds, neighbour=neighbours)
def test_regex_outputs_are_allowed_token_by_token_and_match_in_full(regex, prompt, seed, neighbour):
    pattern, max_bytes = regex
    compiled = independent_compiler().compile_regex(pattern)
    for text in run_and_check(StructuredOutputsParams(regex=pattern), compiled, max_bytes, prompt, seed, neighbour):
        assert re.fullmatch(pattern, text), (pattern, text)


# -- JSON schemas ------------------------------------------------------------------------------

# Each block is (schema, the most bytes of a value compact JSON writes for it: ", " and ": ").
integers = st.tuples(st.integers(0, 20), st.integers(0, 300)).map(
    lambda t: ({"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}, len(str(t[0] + t[1])))
)
booleans = st.just(({"type": "boolean"}, 5))
strings = st.integers(1, 4).map(lambda n: ({"type": "string", "maxLength": n}, 2 + 6 * n))  # \uXXXX: 6 bytes a char
ENUM_VALUES = ("a", "bc", 1, None, True, 2.5)
enums = st.lists(st.sampled_from(ENUM_VALUES), min_size=1, max_size=3, unique=True).map(
    lambda values: ({"enum": values}, max(len(json.dumps(v)) for v in values))
)
arrays = st.integers(1, 3).map(
    lambda k: ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": k}, 2 + 3 * k)
)
scalars = st.one_of(integers, booleans, strings, enums, arrays)
KEYS = ("a", "id", "name", "ok", "n")


def object_of(members: st.SearchStrategy) -> st.SearchStrategy:
    def build(pairs: list[tuple[str, tuple[dict, int]]]) -> tuple[dict, int]:
        schema = {
            "type": "object", "properties": {k: s for k, (s, _) in pairs},
            "required": [k for k, _ in pairs], "additionalProperties": False,
        }  # fmt: skip
        return schema, 2 + sum(len(json.dumps(k)) + 2 + n for k, (_, n) in pairs) + 2 * (len(pairs) - 1)

    return st.lists(st.tuples(st.sampled_from(KEYS), members), min_size=1, max_size=3, unique_by=lambda p: p[0]).map(build)


schemas = object_of(st.one_of(scalars, object_of(scalars)))


def conforms(value, schema: dict) -> bool:
    """``value`` satisfies ``schema`` (the building blocks above; a bool is not an integer)."""
    if "enum" in schema:
        return any(type(value) is type(v) and value == v for v in schema["enum"])
    kind = schema["type"]
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    if kind == "boolean":
        return type(value) is bool
    if kind == "string":
        return type(value) is str and len(value) <= schema["maxLength"]
    if kind == "array":
        return type(value) is list and len(value) <= schema["maxItems"] and all(conforms(v, schema["items"]) for v in value)
    return (type(value) is dict and set(value) == set(schema["required"])
            and all(conforms(value[k], schema["properties"][k]) for k in value))  # fmt: skip


@settings(max_examples=16, deadline=None)
@given(schema=schemas, compact=st.booleans(), prompt=prompts, seed=seeds, neighbour=neighbours)
def test_json_outputs_are_allowed_token_by_token_and_satisfy_the_schema(schema, compact, prompt, seed, neighbour):
    """``compact``: no whitespace but xgrammar's separators, so the text is bounded and must stop;
    otherwise (the default) any whitespace between tokens: a stopped output is checked in full,
    one cut by ``max_tokens`` as a prefix."""
    spec, max_bytes = schema
    compiled = independent_compiler().compile_json_schema(json.dumps(spec), any_whitespace=not compact)
    constraint = StructuredOutputsParams(json=spec, disable_any_whitespace=compact)
    for text in run_and_check(constraint, compiled, max_bytes, prompt, seed, neighbour, bounded=compact):
        assert conforms(json.loads(text), spec), (spec, text)


# -- choices -----------------------------------------------------------------------------------

CHOICES = ("yes", "no", "maybe", "a b", 'say "hi"', "c:\\d", "é", "42")


@settings(max_examples=12, deadline=None)
@given(
    choices=st.lists(st.sampled_from(CHOICES), min_size=2, max_size=4, unique=True),
    prompt=prompts, seed=seeds, neighbour=neighbours,
)  # fmt: skip
def test_choice_outputs_are_one_of_the_choices(choices, prompt, seed, neighbour):
    grammar = "root ::= " + " | ".join(json.dumps(c) for c in choices)  # built here, \\u escapes and all
    compiled = independent_compiler().compile_grammar(grammar)
    max_bytes = max(len(c.encode()) for c in choices)
    for text in run_and_check(StructuredOutputsParams(choice=choices), compiled, max_bytes, prompt, seed, neighbour):
        assert text in choices, (choices, text)


# -- async scheduling with speculative decoding ----------------------------------------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@functools.cache
def async_speculative_engine() -> LLM:
    """The runner proposes the drafts and nothing cuts them: the masks reject those a grammar
    refuses (``structured_output/manager.py`` NOTE 8)."""
    return LLM(torch_threads=1, max_num_seqs=16, async_scheduling=True, speculative_config=SPEC)


@settings(max_examples=10, deadline=None)
@given(regex=regexes, repeat=st.integers(1, 4), prompt=prompts, seed=seeds, neighbour=neighbours)
def test_async_speculation_under_a_grammar_gives_the_plain_engines_tokens(regex, repeat, prompt, seed, neighbour):
    """Seeded draws are keyed by position, so with drafts (kept, rejected or refused by the
    grammar) every request's tokens are those of the plain engine; ``repeat`` repeats the regex
    so the output repeats itself and the n-gram proposer finds drafts."""
    pattern = f"({regex[0]}){{{repeat}}}"
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=regex[1] * repeat + 1,
                             structured_outputs=StructuredOutputsParams(regex=pattern)) for i in range(2)]  # fmt: skip
    requests = ([prompt, prompt, neighbour[0]], [*params, neighbour_params(neighbour[1])])
    want = [tuple(o.outputs[0].token_ids) for o in engine().generate(*requests, use_tqdm=False)]
    llm = async_speculative_engine()
    got = [tuple(o.outputs[0].token_ids) for o in llm.generate(*requests, use_tqdm=False)]
    assert got == want, pattern
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.kv_cache_manager.usage == 0
    llm.engine.check_invariants()
