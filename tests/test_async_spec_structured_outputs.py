"""Structured outputs under async scheduling with speculative decoding (vLLM's PR #29821).

The runner proposes a step's drafts when it launches the step (``model_runner.py`` NOTE 14),
so no grammar cut them. The engine takes them back from the runner once the forward is
launched (``take_draft_token_ids``), writes them into its copy of the step in place of the
placeholders (``update_draft_token_ids_in_output``), and the mask is made over them: row i is
the grammar's state after drafts 0 .. i-1. A draft the grammar refuses has a row that refuses
it, so the verification rejects it there, and the rows after it are never read; the runner
reports only the drafts before it as verified (``num_invalid_spec_tokens``). So the tokens and
the acceptance counts are the synchronous engine's, which cut the same drafts when it
proposed them."""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.async_scheduler import AsyncScheduler
from tinyvllm.core.sched_output import DRAFT_PLACEHOLDER, SchedulerOutput
from tinyvllm.outputs import DraftTokenIds
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import StructuredOutputsParams as SO
from tinyvllm.structured_output.bitmask import unpack_bitmask

xgr = pytest.importorskip("xgrammar")

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
SCHEMA = {"type": "array", "items": {"type": "string", "enum": ["ab", "abab", "b"]}, "minItems": 6, "maxItems": 6}


def greedy(so: SO | None, max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw)


# Prompts that repeat themselves: the n-gram proposer drafts their pattern. The choice's
# grammar leaves the pattern after "abab", so it refuses drafts the proposer keeps making.
WORKLOAD = [
    ('["ab", "ab", "ab", ', greedy(SO(json=SCHEMA, disable_any_whitespace=True), 48)),
    ("abababab", greedy(SO(regex="(ab|ba){2,12}"))),
    ("abababab", greedy(SO(choice=["ababababc", "ababd"]))),
    ("for i in range(10):", greedy(None, 16)),  # unconstrained, beside them
    ("abababab", SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=14, structured_outputs=SO(regex="(ab|ba)+c?"))),
]


def run(async_scheduling: bool) -> tuple[dict[str, list], tuple[int, int, int], list[dict[str, int]], LLM]:
    """Every request of ``WORKLOAD`` through one engine, step by step, invariants checked after
    each step (each matcher took exactly its request's tokens); the tokens per request, the
    acceptance counts, and each mask's ``num_invalid_spec_tokens``."""
    llm = LLM(torch_threads=1, max_num_seqs=8, speculative_config=SPEC, async_scheduling=async_scheduling)
    engine, invalid = llm.engine, []
    manager = engine.structured_output_manager
    grammar_bitmask = manager.grammar_bitmask

    def recorded(*args, **kwargs):
        out = grammar_bitmask(*args, **kwargs)
        invalid.append(dict(out.num_invalid_spec_tokens))
        return out

    manager.grammar_bitmask = recorded
    for i, (prompt, params) in enumerate(WORKLOAD):
        engine.add_request(str(i), engine.tokenizer.encode(prompt), params)
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [list(c.token_ids) for c in out.outputs]
        engine.check_invariants()
    stats = engine.scheduler.spec_stats
    return got, (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), invalid, llm


def test_async_speculation_under_grammars_gives_the_synchronous_tokens_and_counts():
    want, want_stats, sync_invalid, sync_llm = run(async_scheduling=False)
    got, stats, invalid, llm = run(async_scheduling=True)
    try:
        assert got == want
        assert stats == want_stats and stats[2] > 0  # the same drafts verified, some kept under the masks
        assert not any(sync_invalid)  # the synchronous engine cut them when they were proposed
        assert sum(sum(d.values()) for d in invalid) > 0  # here the masks met drafts the grammars refuse
        assert llm.engine.scheduler.kv_cache_manager.usage == 0 and not llm.engine.scheduler.requests
    finally:
        llm.engine.shutdown()
        sync_llm.engine.shutdown()


def test_an_abort_with_a_constrained_requests_drafts_in_flight_leaks_nothing():
    llm = LLM(torch_threads=1, max_num_seqs=4, speculative_config=SPEC, async_scheduling=True)
    engine = llm.engine
    try:
        tokens = engine.tokenizer.encode("abababab")
        engine.add_request("x", tokens, greedy(SO(regex="(ab)+")))
        engine.add_request("y", tokens, greedy(SO(regex="(ab|ba)+"), 12))
        while not engine.scheduler.requests["x"].num_output_placeholders > 1:  # drafts in flight
            engine.step()
        engine.abort_request("x")
        finished = {}
        while engine.has_unfinished_requests():
            finished |= {o.request_id: o for o in engine.step() if o.finished}
            engine.check_invariants()
        assert len(finished["y"].outputs[0].token_ids) == 12
        assert engine.scheduler.kv_cache_manager.usage == 0 and not engine.scheduler.requests
    finally:
        engine.shutdown()


@pytest.mark.parametrize("where", ["take_draft_token_ids", "update_draft_token_ids_in_output"])
def test_a_failure_while_the_drafts_are_taken_takes_the_steps_in_flight_down(where, monkeypatch):
    """llm_engine.py NOTE 1 and NOTE 10: the runner's drafts cannot be taken, or not written
    into the step: every step in flight is aborted, every block freed, the runner emptied of
    requests and of the deferred forward; then the same requests get the same tokens."""
    from test_structured_outputs import a_failure_in_a_deferred_step_leaves_it_serving

    llm = LLM(torch_threads=1, max_num_seqs=4, speculative_config=SPEC, async_scheduling=True)
    try:
        owner = llm.engine.model_runner if where == "take_draft_token_ids" else llm.engine.scheduler
        params = [greedy(SO(regex="(ab)+c"), 16), greedy(None, 12)]
        a_failure_in_a_deferred_step_leaves_it_serving(monkeypatch, llm, owner, where, 2, ["abababab"] * 2, params)
    finally:
        llm.engine.shutdown()


# -- the parts: the scheduler writes the runner's drafts in, the mask stops at a refused one ---------------


def scheduled_with_placeholders() -> tuple[AsyncScheduler, Request, SchedulerOutput]:
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=32), num_spec_tokens=3)
    request = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
    scheduler.add_request(request)
    scheduler.schedule()
    step = scheduler.schedule()
    assert step.scheduled_spec_decode_tokens == {"a": (DRAFT_PLACEHOLDER,) * 3}
    return scheduler, request, step


def test_the_runners_drafts_replace_the_placeholders_in_a_copy_of_the_step():
    scheduler, request, step = scheduled_with_placeholders()
    filled = scheduler.update_draft_token_ids_in_output(DraftTokenIds(("a",), ((41, 42),)), step)
    assert filled.scheduled_spec_decode_tokens == {"a": (41, 42, DRAFT_PLACEHOLDER)}  # the runner proposed two
    assert filled.num_scheduled_tokens == step.num_scheduled_tokens and filled.same_step(step)
    assert step.scheduled_spec_decode_tokens == {"a": (DRAFT_PLACEHOLDER,) * 3}  # the scheduler's own is untouched
    assert request.spec_token_ids == [DRAFT_PLACEHOLDER] * 3
    longer = scheduler.update_draft_token_ids_in_output(DraftTokenIds(("a",), ((41, 42, 43, 44),)), step)
    assert longer.scheduled_spec_decode_tokens == {"a": (41, 42, 43)}  # never more than were scheduled
    scheduler.check_invariants()


@pytest.mark.parametrize(
    "drafts, message",
    [
        (DraftTokenIds(("zz",), ((5,),)), "'zz'"),  # not in the step
        (DraftTokenIds(("a", "a"), ((5,), (6,))), "'a'"),  # twice
        (DraftTokenIds(("a",), ((5,), (6,))), "1 request ids and 2 draft lists"),
        (DraftTokenIds(("a",), ((DRAFT_PLACEHOLDER,),)), "-1"),  # a placeholder is not a draft
    ],
)
def test_drafts_that_do_not_fit_the_step_are_a_value_error_naming_them(drafts, message):
    scheduler, _, step = scheduled_with_placeholders()
    with pytest.raises(ValueError, match=message):
        scheduler.update_draft_token_ids_in_output(drafts, step)
    scheduler.check_invariants()


def constrained_request(llm: LLM) -> Request:
    request = Request("d", [5, 6], greedy(SO(regex="ab+c")))
    request.status = RequestStatus.WAITING
    llm.engine.structured_output_manager.grammar_init(request)
    assert request.structured_output_request._compiled.result(timeout=60) is not None
    assert request.structured_output_request.is_grammar_ready()
    return request


def mask_rows(llm: LLM, request: Request, drafts: tuple[int, ...]) -> tuple[SchedulerOutput, list[set[int]]]:
    step = SchedulerOutput((), (), {"d": 1 + len(drafts)}, 1 + len(drafts), frozenset(), frozenset(), {"d": drafts})
    out = llm.engine.structured_output_manager.grammar_bitmask(step, {"d": request})
    allowed = unpack_bitmask(__import__("torch").from_numpy(out.grammar_bitmask), llm.engine.structured_output_manager.vocab_size)
    return out, [set(row.nonzero().flatten().tolist()) for row in allowed]


def test_a_refused_draft_has_a_row_that_refuses_it_and_the_rows_after_it_are_not_the_grammars():
    llm = LLM(torch_threads=1, max_num_seqs=2)
    try:
        tok = llm.engine.tokenizer
        a, b, c, x = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "c", "x"))
        request = constrained_request(llm)
        vocab = set(range(llm.engine.structured_output_manager.vocab_size))
        out, rows = mask_rows(llm, request, (a, b, x, c))  # "ab" then x: refused
        assert out.num_invalid_spec_tokens == {"d": 2}  # x and the draft after it
        assert a in rows[0] and b not in rows[0]
        assert b in rows[1] and c not in rows[1]
        assert {b, c} <= rows[2] and x not in rows[2]  # x's row refuses x: the verification rejects it here
        assert rows[3] == vocab  # after a refused draft: never read
        out, rows = mask_rows(llm, request, (a, DRAFT_PLACEHOLDER, DRAFT_PLACEHOLDER))  # the runner proposed one
        assert out.num_invalid_spec_tokens == {"d": 2} and b in rows[1]
        out, _ = mask_rows(llm, request, (a, b, b))  # every draft allowed: none invalid
        assert out.num_invalid_spec_tokens == {}
        assert request.structured_output_request.grammar.num_processed_tokens == 0  # every draft rolled back
    finally:
        llm.engine.shutdown()
