"""Soak test of the engine's request lifecycle (issue 23): ``LLMEngine`` and ``AsyncLLM``
under random adds, aborts, id reuse, early closes, faults, shutdowns and restarts.

Concept: drive the real engine (tiny random Qwen3, CPU, block size 4, pools of 8-40 blocks
so that preemption happens) with random operations and check, after every step, facts that
need no copy of the engine: the block pool's accounting, the set of requests the engine
tracks against the set the test considers live, and each finished request's tokens
against what a fresh engine gives its prompt alone (greedy, ``ignore_eos``: deterministic
and independent of batching, chunking, preemption and prefix-cache hits).

1. ``EngineSoak`` (a Hypothesis state machine over ``llm.engine``). Rules: add a request
   under a fresh id, under a reused id (one whose request finished, was aborted or failed),
   or under a live id (``ValueError``, nothing changes); abort live, unknown and retired ids
   (the blocks go back at once; when ``abort_request`` returns outputs, one per live id,
   ``finished`` with ``finish_reason="abort"`` and a prefix of the fresh tokens); step 1-4
   times; drain (step until nothing is live); arm a fault (up to 3 per run) in the
   forward, the sampler, a logits processor's ``apply`` or ``update_state``, optionally
   with a second fault raised by ``update_state`` at its next call, which is the recovery's
   ``input_batch.reset()`` (for ``update_state`` itself: a processor that raises twice in
   a row). Checked for a step that raises: it raises the first injected fault itself (the
   same object), exactly the requests that step scheduled leave
   ``unfinished_request_ids()``, the others carry on. Checked for a step that returns:
   every output is for a live request, finished with ``finish_reason="length"`` and the
   fresh engine's tokens, a reused id included. Checked after every rule and every step
   (``assert_engine_consistent``): ``LLMEngine.check_invariants()`` (the scheduler's and
   the runner's own checks, the engine's unfinished ids == the scheduler's, the runner
   keeps no state of a request that is neither unfinished nor about to be reported
   finished, and the runner's block ids and output tokens of every request that ran equal
   the scheduler's), the engine's unfinished ids == the test's live ids, only those hold
   blocks, the blocks in use are exactly theirs and free + held == the pool, and no
   uncommitted block. Teardown
   (liveness): faults off, every request still live finishes with the fresh tokens, and
   the pool ends whole.
2. ``test_async_consumers_soak``: concurrent lanes of ``AsyncLLM.generate`` consumers, each
   lane reusing its id right after the previous consumer ended; consumers read to the end,
   ``aclose()``, ``break`` (inside ``aclosing``), get cancelled, or ``await abort(id)`` and
   read on; some try a second ``generate`` with their live id (``ValueError``); a fault may
   be armed. Every await has a timeout (``TIMEOUT``), so a hang is a failure. Checked: every
   consumer ends (its finished output, the abort output, the injected fault itself, never
   anything else), finished outputs carry the fresh tokens, partial ones a prefix of them;
   after every engine step the structural checks above (recorded in the engine thread);
   at the end, in the engine thread, nothing unfinished and every block free.
3. ``test_async_llm_shutdown_and_restart``: the same ``AsyncLLM`` serves a second
   ``asyncio.run`` after the first returned; ``shutdown()`` ends every live consumer with
   ``EngineDeadError`` and leaves no unfinished request and no held block; ``generate``
   after shutdown raises ``EngineDeadError``; a new ``AsyncLLM`` on the same ``LLM`` then
   serves fresh outputs under the old ids.

Left out: sampling with temperature (seeded sampling has its own property test in
``test_engine_faults_and_seeds.py``), stop strings and text, ``KeyboardInterrupt`` faults
(``tests/test_engine_failures.py``), CUDA graphs and GPUs, the OpenAI server, and which
requests an async fault hits (timing decides; any consumer may get it, and each must end).

Bounded for CI: explicit ``@settings`` on each test (not the profile's), tiny shapes
(``max_model_len`` 32 or 64, 3-20 token prompts, at most 4 sequences) and one torch
thread (``one_torch_thread``); the file runs in about 15 s on two shared cores under
``CI=true`` while it passes. A failure costs more: the state machine shrinks its
counterexample (minutes), and each async hang costs ``TIMEOUT``; the async tests do not
shrink (``ASYNC_PHASES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import tempfile
from collections.abc import AsyncGenerator, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine_failures import Boom, Fault, inject  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.core.sched_output import SchedulerOutput  # noqa: E402
from tinyvllm.engine.async_llm import AsyncLLM, EngineDeadError  # noqa: E402
from tinyvllm.engine.llm_engine import LLMEngine  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402
from tinyvllm.outputs import RequestOutput  # noqa: E402
from tinyvllm.sampling_params import RequestOutputKind  # noqa: E402

SITES = ("forward", "sampler", "apply", "update_state")  # where a fault can be injected
TIMEOUT = 5.0  # seconds any await on AsyncLLM may take before it counts as a hang
DRAIN_LIMIT = 2000  # steps a drain allows before "never finishes" is a failure (50 adds need ~200)
STEMS = [[(11 * i + 3) % 300 + 10 for i in range(12)], [(7 * i + 1) % 300 + 10 for i in range(8)]]

# Prompts of 3-20 token ids in [5, 400), often sharing a stem: prefix-cache hits.
prompts = st.builds(
    lambda stem, cut, tail: tuple((STEMS[stem][:cut] + tail)[:20]),
    st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(5, 399), min_size=3, max_size=8),
)  # fmt: skip


# ---------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread while this module runs: for a model this small, two threads on a
    shared two-core machine made the soak five times slower, not faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def model_folder() -> str:
    return str(build_tiny_model(Path(tempfile.mkdtemp()) / "qwen3", "qwen3"))


@functools.cache
def reference_llm() -> LLM:
    return LLM(model_folder(), device="cpu", max_model_len=64, block_size=4, enable_prefix_caching=False)


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


@functools.cache
def fresh(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """The greedy tokens a fresh engine gives ``prompt`` alone."""
    [out] = reference_llm().generate({"prompt_token_ids": list(prompt)}, greedy(max_tokens), use_tqdm=False)
    return list(out.outputs[0].token_ids)


def make_llm(max_model_len: int, budget: int, blocks: int, caching: bool) -> LLM:
    return LLM(model_folder(), device="cpu", max_model_len=max_model_len, block_size=4,
               max_num_batched_tokens=budget, num_gpu_blocks_override=blocks, max_num_seqs=4,
               enable_prefix_caching=caching)  # fmt: skip


class Trap(Fault):
    """A fault site's switch (``inject`` calls ``trigger``): when armed, raises
    ``Boom`` once, after letting ``skip`` triggers pass. Every error it raises is appended
    to the shared ``log``, so a test knows which error came first. ``then``: a trap armed
    (to raise on its very next trigger) at the moment this one raises: the ``update_state``
    trap, whose next trigger is the recovery's ``input_batch.reset()``."""

    def __init__(self, site: str, log: list[BaseException]) -> None:
        super().__init__(at=0)  # Fault's own "at" never matches: arm() decides
        self.site, self.log = site, log
        self.armed, self.skip, self.message = False, 0, "injected fault"
        self.then: Trap | None = None

    def arm(self, skip: int = 0, then: Trap | None = None, message: str = "injected fault") -> None:
        self.armed, self.skip, self.then, self.message = True, skip, then, message

    def disarm(self) -> None:
        self.armed, self.then = False, None

    def trigger(self) -> None:
        self.calls += 1
        if not self.armed:
            return
        if self.skip:
            self.skip -= 1
            return
        then, self.armed, self.then = self.then, False, None
        error = Boom(self.message)
        self.log.append(error)
        if then is not None:
            then.arm(0, message=f"injected fault again, in {then.site} during the recovery from the first")
        raise error


def install_traps(llm: LLM, log: list[BaseException]) -> dict[str, Trap]:
    traps = {site: Trap(site, log) for site in SITES}
    for site, trap in traps.items():
        inject(llm, site, trap)
    return traps


def assert_engine_consistent(engine: LLMEngine, live: Collection[str] | None, when: str) -> None:
    """The structural checks run after every step: invariants, the tracked requests (equal
    to ``live`` unless it is None), and the block accounting (no leaked block)."""
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_manager
    try:  # the scheduler, the runner, and their two copies of every request (LLMEngine.check_invariants)
        engine.check_invariants()
    except AssertionError as error:
        raise AssertionError(f"{when}: {error}") from error
    tracked = engine.unfinished_request_ids()
    unfinished = set(scheduler.requests)
    if live is not None:
        live = set(live)
        assert tracked == live, (
            f"{when}: the engine tracks {sorted(tracked)}, the live requests are {sorted(live)}: "
            f"left tracked {sorted(tracked - live)}, lost {sorted(live - tracked)}"
        )
    holders = {rid for rid, blocks in kv.req_to_blocks.items() if blocks}
    assert holders <= unfinished, (
        f"{when}: requests {sorted(holders - unfinished)} are not unfinished but hold blocks "
        f"{ {rid: kv.get_block_ids(rid) for rid in holders - unfinished} }"
    )
    held = {block.block_id for rid in unfinished for block in kv.req_to_blocks.get(rid, [])}
    in_use = {block.block_id for block in kv.block_pool.blocks if block.ref_cnt > 0}
    assert in_use == held, (
        f"{when}: blocks in use {sorted(in_use)} != blocks held by unfinished requests {sorted(held)} "
        f"(leaked: {sorted(in_use - held)})"
    )
    free = kv.block_pool.get_num_free_blocks()
    assert free + len(held) == kv.num_gpu_blocks, (
        f"{when}: {free} free blocks + {len(held)} held by unfinished requests != the pool's {kv.num_gpu_blocks}"
    )
    assert kv.uncommitted_blocks == [], (
        f"{when}: uncommitted blocks {[b.block_id for b in kv.uncommitted_blocks]} outside a step"
    )


def install_step_checks(llm: LLM) -> list[str]:
    """Run ``assert_engine_consistent`` after every ``llm.engine.step()`` (in whatever thread
    steps), recording violations in the returned list instead of raising inside the engine."""
    engine = llm.engine
    step = engine.step
    violations: list[str] = []
    steps = 0

    def checked_step() -> list[RequestOutput]:
        nonlocal steps
        steps += 1
        try:
            return step()
        finally:
            try:
                assert_engine_consistent(engine, None, f"after engine step {steps}")
            except AssertionError as error:
                violations.append(str(error))

    engine.step = checked_step
    return violations


# ---------------------------------------------------------------------------------------
# 1. LLMEngine: a state machine
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Live:
    """A request the test considers unfinished."""

    prompt: tuple[int, ...]
    max_tokens: int
    reused: bool  # its id served an earlier request


class EngineSoak(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None
        self.live: dict[str, Live] = {}
        self.retired: set[str] = set()  # ids whose requests finished, were aborted or failed
        self.counter = 0
        self.fault_log: list[BaseException] = []
        self.traps: dict[str, Trap] = {}
        self.last_schedule: SchedulerOutput | None = None
        self.faults_left = 0

    @initialize(
        budget=st.sampled_from([8, 16, 64]),
        blocks=st.sampled_from([8, 10, 40]),
        caching=st.booleans(),
        faults=st.integers(0, 3),
    )
    def build(self, budget: int, blocks: int, caching: bool, faults: int) -> None:
        self.faults_left = faults  # a fault aborts every request of its step: a few, or none finish
        self.llm = make_llm(32, budget, blocks, caching)
        self.traps = install_traps(self.llm, self.fault_log)
        scheduler = self.llm.engine.scheduler
        schedule = scheduler.schedule

        def recording_schedule() -> SchedulerOutput:  # which requests a failed step held
            self.last_schedule = schedule()
            return self.last_schedule

        scheduler.schedule = recording_schedule

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    def _retire(self, rid: str) -> None:
        del self.live[rid]
        self.retired.add(rid)

    def _add(self, rid: str, prompt: tuple[int, ...], max_tokens: int, reused: bool) -> None:
        self.engine.add_request(rid, list(prompt), greedy(max_tokens))
        self.retired.discard(rid)
        self.live[rid] = Live(prompt, max_tokens, reused)

    # -- adds --------------------------------------------------------------------------

    @precondition(lambda self: self.llm is not None)
    @rule(prompt=prompts, max_tokens=st.integers(1, 10))
    def add_new(self, prompt: tuple[int, ...], max_tokens: int) -> None:
        self.counter += 1
        self._add(f"r{self.counter}", prompt, max_tokens, reused=False)

    @precondition(lambda self: self.llm is not None and self.retired)
    @rule(data=st.data(), prompt=prompts, max_tokens=st.integers(1, 10))
    def add_reused_id(self, data: st.DataObject, prompt: tuple[int, ...], max_tokens: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.retired)), label="reused id")
        self._add(rid, prompt, max_tokens, reused=True)

    @precondition(lambda self: self.llm is not None and self.live)
    @rule(data=st.data(), prompt=prompts, max_tokens=st.integers(1, 10))
    def add_live_id_is_refused(self, data: st.DataObject, prompt: tuple[int, ...], max_tokens: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)), label="live id")
        before = self._snapshot(rid)
        try:
            self.engine.add_request(rid, list(prompt), greedy(max_tokens))
        except ValueError:
            pass
        else:
            raise AssertionError(f"add_request({rid!r}) accepted an id whose request is still unfinished")
        after = self._snapshot(rid)
        assert after == before, f"a refused add_request({rid!r}) changed the engine: {before} -> {after}"

    def _snapshot(self, rid: str) -> tuple:
        scheduler = self.engine.scheduler
        request = scheduler.requests[rid]
        return (
            sorted(self.engine.unfinished_request_ids()),
            [r.request_id for r in scheduler.waiting],
            [r.request_id for r in scheduler.running],
            scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            tuple(request.prompt_token_ids),
            request.sampling_params,
        )

    # -- aborts ------------------------------------------------------------------------

    @precondition(lambda self: self.llm is not None)
    @rule(data=st.data(), extra=st.sampled_from(["none", "unknown", "retired"]), as_str=st.booleans())
    def abort(self, data: st.DataObject, extra: str, as_str: bool) -> None:
        chosen: list[str] = []
        if self.live:
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=2), label="live ids")
        ids = list(chosen)
        if extra == "retired" and self.retired:
            ids.append(data.draw(st.sampled_from(sorted(self.retired)), label="retired id"))
        elif extra == "unknown" or not ids:
            ids.append("never-added")
        result = self.engine.abort_request(ids[0] if as_str and len(ids) == 1 else ids)
        if result is not None:  # after the fix: the final output of each live one
            got = sorted(out.request_id for out in result)
            assert got == sorted(chosen), (
                f"abort_request({ids}) returned outputs for {got}; the live ones were {sorted(chosen)}"
            )
            for out in result:
                req = self.live[out.request_id]
                tokens = list(out.outputs[0].token_ids)
                want = fresh(req.prompt, req.max_tokens)
                assert out.finished and out.outputs[0].finish_reason == "abort", (
                    f"abort output of {out.request_id!r}: finished={out.finished}, "
                    f"finish_reason={out.outputs[0].finish_reason!r}; expected True, 'abort'"
                )
                assert tokens == want[: len(tokens)], (
                    f"aborted {out.request_id!r} (id reused: {req.reused}, prompt {list(req.prompt)}) had "
                    f"{tokens}, not a prefix of the fresh engine's {want}"
                )
        for rid in chosen:
            self._retire(rid)

    # -- faults ------------------------------------------------------------------------

    @precondition(lambda self: self.faults_left > 0 and not any(t.armed for t in self.traps.values()))
    @rule(site=st.sampled_from(SITES), skip=st.integers(0, 3), recovery_fails=st.booleans())
    def arm_fault(self, site: str, skip: int, recovery_fails: bool) -> None:
        """Raise at the ``skip + 1``-th next call of ``site``; with ``recovery_fails``,
        ``update_state`` raises again at its next call, the recovery's ``input_batch.reset()``."""
        self.faults_left -= 1
        self.traps[site].arm(skip, then=self.traps["update_state"] if recovery_fails else None)

    # -- steps -------------------------------------------------------------------------

    @precondition(lambda self: self.llm is not None)
    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            self._step_once()
            self.engine_is_consistent()

    @precondition(lambda self: self.llm is not None and self.live)
    @rule()
    def drain(self) -> None:
        for _ in range(DRAIN_LIMIT):
            if not self.live:
                break
            self._step_once()
            self.engine_is_consistent()
        assert not self.live, f"requests {sorted(self.live)} still unfinished after {DRAIN_LIMIT} steps"

    def _step_once(self) -> None:
        engine = self.engine
        before = set(self.live)
        mark = len(self.fault_log)
        self.last_schedule = None
        try:
            outputs = engine.step()
        except Exception as error:
            raised = self.fault_log[mark:]
            for trap in self.traps.values():  # a fault fires in one step at most
                trap.disarm()
            assert raised, f"step() raised {error!r}, but no fault was injected"
            assert error is raised[0], (
                f"step() raised {error!r}; the original error was the first injected fault "
                f"{raised[0]!r} (raised in this step, in order: {raised})"
            )
            scheduled = set(self.last_schedule.num_scheduled_tokens) if self.last_schedule is not None else set()
            left = engine.unfinished_request_ids()
            assert left == before - scheduled, (
                f"after a step failed with {error!r} (faults raised: {raised}): the step's requests "
                f"{sorted(scheduled)} should be aborted and the others {sorted(before - scheduled)} carry on, "
                f"but unfinished_request_ids() is {sorted(left)} (still tracked: {sorted(left & scheduled)}, "
                f"lost: {sorted((before - scheduled) - left)})"
            )
            for rid in scheduled & before:
                self._retire(rid)
            event(f"a step failed ({len(raised)} faults raised in it)")
            return
        raised = self.fault_log[mark:]
        assert not raised, f"step() returned normally although the injected fault {raised[0]!r} was raised in it"
        for out in outputs:
            rid = out.request_id
            assert rid in self.live, f"step() returned an output for {rid!r}, which is not live: {out!r}"
            req = self.live[rid]
            tokens = list(out.outputs[0].token_ids)
            want = fresh(req.prompt, req.max_tokens)
            assert out.finished and out.outputs[0].finish_reason == "length", (
                f"{rid!r}: a FINAL_ONLY request's output should be finished by length, got "
                f"finished={out.finished}, finish_reason={out.outputs[0].finish_reason!r}"
            )
            assert tokens == want, (
                f"request {rid!r} (id reused: {req.reused}, prompt {list(req.prompt)}, max_tokens "
                f"{req.max_tokens}) finished with {tokens}; a fresh engine gives {want}"
            )
            self._retire(rid)
            event("a reused id finished" if req.reused else "a fresh id finished")
            if out.num_cached_tokens:
                event("a prefix-cache hit")
        if engine.scheduler.num_preemptions:
            event("a preemption happened")

    def teardown(self) -> None:
        """Liveness: with the faults disarmed, every request still live finishes with the
        fresh engine's tokens and the pool ends whole. Skipped when a rule already failed
        (teardown runs in Hypothesis's ``finally``; a second error would hide the first)."""
        if self.llm is None or sys.exc_info()[1] is not None:
            return
        for trap in self.traps.values():
            trap.disarm()
        self.faults_left = 0
        self.drain()
        self.engine_is_consistent()  # nothing live: every block free

    # -- after every rule --------------------------------------------------------------

    @invariant()
    def engine_is_consistent(self) -> None:
        if self.llm is not None:
            assert_engine_consistent(self.engine, self.live, "after a rule")


EngineSoak.TestCase.settings = settings(max_examples=150, stateful_step_count=50)
TestEngineSoak = EngineSoak.TestCase
TestEngineSoak.pytestmark = [pytest.mark.slow]  # 150 examples of 50 steps: about 20 s on two cores


# ---------------------------------------------------------------------------------------
# AsyncLLM helpers
# ---------------------------------------------------------------------------------------

STOPS = ("full", "aclose", "break", "cancel", "abort")
# No shrinking for the AsyncLLM tests: each hang costs TIMEOUT seconds, and shrinking a
# failure took Hypothesis over five minutes. Their examples are small enough to read as found.
ASYNC_PHASES = (Phase.explicit, Phase.reuse, Phase.generate)


@dataclass(frozen=True)
class Client:
    """One ``generate`` consumer: what it asks for and how it stops."""

    prompt: tuple[int, ...]
    max_tokens: int
    kind: RequestOutputKind
    how: str  # one of STOPS: read to the end, or stop early after `after` + 1 outputs
    after: int
    probe_duplicate: bool  # after its first output, a second generate with its id must fail

    def label(self, rid: str) -> str:
        return (f"consumer {rid!r} ({self.how} after {self.after + 1} outputs, {self.kind.name}, "
                f"prompt {list(self.prompt)}, max_tokens {self.max_tokens})")  # fmt: skip


@st.composite
def clients(draw: st.DrawFn, stops: tuple[str, ...] = STOPS) -> Client:
    """A consumer; one that stops early asks for 8-16 tokens and streams (DELTA or CUMULATIVE),
    so that it is still live when it stops."""
    how = draw(st.sampled_from(stops))
    early = how != "full"
    kinds = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE] + ([] if early else [RequestOutputKind.FINAL_ONLY])
    return Client(
        prompt=draw(prompts),
        max_tokens=draw(st.integers(8, 16) if early else st.integers(1, 6)),
        kind=draw(st.sampled_from(kinds)),
        how=how,
        after=draw(st.integers(0, 2)),
        probe_duplicate=draw(st.booleans()),
    )


def lanes_of(stops: tuple[str, ...]) -> st.SearchStrategy[list[list[Client]]]:
    """1-3 lanes of 1-4 consumers each."""
    return st.lists(st.lists(clients(stops), min_size=1, max_size=4), min_size=1, max_size=3)


@dataclass
class Ended:
    """How one consumer ended."""

    outputs: list[RequestOutput] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    stopped: str = ""  # "closed" or "cancelled" when the consumer stopped early
    abort_sent: bool = False
    error: BaseException | None = None

    def take(self, out: RequestOutput, kind: RequestOutputKind) -> None:
        self.outputs.append(out)
        ids = list(out.outputs[0].token_ids)
        self.tokens = self.tokens + ids if kind == RequestOutputKind.DELTA else ids


def prompt_of(client: Client) -> dict:
    return {"prompt_token_ids": list(client.prompt)}


Stream = AsyncGenerator[RequestOutput, None]


async def next_output(stream: Stream, label: str, ended: Ended) -> RequestOutput | None:
    """The stream's next output; None when it stops. No output and no end within TIMEOUT fails."""
    try:
        return await asyncio.wait_for(anext(stream), TIMEOUT)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise AssertionError(
            f"{label}: no output and no end within {TIMEOUT}s after {len(ended.outputs)} outputs (a hang)"
        ) from None


async def probe_duplicate(engine: AsyncLLM, rid: str) -> None:
    probe = engine.generate({"prompt_token_ids": [5, 6, 7]}, greedy(1), rid)
    try:
        out = await asyncio.wait_for(anext(probe), TIMEOUT)
    except ValueError:
        return
    except TimeoutError:
        raise AssertionError(f"a second generate with the live id {rid!r} neither failed nor yielded within {TIMEOUT}s") from None  # fmt: skip
    raise AssertionError(
        f"a second generate with the live id {rid!r} was accepted (it yielded {out!r}); expected ValueError"
    )


async def drive(engine: AsyncLLM, rid: str, client: Client) -> Ended:
    """Run one consumer as ``client`` says; returns how it ended (a hang raises)."""
    ended = Ended()
    label = client.label(rid)
    stream = engine.generate(prompt_of(client), greedy(client.max_tokens, client.kind), rid)
    try:
        if client.how == "cancel":
            await cancel_midway(stream, client, ended, label)
        elif client.how == "break":

            async def read_then_break() -> None:
                async with contextlib.aclosing(stream) as outs:
                    async for out in outs:
                        ended.take(out, client.kind)
                        if out.finished:
                            return
                        if len(ended.outputs) > client.after:
                            ended.stopped = "closed"
                            break

            try:
                await asyncio.wait_for(read_then_break(), 2 * TIMEOUT)
            except TimeoutError:
                raise AssertionError(f"{label}: did not end within {2 * TIMEOUT}s (a hang)") from None
        else:
            while (out := await next_output(stream, label, ended)) is not None:
                ended.take(out, client.kind)
                if out.finished:
                    after = await next_output(stream, label, ended)
                    assert after is None, f"{label}: the stream went on after its finished output: {after!r}"
                    break
                if client.probe_duplicate and len(ended.outputs) == 1:
                    await probe_duplicate(engine, rid)
                if len(ended.outputs) > client.after and client.how == "aclose":
                    await asyncio.wait_for(stream.aclose(), TIMEOUT)
                    ended.stopped = "closed"
                    break
                if len(ended.outputs) > client.after and client.how == "abort" and not ended.abort_sent:
                    await asyncio.wait_for(engine.abort(rid), TIMEOUT)
                    ended.abort_sent = True
    except (Boom, EngineDeadError) as error:
        ended.error = error
    return ended


async def cancel_midway(stream: Stream, client: Client, ended: Ended, label: str) -> None:
    """Read in a task; cancel the task once it has ``after`` + 1 outputs (what a server does
    when its client disconnects)."""
    enough = asyncio.Event()

    async def read() -> None:
        try:
            async for out in stream:
                ended.take(out, client.kind)
                if len(ended.outputs) > client.after:
                    enough.set()
        finally:
            enough.set()

    task = asyncio.create_task(read())
    try:
        await asyncio.wait_for(enough.wait(), TIMEOUT)
    except TimeoutError:
        task.cancel()
        raise AssertionError(f"{label}: no output within {TIMEOUT}s (a hang)") from None
    if not task.done():
        task.cancel()
    done, _ = await asyncio.wait({task}, timeout=TIMEOUT)
    assert done, f"{label}: the cancelled consumer task did not end within {TIMEOUT}s"
    if task.cancelled():
        ended.stopped = "cancelled"
    elif task.exception() is not None:
        raise task.exception()


def check_ended(rid: str, client: Client, ended: Ended, fault_log: list[BaseException], shut_down: bool) -> None:
    """Every consumer ends in a way the contract allows, with tokens a fresh engine agrees with."""
    label = client.label(rid)
    want = fresh(client.prompt, client.max_tokens)
    outcome = type(ended.error).__name__ if ended.error else ended.stopped or (
        ended.outputs[-1].outputs[0].finish_reason if ended.outputs else "no output")
    event(f"{client.how} consumer ended: {outcome}")
    assert ended.tokens == want[: len(ended.tokens)], (
        f"{label}: got tokens {ended.tokens}, not a prefix of the fresh engine's {want}"
    )
    early_finished = [o for o in ended.outputs[:-1] if o.finished]
    assert not early_finished, f"{label}: a finished output before the last: {early_finished}"
    if ended.error is not None:
        if isinstance(ended.error, EngineDeadError):
            assert shut_down, f"{label}: EngineDeadError while the engine was not shut down: {ended.error!r}"
        else:
            assert fault_log and ended.error is fault_log[0], (
                f"{label}: generate raised {ended.error!r}; the only error allowed is the first "
                f"injected fault, {fault_log[:1]} (all raised: {fault_log})"
            )
        return
    if ended.stopped:
        return  # closed or cancelled early: the prefix check above is all there is
    assert ended.outputs, f"{label}: the stream ended without any output"
    last = ended.outputs[-1]
    reason = last.outputs[0].finish_reason
    assert last.finished, f"{label}: the stream ended after an unfinished output {last!r}"
    if reason == "abort":
        assert client.how == "abort" and ended.abort_sent, f"{label}: finished with 'abort', but nobody aborted it"
    else:
        assert reason == "length", f"{label}: finish_reason {reason!r}, expected 'length'"
        assert ended.tokens == want, f"{label}: finished with {ended.tokens}; a fresh engine gives {want}"


async def run_lanes(engine: AsyncLLM, lanes: list[list[Client]], prefix: str) -> list[tuple[str, Client, Ended]]:
    """Lanes run concurrently; within a lane, consumers run one after another under one id."""
    results: list[tuple[str, Client, Ended]] = []

    async def lane(rid: str, queue: list[Client]) -> None:
        for client in queue:
            results.append((rid, client, await drive(engine, rid, client)))

    await asyncio.gather(*(lane(f"{prefix}{i}", queue) for i, queue in enumerate(lanes)))
    return results


async def assert_idle(engine: AsyncLLM, when: str) -> None:
    """In the engine thread, after every abort already submitted: nothing live, no block held."""
    try:
        check = engine.run_in_engine_thread(assert_engine_consistent, engine.engine, set(), when)
        await asyncio.wait_for(check, TIMEOUT)
    except TimeoutError:
        raise AssertionError(f"{when}: the engine thread did not answer within {TIMEOUT}s") from None


# ---------------------------------------------------------------------------------------
# 2. AsyncLLM: concurrent consumers, early stops, aborts, id reuse, a fault
# ---------------------------------------------------------------------------------------


@settings(max_examples=60, phases=ASYNC_PHASES)
@given(
    lanes=lanes_of(STOPS),
    fault=st.none() | st.tuples(st.sampled_from(SITES), st.integers(0, 6), st.booleans()),  # site, skip, recovery fails
    budget=st.sampled_from([8, 32]),
    blocks=st.sampled_from([16, 40]),
    caching=st.booleans(),
)
@pytest.mark.slow
def test_async_consumers_soak(
    lanes: list[list[Client]], fault: tuple[str, int, bool] | None, budget: int, blocks: int, caching: bool
) -> None:
    llm = make_llm(64, budget, blocks, caching)
    fault_log: list[BaseException] = []
    traps = install_traps(llm, fault_log)
    violations = install_step_checks(llm)
    if fault is not None:
        site, skip, recovery_fails = fault
        traps[site].arm(skip, then=traps["update_state"] if recovery_fails else None)

    async def main() -> list[tuple[str, Client, Ended]]:
        engine = AsyncLLM(llm.engine)
        results = await run_lanes(engine, lanes, "lane")
        for trap in traps.values():
            trap.disarm()
        await assert_idle(engine, "after every consumer ended")
        await asyncio.wait_for(engine.shutdown(), TIMEOUT)
        return results

    results = asyncio.run(main())
    note(f"faults raised: {fault_log}")
    seen: set[str] = set()
    for rid, client, ended in results:
        check_ended(rid, client, ended, fault_log, shut_down=False)
        if rid in seen and ended.outputs and ended.outputs[-1].outputs[0].finish_reason == "length":
            event("a reused id finished")
        seen.add(rid)
    assert not violations, f"engine checks failed after some steps: {violations[:3]}"
    assert_engine_consistent(llm.engine, set(), "after shutdown")


# ---------------------------------------------------------------------------------------
# 3. AsyncLLM: a second asyncio.run, shutdown with live consumers, a new AsyncLLM
# ---------------------------------------------------------------------------------------


@settings(max_examples=25, phases=ASYNC_PHASES)
@given(
    first=lanes_of(("full",)),
    second=lanes_of(("full",)),
    at_shutdown=st.lists(st.tuples(prompts, st.integers(10, 24)), min_size=1, max_size=3),
    shutdown_at_once=st.booleans(),  # before the consumers got anything, or after each got an output
    third=lanes_of(("full",)),
    blocks=st.sampled_from([16, 40]),
)
@pytest.mark.slow
def test_async_llm_shutdown_and_restart(
    first: list[list[Client]],
    second: list[list[Client]],
    at_shutdown: list[tuple[tuple[int, ...], int]],
    shutdown_at_once: bool,
    third: list[list[Client]],
    blocks: int,
) -> None:
    llm = make_llm(64, 16, blocks, True)
    violations = install_step_checks(llm)
    engine = AsyncLLM(llm.engine)

    async def serve(engine: AsyncLLM, lanes: list[list[Client]], when: str) -> list[tuple[str, Client, Ended]]:
        results = await run_lanes(engine, lanes, "lane")  # the same ids in every run
        await assert_idle(engine, when)
        return results

    # The first run returns with the engine idle but not shut down ...
    for rid, client, ended in asyncio.run(serve(engine, first, "after the first asyncio.run")):
        check_ended(rid, client, ended, [], shut_down=False)

    # ... and the same AsyncLLM serves a second asyncio.run; then shutdown with live consumers.
    async def second_run() -> list[tuple[str, Client, Ended]]:
        results = await serve(engine, second, "in the second asyncio.run")
        doomed = [
            (f"doomed{i}", Client(prompt, k, RequestOutputKind.DELTA, "full", 0, False))
            for i, (prompt, k) in enumerate(at_shutdown)
        ]
        started = [asyncio.Event() for _ in doomed]

        async def consume(rid: str, client: Client, started: asyncio.Event) -> Ended:
            ended = Ended()
            try:
                async for out in engine.generate(prompt_of(client), greedy(client.max_tokens, client.kind), rid):
                    ended.take(out, client.kind)
                    started.set()
            except EngineDeadError as error:
                ended.error = error
            finally:
                started.set()
            return ended

        tasks = [asyncio.create_task(consume(rid, client, flag)) for (rid, client), flag in zip(doomed, started)]
        if shutdown_at_once:
            await asyncio.sleep(0)
        else:
            try:
                await asyncio.wait_for(asyncio.gather(*(flag.wait() for flag in started)), TIMEOUT)
            except TimeoutError:
                ids = [rid for rid, _ in doomed]
                raise AssertionError(f"the consumers {ids} got no output within {TIMEOUT}s") from None
        try:
            await asyncio.wait_for(engine.shutdown(), TIMEOUT)
        except TimeoutError:
            raise AssertionError(f"shutdown() did not return within {TIMEOUT}s") from None
        done, pending = await asyncio.wait(tasks, timeout=TIMEOUT)
        assert not pending, (
            f"after shutdown(), {len(pending)} of {len(tasks)} live consumers did not end within {TIMEOUT}s "
            f"(each should raise EngineDeadError)"
        )
        ends = [task.result() for task in tasks]
        for (rid, client), ended in zip(doomed, ends):
            check_ended(rid, client, ended, [], shut_down=True)
            assert ended.error is not None or (ended.outputs and ended.outputs[-1].finished), (
                f"consumer {rid!r}'s stream ended without EngineDeadError or a finished output after shutdown: {ended}"
            )
        try:
            late = engine.generate(prompt_of(doomed[0][1]), greedy(2), "after-shutdown")
            await asyncio.wait_for(anext(late), TIMEOUT)
        except EngineDeadError:
            pass
        except TimeoutError:
            raise AssertionError(
                f"generate after shutdown() hung for {TIMEOUT}s instead of raising EngineDeadError"
            ) from None
        except Exception as error:
            raise AssertionError(f"generate after shutdown() raised {error!r}, expected EngineDeadError") from error
        else:
            raise AssertionError("generate after shutdown() yielded an output, expected EngineDeadError")
        return results

    for rid, client, ended in asyncio.run(second_run()):
        check_ended(rid, client, ended, [], shut_down=False)
    assert_engine_consistent(llm.engine, set(), "after shutdown() with live consumers")

    # A new AsyncLLM on the same LLM serves the old ids afresh.
    async def third_run() -> list[tuple[str, Client, Ended]]:
        fresh_engine = AsyncLLM(llm.engine)
        results = await serve(fresh_engine, third, "on a new AsyncLLM after shutdown")
        await asyncio.wait_for(fresh_engine.shutdown(), TIMEOUT)
        return results

    for rid, client, ended in asyncio.run(third_run()):
        check_ended(rid, client, ended, [], shut_down=False)
    assert not violations, f"engine checks failed after some steps: {violations[:3]}"
    assert_engine_consistent(llm.engine, set(), "at the end")
