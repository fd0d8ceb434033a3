"""Soak test of the engine under async scheduling (issue 39): ``LLMEngine`` built with
``async_scheduling=True`` under random adds, aborts with a step in flight, id reuse and
faults that hit while two steps are in flight.

Concept: the same facts as ``test_engine_soak.py``'s ``EngineSoak`` (block accounting, the
requests the engine tracks, every finished request's tokens against a fresh engine's), on an
engine that schedules step N+1 before step N's tokens are back (``llm_engine.py`` NOTE 10). The
reference is a fresh *synchronous* engine: greedy with ``ignore_eos`` is deterministic and
independent of batching, chunking, preemption, prefix hits and of the steps in flight.

``AsyncSchedulingSoak`` (a Hypothesis state machine over ``llm.engine``; tiny random Qwen3, CPU,
block size 4, pools of 8-40 blocks so that preemption happens, prefix caching on or off, token
budgets of 8-64 so that prefills chunk). Rules: add one or two requests, under fresh ids or
a retired one; abort live, unknown and retired ids; step 1-4 times, then maybe abort a
request the last step launched and add a new request under its id at once
(``async_scheduler.py`` NOTE 5: the old step's token must not reach the new request); drain;
arm a fault (the forward, the read-back of a step's ids, a logits processor's ``apply`` or
``update_state``) while a step is in flight and step until it fires: the step it hits has two
in flight. Checked for a step that raises: it raises the injected fault itself, and exactly the requests that the steps in flight scheduled
(the ``SchedulerOutput``s in ``engine._batch_queue`` before the step, and the one scheduled
during it; by request object, so a request added under a reused id that no such step
scheduled is not one of them) leave ``unfinished_request_ids()``; the others carry on. Checked
for a step that returns: every output is for a live request, finished by ``"length"`` with the
fresh engine's tokens. Checked after every rule and step: ``LLMEngine.check_invariants()``, the
engine's unfinished ids == the test's live ids, only those hold blocks, the blocks in use are
exactly theirs, free + held == the pool, at most one step in flight between calls, and no
uncommitted block once no step is. Teardown (liveness): faults off, everything drains, the
pool is whole, ``kv.uncommitted_blocks == []``.

Found by it (and fixed): a failed step also took down a request added under a reused id that
no failed step scheduled (``test_a_failed_step_spares_a_request_added_under_a_reused_id``
pins the fix). With ``async_scheduler.py`` NOTE 5 switched off (a step's tokens given to
whatever request holds the id) the soak fails on a reused id's tokens.

Half the runs verify n-gram drafts too (``SPEC``: placeholder drafts, ``async_scheduler.py``
NOTE 6), against the same synchronous engine without drafts. Requests are added under a regex
(``GRAMMAR``) half the time: their steps' sampling waits for the mask, and with drafts for the
runner's drafts (``structured_output/manager.py`` NOTE 8), and the engine hands the scheduler
copies of its steps (``sched_output.py`` NOTE 4). With ``SchedulerOutput.same_step`` matching
by identity only, the soak fails on a reused id's tokens under a grammar.

Left out: sampling with temperature, stop strings, streaming outputs, ``AsyncLLM`` (the async
examples in ``tests/test_async_scheduling.py`` and the sync soak cover them), CUDA graphs and GPUs.

Bounded for CI: explicit ``@settings`` (derandomized under the ``ci`` profile), tiny shapes
(``max_model_len`` 32, 3-20 token prompts, at most 4 sequences, 20 rules a run) and one torch
thread; the file's time under ``CI=true`` is on the docs page "Failure and bad input". A
failure costs more: the state machine shrinks its counterexample (minutes).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine_failures import Boom, Fault, inject  # noqa: E402
from test_engine_soak import Trap, fresh, model_folder, one_torch_thread, reference_llm  # noqa: E402,F401  (the sync soak's: its traps, one engine of reference, one thread)

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.core.sched_output import SchedulerOutput  # noqa: E402
from tinyvllm.engine.llm_engine import LLMEngine  # noqa: E402
from tinyvllm.request import Request  # noqa: E402
from tinyvllm.sampling_params import StructuredOutputsParams  # noqa: E402

SITES = ("forward", "read_back", "apply", "update_state")  # where a fault can be injected
DRAIN_LIMIT = 1000  # steps a drain allows before "never finishes" is a failure
STEMS = [[(11 * i + 3) % 300 + 10 for i in range(12)], [(7 * i + 1) % 300 + 10 for i in range(8)]]

# Prompts of 3-20 token ids in [5, 400), often sharing a stem: prefix-cache hits.
prompts = st.builds(
    lambda stem, cut, tail: tuple((STEMS[stem][:cut] + tail)[:20]),
    st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(5, 399), min_size=3, max_size=8),
)  # fmt: skip


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GRAMMAR = StructuredOutputsParams(regex="[a-c]{3}(-[0-9]{2})+")  # a request's constraint, when it has one


def params(max_tokens: int, constrained: bool) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=GRAMMAR if constrained else None)


@functools.cache
def fresh_tokens(prompt: tuple[int, ...], max_tokens: int, constrained: bool) -> list[int]:
    """The greedy tokens a fresh synchronous engine gives ``prompt`` alone (under ``GRAMMAR``)."""
    if not constrained:
        return fresh(prompt, max_tokens)
    [out] = reference_llm().generate({"prompt_token_ids": list(prompt)}, params(max_tokens, True), use_tqdm=False)
    return list(out.outputs[0].token_ids)


def make_async_llm(budget: int, blocks: int, caching: bool, spec: bool = False) -> LLM:
    """``spec``: n-gram drafts too (``async_scheduler.py`` NOTE 6), lookups of 1-3 tokens so that
    random prompts find some, near ``max_model_len`` 32 too (placeholder drafts cut short)."""
    return LLM(model_folder(), device="cpu", max_model_len=32, block_size=4, max_num_batched_tokens=budget,
               num_gpu_blocks_override=blocks, max_num_seqs=4, enable_prefix_caching=caching,
               async_scheduling=True, speculative_config=SPEC if spec else None)  # fmt: skip


def install_traps(llm: LLM, log: list[BaseException], sites: tuple[str, ...] = SITES) -> dict[str, Trap]:
    """A trap in the forward, the runner's read-back of a step's ids, and a logits processor
    (not under speculative decoding, which refuses custom logits processors)."""
    traps = {site: Trap(site, log) for site in sites}
    for site, trap in traps.items():
        if site == "read_back":
            runner = llm.engine.model_runner
            read_back = runner._read_back

            def faulty_read_back(step, trap=trap, read_back=read_back):
                trap.trigger()
                return read_back(step)

            runner._read_back = faulty_read_back
        else:
            inject(llm, site, trap)
    return traps


def assert_async_engine_consistent(engine: LLMEngine, live: set[str], when: str) -> None:
    """Invariants, the tracked requests == ``live``, and the block accounting (no leak)."""
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    try:
        engine.check_invariants()
    except AssertionError as error:
        raise AssertionError(f"{when}: {error}") from error
    tracked = engine.unfinished_request_ids()
    assert tracked == live, (
        f"{when}: the engine tracks {sorted(tracked)}, the live requests are {sorted(live)}: "
        f"left tracked {sorted(tracked - live)}, lost {sorted(live - tracked)}"
    )
    unfinished = set(scheduler.requests)
    holders = {rid for rid, blocks in kv.req_to_blocks.items() if blocks}
    assert holders <= unfinished, f"{when}: requests {sorted(holders - unfinished)} are not unfinished but hold blocks"
    held = {block.block_id for rid in unfinished for block in kv.req_to_blocks.get(rid, [])}
    in_use = {block.block_id for block in kv.block_pool.blocks if block.ref_cnt > 0}
    assert in_use == held, (
        f"{when}: blocks in use {sorted(in_use)} != blocks held {sorted(held)} (leaked: {sorted(in_use - held)})"
    )
    free = kv.block_pool.get_num_free_blocks()
    assert free + len(held) == kv.num_gpu_blocks, f"{when}: {free} free + {len(held)} held != the pool's {kv.num_gpu_blocks}"
    queue = engine._batch_queue
    assert len(queue) <= 1, f"{when}: {len(queue)} steps in flight between two calls of step()"
    if not queue:  # every step scheduled was read back: every cached block committed or rolled back
        uncommitted = [b.block_id for b in kv.uncommitted_blocks]
        assert uncommitted == [], f"{when}: uncommitted blocks {uncommitted} with no step in flight"


@dataclass(frozen=True)
class Live:
    """A request the test considers unfinished."""

    prompt: tuple[int, ...]
    max_tokens: int
    reused: bool  # its id served an earlier request
    reused_in_flight: bool  # added while the aborted request under its id had a step in flight
    constrained: bool = False  # under GRAMMAR: its steps' masks wait for the step in flight (and the drafts)

    def want(self) -> list[int]:
        return fresh_tokens(self.prompt, self.max_tokens, self.constrained)


class AsyncSchedulingSoak(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None
        self.live: dict[str, Live] = {}
        self.retired: set[str] = set()  # ids whose requests finished, were aborted or failed
        self.counter = 0
        self.fault_log: list[BaseException] = []
        self.traps: dict[str, Trap] = {}
        self.scheduled: list[tuple[SchedulerOutput, dict[str, Request]]] = []  # each step not read back, its requests
        self.faults_left = 0

    @initialize(
        budget=st.sampled_from([8, 16, 64]),
        blocks=st.sampled_from([8, 10, 40]),
        caching=st.booleans(),
        faults=st.integers(0, 2),
        spec=st.booleans(),
    )
    def build(self, budget: int, blocks: int, caching: bool, faults: int, spec: bool) -> None:
        self.faults_left = faults
        self.llm = make_async_llm(budget, blocks, caching, spec)
        self.traps = install_traps(self.llm, self.fault_log, SITES[:2] if spec else SITES)
        # compiled first: a request waiting for its compile would make the steps depend on the machine
        self.llm.engine.structured_output_manager.compile(GRAMMAR).result(timeout=60)
        scheduler = self.llm.engine.scheduler
        schedule = scheduler.schedule

        def recording_schedule() -> SchedulerOutput:  # the request objects of each step (NOTE 5)
            out = schedule()
            self.scheduled.append((out, {rid: scheduler.requests[rid] for rid in out.num_scheduled_tokens}))
            return out

        scheduler.schedule = recording_schedule

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    def _in_flight(self) -> list[SchedulerOutput]:
        return [so for _, so in self.engine._batch_queue]

    def _requests_of(self, steps: list[SchedulerOutput]) -> list[tuple[str, Request]]:
        """The (id, request object) pairs that ``steps`` scheduled."""
        return [pair for out, reqs in self.scheduled if any(out.same_step(s) for s in steps) for pair in reqs.items()]

    def _in_flight_live_ids(self) -> list[str]:
        """Live ids whose current request the step in flight computes."""
        requests = self.engine.scheduler.requests
        pairs = self._requests_of(self._in_flight())
        return sorted({rid for rid, req in pairs if rid in self.live and requests.get(rid) is req})

    def _retire(self, rid: str) -> None:
        del self.live[rid]
        self.retired.add(rid)

    def _add(self, rid: str, prompt: tuple[int, ...], max_tokens: int, reused: bool, in_flight: bool = False,
             constrained: bool = False) -> None:  # fmt: skip
        self.engine.add_request(rid, list(prompt), params(max_tokens, constrained))
        self.retired.discard(rid)
        self.live[rid] = Live(prompt, max_tokens, reused, in_flight, constrained)

    def _check_abort_outputs(self, outputs, chosen: list[str]) -> None:
        got = sorted(out.request_id for out in outputs)
        assert got == sorted(chosen), f"abort_request returned outputs for {got}; the live ones were {sorted(chosen)}"
        for out in outputs:
            req = self.live[out.request_id]
            tokens, want = list(out.outputs[0].token_ids), req.want()
            assert out.finished and out.outputs[0].finish_reason == "abort", f"abort output {out!r}"
            assert tokens == want[: len(tokens)], (
                f"aborted {out.request_id!r} (prompt {list(req.prompt)}) had {tokens}, not a prefix of {want}"
            )

    # -- adds --------------------------------------------------------------------------

    @precondition(lambda self: self.llm is not None)
    @rule(data=st.data(), requests=st.lists(st.tuples(prompts, st.integers(1, 10), st.booleans()), min_size=1, max_size=2),
          reuse=st.booleans())  # fmt: skip
    def add(self, data: st.DataObject, requests: list[tuple[tuple[int, ...], int, bool]], reuse: bool) -> None:
        """One or two requests (batches, and pools that run out), some under ``GRAMMAR``, the
        first under a retired id when ``reuse`` and there is one, the others under fresh ids."""
        for index, (prompt, max_tokens, constrained) in enumerate(requests):
            if reuse and index == 0 and self.retired:
                rid = data.draw(st.sampled_from(sorted(self.retired)), label="reused id")
                in_flight = any(rid in so.num_scheduled_tokens for so in self._in_flight())
                self._add(rid, prompt, max_tokens, reused=True, in_flight=in_flight, constrained=constrained)
                continue
            self.counter += 1
            self._add(f"r{self.counter}", prompt, max_tokens, reused=False, constrained=constrained)

    # -- aborts ------------------------------------------------------------------------

    @precondition(lambda self: self.llm is not None)
    @rule(data=st.data(), extra=st.sampled_from(["none", "unknown", "retired"]))
    def abort(self, data: st.DataObject, extra: str) -> None:
        chosen: list[str] = []
        if self.live:
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=2), label="live ids")
        ids = list(chosen)
        if extra == "retired" and self.retired:
            ids.append(data.draw(st.sampled_from(sorted(self.retired)), label="retired id"))
        elif extra == "unknown" or not ids:
            ids.append("never-added")
        self._check_abort_outputs(self.engine.abort_request(ids), chosen)
        for rid in chosen:
            self._retire(rid)

    def _abort_launched(self, data: st.DataObject, reuse: bool) -> None:
        """Abort a request that the step just launched computes; with ``reuse``, add a new
        request under its id at once, before that step is read back (``async_scheduler.py``
        NOTE 5: the old step's token must not reach it)."""
        launched = self._in_flight_live_ids()
        if not launched:
            return
        rid = data.draw(st.sampled_from(launched), label="id in flight")
        self._check_abort_outputs(self.engine.abort_request(rid), [rid])
        self._retire(rid)
        event("aborted with a step in flight")
        if reuse:
            prompt = data.draw(prompts, label="prompt under the reused id")
            max_tokens, constrained = data.draw(st.integers(1, 10), label="max_tokens"), data.draw(st.booleans(), label="constrained")
            self._add(rid, prompt, max_tokens, reused=True, in_flight=True, constrained=constrained)
        self.engine_is_consistent()

    # -- faults ------------------------------------------------------------------------

    @precondition(lambda self: self.faults_left > 0 and self.llm is not None and self.live)
    @rule(data=st.data(), skip=st.integers(0, 1))
    def fault_with_a_step_in_flight(self, data: st.DataObject, skip: int) -> None:
        """With a step in flight (launched here if none is), arm a site to raise at its
        ``skip + 1``-th next call, then step until it fires (``skip + 1`` steps at most): the
        step it hits has two in flight."""
        site = data.draw(st.sampled_from(sorted(self.traps)), label="site")
        self.faults_left -= 1
        if not self.engine._batch_queue:
            self._step_once()
            self.engine_is_consistent()
        trap = self.traps[site]
        trap.arm(skip)
        for _ in range(skip + 1):
            self._step_once()
            self.engine_is_consistent()
            if not trap.armed:
                break
        trap.armed = False  # not reached (no step called it): disarmed, not left for a later rule

    # -- steps -------------------------------------------------------------------------

    @precondition(lambda self: self.llm is not None)
    @rule(data=st.data(), times=st.integers(1, 4), then=st.sampled_from(["nothing", "abort", "abort_and_reuse"]))
    def step(self, data: st.DataObject, times: int, then: str) -> None:
        """Step ``times`` times; then maybe abort a request the last step launched (and reuse its id)."""
        for _ in range(times):
            self._step_once()
            self.engine_is_consistent()
        if then != "nothing":
            self._abort_launched(data, reuse=then == "abort_and_reuse")

    @precondition(lambda self: self.llm is not None and self.engine.has_unfinished_requests())
    @rule()
    def drain(self) -> None:
        for _ in range(DRAIN_LIMIT):
            if not self.engine.has_unfinished_requests():
                break
            self._step_once()
            self.engine_is_consistent()
        assert not self.live, f"requests {sorted(self.live)} still unfinished after {DRAIN_LIMIT} steps"
        assert not self.engine._batch_queue, f"steps still in flight after {DRAIN_LIMIT} steps"

    def _step_once(self) -> None:
        engine = self.engine
        before = {rid: engine.scheduler.requests.get(rid) for rid in self.live}
        in_flight_before = self._in_flight()
        known = len(self.scheduled)
        mark = len(self.fault_log)
        try:
            outputs = engine.step()
        except Boom as error:
            self._check_failed_step(error, mark, before, in_flight_before, known)
            return
        raised = self.fault_log[mark:]
        assert not raised, f"step() returned normally although the injected fault {raised[0]!r} was raised in it"
        for out in outputs:
            rid = out.request_id
            assert rid in self.live, f"step() returned an output for {rid!r}, which is not live: {out!r}"
            req = self.live[rid]
            tokens, want = list(out.outputs[0].token_ids), req.want()
            assert out.finished and out.outputs[0].finish_reason == "length", f"{rid!r}: {out!r}"
            assert tokens == want, (
                f"request {rid!r} (id reused: {req.reused}, while its old step was in flight: "
                f"{req.reused_in_flight}; prompt {list(req.prompt)}, max_tokens {req.max_tokens}, grammar {req.constrained}) "
                f"finished with {tokens}; a fresh synchronous engine gives {want}"
            )
            self._retire(rid)
            event("an id reused while its aborted step was in flight finished" if req.reused_in_flight
                  else "a reused id finished" if req.reused else "a fresh id finished")  # fmt: skip
            if out.num_cached_tokens:
                event("a prefix-cache hit")
            if req.constrained:
                event("a constrained request finished")
        if engine.scheduler.num_preemptions:
            event("a preemption happened")
        if engine.scheduler.spec_stats.num_accepted_tokens:
            event("drafts were kept (speculative decoding)")
        self._forget_read_back()

    def _check_failed_step(
        self, error: Boom, mark: int, before: dict[str, Request | None], in_flight_before: list[SchedulerOutput], known: int
    ) -> None:
        """The step raised the injected fault, and took down exactly the requests of the steps
        in flight (those queued before it and the one it scheduled), by request object."""
        raised = self.fault_log[mark:]
        for trap in self.traps.values():  # a fault fires in one step at most
            trap.armed = False
        assert raised and error is raised[0], f"step() raised {error!r}; the first fault raised in it was {raised[:1]}"
        steps = [*in_flight_before, *(out for out, _ in self.scheduled[known:])]  # the one scheduled in this call
        failed_objects = [req for _, req in self._requests_of(steps)]
        doomed = {rid for rid, req in before.items() if any(req is f for f in failed_objects)}
        left = self.engine.unfinished_request_ids()
        expected = set(self.live) - doomed
        assert left == expected, (
            f"after a step failed with {error!r} ({len(steps)} steps in flight): the requests of those steps "
            f"{sorted(doomed)} should be aborted and the others {sorted(expected)} carry on, but "
            f"unfinished_request_ids() is {sorted(left)} (lost: {sorted(expected - left)}, kept: {sorted(left & doomed)})"
        )
        for rid in doomed:
            self._retire(rid)
        assert not self.engine._batch_queue, "steps left in flight after a failed step"
        event(f"a step failed with {len(steps)} steps in flight")
        self.scheduled.clear()

    def _forget_read_back(self) -> None:
        in_flight = self._in_flight()
        self.scheduled = [(out, reqs) for out, reqs in self.scheduled if any(out.same_step(s) for s in in_flight)]

    def teardown(self) -> None:
        """Liveness: faults off, every live request finishes with the fresh tokens, every step
        is read back, and the pool ends whole with no uncommitted block. Skipped when a rule
        already failed (a second error would hide the first)."""
        if self.llm is None or sys.exc_info()[1] is not None:
            return
        for trap in self.traps.values():
            trap.armed = False
        self.faults_left = 0
        self.drain()
        kv = self.engine.scheduler.kv_cache_manager
        assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks and kv.uncommitted_blocks == []

    # -- after every rule --------------------------------------------------------------

    @invariant()
    def engine_is_consistent(self) -> None:
        if self.llm is not None:
            assert_async_engine_consistent(self.engine, set(self.live), "after a rule")


AsyncSchedulingSoak.TestCase.settings = settings(max_examples=20, stateful_step_count=20)
TestAsyncSchedulingSoak = AsyncSchedulingSoak.TestCase
TestAsyncSchedulingSoak.pytestmark = [pytest.mark.slow]  # 20 runs of 20 rules: over the fast set's 3 s


# ---------------------------------------------------------------------------------------
# A defect the soak found, as its smallest example
# ---------------------------------------------------------------------------------------


def test_a_failed_step_spares_a_request_added_under_a_reused_id() -> None:
    """Step 1 launches ``r`` and ``a``; ``r`` is aborted and a new ``r`` added while step 1 is
    in flight; step 2 schedules only ``a`` (an 8-token budget, ``a``'s prompt chunk takes it)
    and its forward raises. Steps 1 and 2 go down with ``a`` and the old ``r``; the new ``r``
    was in neither, so it must carry on and get the synchronous engine's tokens."""
    llm = LLM(model_folder(), device="cpu", max_model_len=32, block_size=4, max_num_batched_tokens=8,
              num_gpu_blocks_override=40, max_num_seqs=4, async_scheduling=True)  # fmt: skip
    engine, fault = llm.engine, Fault(at=1)
    engine.add_request("r", [5, 6, 7, 8], greedy(4))
    engine.add_request("a", list(range(10, 30)), greedy(4))
    assert engine.step() == [] and [dict(so.num_scheduled_tokens) for _, so in engine._batch_queue] == [{"r": 4, "a": 4}]
    engine.abort_request("r")
    engine.add_request("r", [9, 10, 11, 12], greedy(4))  # while the old r's step is in flight
    inject(llm, "forward", fault)
    with pytest.raises(Boom):
        engine.step()
    assert engine.unfinished_request_ids() == {"r"}, "the new r was in no failed step: it carries on"
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished}
        engine.check_invariants()
    assert finished == {"r": fresh((9, 10, 11, 12), 4)}
