"""Structured outputs: a grammar per request, a token mask per step (``structured_output/``).

Pinned down here: the parameters (exactly one constraint), the backend's parse check (a bad
constraint is a ValueError naming the field, before anything is queued), the pure helpers
(choice as a grammar, think sections; the bitmask's layout and its application to the logits
are ``tests/test_grammar_bitmask.py``'s, which needs no xgrammar), the scheduler's
``WAITING_FOR_FSM`` (passed over, keeping its place), and on the shipped model: choices,
regexes and schemas obeyed, unconstrained neighbours untouched, the compile cache, an abort
while compiling, a failed compile, logprobs after the mask, speculation and think sections.
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import CacheConfig, SchedulerConfig, StructuredOutputsConfig
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import StructuredOutputsParams as SO
from tinyvllm.structured_output.bitmask import unpack_bitmask
from tinyvllm.structured_output.manager import find_last, think_section_open

xgr = pytest.importorskip("xgrammar")
from tinyvllm.structured_output import backend_xgrammar  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


# -- the parameters and the parse check ------------------------------------------------------


def test_params_hold_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        SO()
    with pytest.raises(ValueError, match=r"got regex='a', choice=\('x',\)"):
        SO(regex="a", choice=["x"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SO(choice=[])
    with pytest.raises(ValueError, match="json_object must be True or None, got False"):
        SO(json_object=False)
    with pytest.raises(ValueError, match="not valid JSON"):
        SO(json="{not json")
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"choice": ["a"]})
    # A schema as a dict or as its JSON text is one cache key.
    assert SO(json=PERSON).key == SO(json=json.dumps(PERSON, indent=2)).key
    assert SO(json=PERSON).key != SO(json=PERSON, disable_any_whitespace=True).key
    assert SO(choice=["a", "b"]).kind == "choice"


@pytest.mark.parametrize(
    "params, field",
    [
        (SO(regex="a(b"), "regex"),
        (SO(json={"type": "no-such-type"}), "json"),
        (SO(grammar='root ::= "a" |'), "grammar"),
    ],
)
def test_a_constraint_xgrammar_cannot_parse_is_a_value_error_naming_the_field(params, field):
    with pytest.raises(ValueError, match=f"structured_outputs {field} is not a valid {field}: "):
        backend_xgrammar.validate(params)


def test_whitespace_pattern_is_refused_by_name():
    with pytest.raises(ValueError, match="whitespace_pattern"):
        backend_xgrammar.validate(SO(json=PERSON, whitespace_pattern=r"[ ]?"))


def test_choice_becomes_an_escaped_ebnf_that_xgrammar_reads():
    text = backend_xgrammar.choice_as_grammar(["yes", 'say "hi"', "a\\b\nc"])
    assert text == r'root ::= "yes" | "say \"hi\"" | "a\\b\nc"'
    xgr.Grammar.from_ebnf(text)  # parses


def test_find_last_and_think_sections():
    assert find_last([1, 2, 3, 1, 2], [1, 2]) == 5
    assert find_last([1, 2, 3, 1, 2], [1, 2], end=4) == 2
    assert find_last([1, 2], [3]) == -1
    start, end = (7,), (8, 9)
    assert think_section_open([1, 7, 5], start, end)
    assert not think_section_open([1, 7, 5, 8, 9], start, end)
    assert think_section_open([7, 8, 9, 7], start, end)
    assert not think_section_open([1, 2, 3], start, end)  # neither sequence: not thinking (manager.py NOTE 4)
    assert not think_section_open([7], (), end)


# -- the worker's half: the bitmask's layout -------------------------------------------------


def test_our_unpacking_names_the_tokens_xgrammars_matcher_allows():
    """xgrammar's own layout agrees: its matcher's row and ``unpack_bitmask`` name the same
    tokens (the layout itself: ``tests/test_grammar_bitmask.py``)."""
    info = xgr.TokenizerInfo([f"t{i}" for i in range(40)])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex("t1[0-9]"))
    mask = xgr.allocate_token_bitmask(1, 40)
    matcher.fill_next_token_bitmask(mask)
    assert unpack_bitmask(mask, 40)[0].nonzero().flatten().tolist() == [1] + list(range(10, 20))


# -- the scheduler: WAITING_FOR_FSM ----------------------------------------------------------


class FakeCompile:
    """A grammar whose compile finishes when the test says so."""

    def __init__(self) -> None:
        self.ready = False

    def is_grammar_ready(self) -> bool:
        return self.ready


def test_a_request_waiting_for_its_grammar_is_passed_over_and_keeps_its_place():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=64))  # fmt: skip
    waiting = Request("fsm", [1, 2, 3], SamplingParams(max_tokens=4))
    waiting.structured_output_request = compile_ = FakeCompile()
    waiting.status = RequestStatus.WAITING_FOR_FSM
    scheduler.add_request(waiting)
    scheduler.add_request(Request("plain", [4, 5], SamplingParams(max_tokens=4)))
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["plain"]
    assert [r.request_id for r in scheduler.waiting] == ["fsm"] and waiting.status == RequestStatus.WAITING_FOR_FSM
    scheduler.check_invariants()
    scheduler.add_request(Request("later", [6], SamplingParams(max_tokens=4)))
    scheduler.finish_requests("plain", RequestStatus.FINISHED_ABORTED)
    compile_.ready = True
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["fsm", "later"]  # its place, ahead of "later"
    assert waiting.status == RequestStatus.RUNNING
    scheduler.check_invariants()


def test_an_abort_while_the_grammar_compiles_frees_everything():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks=16))  # fmt: skip
    waiting = Request("fsm", [1, 2, 3], SamplingParams(max_tokens=4))
    waiting.structured_output_request = FakeCompile()
    waiting.status = RequestStatus.WAITING_FOR_FSM
    scheduler.add_request(waiting)
    assert scheduler.schedule().total_num_scheduled_tokens == 0
    scheduler.finish_requests("fsm", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.requests and not scheduler.waiting
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 16
    scheduler.check_invariants()


# -- the engine, on the shipped model --------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    llm = LLM(torch_threads=1, max_num_seqs=16)
    yield llm
    llm.engine.shutdown()


def greedy(so: SO | None, max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw)


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_choices_regexes_and_schemas_are_obeyed(llm):
    choice = SO(choice=["yes", "no", "maybe"])
    regex = SO(regex=r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)")
    prompts = ["Is the sky blue?", "Answer: ", "def f(x):", "import os\n"]
    outs = llm.generate(prompts, [greedy(choice)] * 4, use_tqdm=False)
    assert all(t in ("yes", "no", "maybe") for t in texts(outs))
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured_outputs=choice) for s in range(4)]
    assert all(t in ("yes", "no", "maybe") for t in texts(llm.generate(prompts, seeded, use_tqdm=False)))
    outs = llm.generate(["Email: "] * 2, [greedy(regex, 30), SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                        structured_outputs=regex)], use_tqdm=False)  # fmt: skip
    for out in outs:
        text = out.outputs[0].text
        assert re.fullmatch(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", text) or out.outputs[0].finish_reason == "length"
        assert re.fullmatch(r"[a-z]{0,6}(@[a-z]{0,5}(\.[a-z]{0,3})?)?", text), text  # a prefix, whatever happened
    outs = llm.generate(["person = "], [greedy(SO(json=PERSON, disable_any_whitespace=True), 60)], use_tqdm=False)
    out = outs[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99


def test_json_object_gives_an_object_and_a_grammar_its_language(llm):
    outs = llm.generate(["x = "], [greedy(SO(json_object=True), 80)], use_tqdm=False)
    text = outs[0].outputs[0].text
    assert text.lstrip().startswith("{")
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    grammar = 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] digits'
    out = llm.generate(["n = "], [greedy(SO(grammar=grammar), 12)], use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"\([0-9]+\)" if out.finish_reason == "stop" else r"\([0-9]*", out.text), out.text


def test_unconstrained_neighbours_get_the_tokens_they_get_alone(llm):
    plain = [greedy(None, 16), SamplingParams(temperature=0.9, seed=11, max_tokens=16)]
    prompts = ["def add(a, b):", "class Stack:"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(
        [*prompts, "Is it?", "person = "],
        [*plain, greedy(SO(choice=["yes", "no"])), greedy(SO(json=PERSON), 16)], use_tqdm=False,
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone


def test_logprobs_are_of_the_masked_logits(llm):
    allowed = ("yes", "no")
    out = llm.generate(["Is it?"], [greedy(SO(choice=list(allowed)), logprobs=5)], use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]  # {token_id: Logprob}: the top 5 and the sampled one
    finite = {tid for tid, lp in first.items() if lp.logprob > float("-inf")}
    tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.engine.tokenizer
    starts = {tid for tid in range(tok.vocab_size) if any(c.startswith(tok.decode([tid])) and tok.decode([tid]) for c in allowed)}
    assert finite and finite <= starts, (finite, starts)
    assert abs(sum(np.exp(lp.logprob) for tid, lp in first.items() if tid in finite) - 1) < 1e-4 or len(finite) == 5


def test_a_bad_constraint_is_refused_before_anything_is_queued(llm):
    engine = llm.engine
    free = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    for so, field in [(SO(regex="(unclosed"), "regex"), (SO(json={"type": "nope"}), "json")]:
        with pytest.raises(ValueError, match=f"structured_outputs {field} is not a valid {field}"):
            llm.generate(["x"], [greedy(so)], use_tqdm=False)
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    assert texts(llm.generate(["Is it?"], [greedy(SO(choice=["yes", "no"]))], use_tqdm=False))[0] in ("yes", "no")


def test_one_compile_per_schema_is_shared_and_cached(llm):
    manager = llm.engine.structured_output_manager
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    first = manager.compile(SO(json=schema))
    assert manager.compile(SO(json=json.dumps(schema))) is first  # same key, same Future
    first.result(timeout=30)
    outs = llm.generate(["a = ", "b = "], [greedy(SO(json=schema, disable_any_whitespace=True), 20)] * 2, use_tqdm=False)
    assert all(json.loads(t) in ({"k": True}, {"k": False}) for t, o in zip(texts(outs), outs) if o.outputs[0].finish_reason == "stop")
    manager.check_invariants()


def test_an_abort_while_compiling_leaks_nothing_and_others_run_meanwhile(llm, monkeypatch):
    engine, manager = llm.engine, llm.engine.structured_output_manager
    gate = threading.Event()
    real = manager.backend.compile

    def slow_compile(params):
        assert gate.wait(30)
        return real(params)

    monkeypatch.setattr(manager.backend, "compile", slow_compile)
    engine.add_request("slow", [5, 6, 7], greedy(SO(regex="[0-9]{3}-slow")))
    engine.add_request("plain", [5, 6, 7], greedy(None, 3))
    finished = []
    while "plain" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert engine.scheduler.requests["slow"].status == RequestStatus.WAITING_FOR_FSM
    engine.abort_request("slow")
    gate.set()
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    engine.check_invariants()
    assert engine.scheduler.kv_cache_manager.usage == 0


def test_a_failed_compile_ends_the_request_with_an_error_and_the_engine_serves_on(llm, monkeypatch):
    manager = llm.engine.structured_output_manager

    def broken(params):
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(manager.backend, "compile", broken)
    outs = llm.generate(["a", "Is it?"], [greedy(SO(regex="[0-9]+zz")), greedy(None, 4)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert len(outs[1].outputs[0].token_ids) == 4
    manager._cache.clear()  # the failed Future is not reused anyway (manager.compile)


ASYNC_PROMPTS = ["Is it?", "Email: ", "person = ", "def f(x):", "colour: "]


def async_params() -> list[SamplingParams]:
    return [
        greedy(SO(choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20, structured_outputs=SO(regex=r"[a-z]{2,6}@[a-z]{2,5}\.com")),
        greedy(SO(json=PERSON, disable_any_whitespace=True), 40),
        SamplingParams(temperature=0.8, seed=9, max_tokens=12),  # unconstrained, beside them
        SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=10, structured_outputs=SO(choice=["red", "blue"])),
    ]


def test_async_scheduling_gives_the_synchronous_tokens_under_constraints(llm):
    """manager.py NOTE 7: a constrained request's mask is made after the step before it was read
    back, so every mask sees every token before it; the tokens are sync's."""
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(ASYNC_PROMPTS, async_params(), use_tqdm=False)]
    async_llm = LLM(torch_threads=1, max_num_seqs=16, async_scheduling=True)
    try:
        engine = async_llm.engine
        for i, (prompt, params) in enumerate(zip(ASYNC_PROMPTS, async_params())):
            engine.add_request(str(i), engine.tokenizer.encode(prompt), params)
        got: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = [c.token_ids for c in out.outputs]
            engine.check_invariants()  # each matcher took exactly its request's tokens
        assert [got[str(i)] for i in range(len(ASYNC_PROMPTS))] == want
        # An abort while a constrained request's step is in flight leaks nothing.
        engine.add_request("x", engine.tokenizer.encode("Is it?"), greedy(SO(choice=["yes", "no"])))
        engine.add_request("y", engine.tokenizer.encode("Is it?"), greedy(None, 6))
        engine.step()
        engine.step()
        engine.abort_request("x")
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_invariants()
        assert engine.scheduler.kv_cache_manager.usage == 0 and not engine.scheduler.requests
    finally:
        async_llm.engine.shutdown()


def test_under_async_scheduling_a_constrained_step_is_launched_before_the_last_is_read_back():
    """manager.py NOTE 7, llm_engine.py NOTE 10: with a constrained request's token in flight,
    each call schedules the next step and launches its forward (F) before the step in flight is
    read back (R); only then is the mask made (M) and the step sampled (P). Without the split,
    the engine would read the step back first and launch after: the overlap would be lost."""
    async_llm = LLM(torch_threads=1, async_scheduling=True)
    try:
        engine, timeline = async_llm.engine, []
        runner = engine.model_runner

        def mark(owner, name: str, letter: str, after: bool = False) -> None:
            call = getattr(owner, name)

            def marked(*args, **kwargs):
                timeline.append("" if after else letter)
                out = call(*args, **kwargs)
                timeline.append(letter if after else "")
                return out

            setattr(owner, name, marked)

        mark(engine.scheduler, "schedule", "S")
        mark(runner, "_forward", "F")
        mark(runner, "_read_back", "R", after=True)  # when the ids are on the host
        mark(engine.structured_output_manager, "grammar_bitmask", "M")
        mark(runner, "sampler", "P")
        params = greedy(SO(regex=r"[a-z]{12}"), 10)
        # Compiled before the requests arrive: otherwise the compile can finish between the
        # scheduler's look at the first request and at the second, which then starts a step
        # earlier, and the count of launches would time the compile rather than the overlap.
        engine.structured_output_manager.compile(params.structured_outputs).result(timeout=60)
        for i, prompt in enumerate(["My name is", "Hello"]):
            engine.add_request(str(i), engine.tokenizer.encode(prompt), params)
        calls = []
        while engine.has_unfinished_requests():
            timeline.clear()
            engine.step()
            calls.append("".join(timeline))
        launching = [c for c in calls if "F" in c]  # the calls that launched a step
        assert launching[0] == "SMFP" and launching[1:] == ["SFRMP"] * 9, calls
    finally:
        async_llm.engine.shutdown()


@pytest.mark.parametrize("where", ["forward", "read_back", "mask", "sample"])
def test_a_failure_between_a_deferred_forward_and_its_sampling_takes_the_steps_in_flight_down(where, monkeypatch):
    """llm_engine.py NOTE 10: a step launched with its sampling deferred fails at its forward,
    at the read-back of the step before it, at its mask or at its sampling: every step in
    flight is aborted, every block freed, the runner emptied of requests and of the deferred
    step; then the engine serves the same request with the same tokens."""
    async_llm = LLM(torch_threads=1, async_scheduling=True)
    try:
        engine, runner = async_llm.engine, async_llm.engine.model_runner
        owner, name = {"forward": (runner, "_forward"), "read_back": (runner, "_read_back"),
                       "mask": (engine.structured_output_manager, "grammar_bitmask"),
                       "sample": (runner, "sample_tokens")}[where]  # fmt: skip
        params = greedy(SO(regex=r"[a-z]{12}"), 10)  # the 4th call: a deferred step's (the first step samples at once)
        a_failure_in_a_deferred_step_leaves_it_serving(monkeypatch, async_llm, owner, name, 4, ["My name is", "Hello"], [params] * 2)
    finally:
        async_llm.engine.shutdown()


def a_failure_in_a_deferred_step_leaves_it_serving(monkeypatch, llm: LLM, owner, name: str, nth: int, prompts, params) -> None:
    """``owner.name`` raises at its ``nth`` call while ``prompts`` run (``params``: one each):
    every step in flight is aborted, every block freed, the runner emptied of requests and of
    the deferred forward; then the same requests get the tokens they got before it."""
    engine, runner = llm.engine, llm.engine.model_runner
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # the grammars compiled now
    original, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(name)
        if len(calls) == nth:
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"doomed{i}", engine.tokenizer.encode(prompt), p)
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not engine.has_unfinished_requests() and not engine.steps_in_flight()
    assert engine.scheduler.kv_cache_manager.usage == 0 and not runner.requests and runner._deferred is None
    engine.check_invariants()
    monkeypatch.setattr(owner, name, original)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


def test_structured_outputs_config_is_checked():
    with pytest.raises(ValueError, match="unknown keys"):
        StructuredOutputsConfig.from_dict({"backend": "xgrammar", "bogus": 1})
    with pytest.raises(ValueError, match="'guidance'"):
        StructuredOutputsConfig(backend="guidance")


# -- composing with the rest of the engine ---------------------------------------------------


def test_n_seeds_and_penalties_compose_with_the_mask(llm):
    choice = ["red", "green", "blue", "yellow"]
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, presence_penalty=1.5, repetition_penalty=1.3,
                            structured_outputs=SO(choice=choice))  # fmt: skip
    first = llm.generate(["colour: "], [params], use_tqdm=False)[0]
    again = llm.generate(["colour: "], [params], use_tqdm=False)[0]
    assert len(first.outputs) == 3 and all(c.text in choice for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]  # seeded: repeatable


def test_preemption_keeps_each_matcher_in_step_with_its_tokens():
    # 20 blocks of 4 tokens for four requests of ~30 tokens (8 blocks each): the last running ones are preempted.
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 8, "maxItems": 8}
    params = [greedy(SO(json=schema, disable_any_whitespace=True), 40)] * 4
    prompts = ["x = " * 6, "y = " * 6, "z = " * 6, "w = " * 6]
    small = LLM(torch_threads=1, max_num_seqs=4, block_size=4, num_gpu_blocks_override=20, max_model_len=64)
    roomy = LLM(torch_threads=1, max_num_seqs=4)
    try:
        tight = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
        for out in tight:
            if out.outputs[0].finish_reason == "stop":
                value = json.loads(out.outputs[0].text)
                assert len(value) == 8 and all(isinstance(v, int) and 0 <= v <= 9 for v in value)
    finally:
        small.engine.shutdown()
        roomy.engine.shutdown()


def test_drafts_the_grammar_refuses_are_cut_when_proposed(llm):
    manager = llm.engine.structured_output_manager
    tok = llm.engine.tokenizer
    request = Request("d", [5, 6], greedy(SO(regex="ab+c")))
    request.status = RequestStatus.WAITING
    manager.grammar_init(request)
    while not request.structured_output_request.is_grammar_ready():
        pass
    a, b, c, x = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "x"))
    assert manager.trim_drafts(request, [a, b, b, x, c]) == [a, b, b]
    assert manager.trim_drafts(request, [x, a]) == []
    grammar = request.structured_output_request.grammar
    assert grammar.num_processed_tokens == 0 and grammar.validate_tokens([a, b, c]) == [a, b, c]  # state untouched


def test_speculative_decoding_gives_the_greedy_tokens_of_plain_decoding():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    schema = {"type": "array", "items": {"type": "string", "enum": ["ab", "abab", "b"]}, "minItems": 6, "maxItems": 6}
    params = [greedy(SO(json=schema, disable_any_whitespace=True), 48), greedy(SO(regex="(ab|ba){2,12}"), 24),
              greedy(None, 16)]  # fmt: skip
    prompts = ['["ab", "ab", "ab", ', "abababab", "for i in range(10):"]
    plain = LLM(torch_threads=1, max_num_seqs=4)
    speculative = LLM(torch_threads=1, max_num_seqs=4, speculative_config=spec)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in speculative.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert speculative.engine.scheduler.spec_stats.num_draft_tokens > 0  # drafts were verified under the mask
    finally:
        plain.engine.shutdown()
        speculative.engine.shutdown()


def test_a_think_section_in_the_prompt_is_waited_out_then_the_grammar_applies(llm):
    engine, tok = llm.engine, llm.engine.tokenizer
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    prompt = tok.encode("Is the sky blue? ") + [start]
    params = SamplingParams(temperature=0, max_tokens=20, thinking_token_budget=3, structured_outputs=SO(choice=["yes", "no"]))
    engine.add_request("think", prompt, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        engine.check_invariants()  # the matcher took exactly the tokens after the section
    ids = list(done[0].outputs[0].token_ids)
    assert ids[3] == end  # three free think tokens, then the forced end
    assert tok.decode(ids[4:], skip_special_tokens=True) in ("yes", "no")
    # Without the open section the first token is already constrained.
    engine.add_request("plain", tok.encode("Is the sky blue? "), params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].text in ("yes", "no")


def test_enable_in_reasoning_constrains_inside_the_think_section():
    llm = LLM(torch_threads=1, max_num_seqs=2, structured_outputs_config={"enable_in_reasoning": True})
    try:
        tok = llm.engine.tokenizer
        prompt = tok.encode("Is the sky blue? ") + [tok.convert_tokens_to_ids("<think>")]
        out = llm.generate([{"prompt_token_ids": prompt}], [greedy(SO(choice=["yes", "no"]))], use_tqdm=False)
        assert out[0].outputs[0].text in ("yes", "no")
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
def test_on_cuda_constrained_outputs_obey_their_grammars():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    llm = LLM(device="cuda", max_num_seqs=8)
    try:
        outs = llm.generate(["Is it?", "person = "], [greedy(SO(choice=["yes", "no"])),
                            greedy(SO(json=PERSON, disable_any_whitespace=True), 60)], use_tqdm=False)  # fmt: skip
        assert outs[0].outputs[0].text in ("yes", "no")
        if outs[1].outputs[0].finish_reason == "stop":
            assert set(json.loads(outs[1].outputs[0].text)) == {"name", "age"}
    finally:
        llm.engine.shutdown()


def test_past_its_stop_token_a_request_that_ignores_eos_runs_unconstrained(llm):
    params = greedy(SO(choice=["yes", "no"]), 8, ignore_eos=True)
    out = llm.generate(["Is it?"], [params], use_tqdm=False)[0].outputs[0]
    eos = llm.engine.eos_token_id
    ids = list(out.token_ids)
    assert len(ids) == 8 and eos in ids, ids  # the grammar's end, then free tokens
    answer = llm.engine.tokenizer.decode(ids[: ids.index(eos)])
    assert answer in ("yes", "no")
