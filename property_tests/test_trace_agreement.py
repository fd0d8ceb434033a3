"""The step recorder's snapshots agree with the engine's state at every step (issue 26).

Concept: Hypothesis draws a workload (requests that share prefixes or not, arriving at
different steps, with different lengths) and an engine shape (pool size, token budget,
``max_num_seqs``, prefix caching on or off) small enough that chunked prefill, prefix hits
and preemption all happen. The real engine (a one-layer tiny random Qwen3 on the CPU,
block size 4) runs it to the end under ``tinyvllm.trace.record``. After every step an
observer that wraps the recorder compares the snapshot just taken with the live objects,
read through other paths than the recorder's:

- the pool: each block's ``ref_cnt`` and hash tokens, the free queue from
  ``get_all_free_blocks``, the prefix cache map's blocks;
- the requests: the scheduler's queues, each request's status, tokens,
  ``num_computed_tokens`` and ``KVCacheManager.get_block_ids``;
- the decisions: ``SchedulerOutput.num_scheduled_tokens`` and ``preempted_req_ids``;
- the persistent batch's ``req_ids``; the runner's ``last_dispatch``;
- the slots: recomputed from the runner's own copy of each request (its block ids and
  computed tokens) with ``slot_for_position``.

At the end the trace passes ``check_trace``, reads back equal from JSON, and the tokens
the snapshots report sampled are the tokens ``generate``'s outputs hold. A second test
makes one step fail (the forward or the sampler raises, whatever left the batch before):
``generate`` raises that exception unchanged and every snapshot still passes.

Bounded for CI: explicit ``@settings`` (25 and 20 examples, no shrinking past the examples'
size), tiny shapes, one torch thread.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.trace import check_trace, record  # noqa: E402
from tinyvllm.trace.recorder import Recorder  # noqa: E402
from tinyvllm.trace.snapshot import Trace  # noqa: E402
from tinyvllm.trace.workloads import tiny_model_folder  # noqa: E402
from tinyvllm.worker.attention_metadata import slot_for_position  # noqa: E402

BLOCK_SIZE = 4
SHARED = list(range(40, 52))  # a 12-token prefix some requests start with


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class AgreeingRecorder(Recorder):
    """The recorder, plus a comparison of each new snapshot with the live engine."""

    def on_step(self, engine, scheduler_output, core_outputs, error) -> None:
        super().on_step(engine, scheduler_output, core_outputs, error)
        assert error is None, error
        assert self.error is None, self.error  # the recorder warns and stops rather than raise (recorder NOTE 5)
        agree(engine, self.steps[-1], scheduler_output)


def agree(engine, snap, out) -> None:
    where = f"step {snap.index}"
    scheduler, runner = engine.scheduler, engine.model_runner
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    assert snap.free_queue == tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()), where
    for block in pool.blocks:
        got = snap.blocks[block.block_id]
        tokens = tuple(block.block_hash[1]) if block.block_hash is not None else ()
        assert (got.ref_cnt, got.hash_tokens) == (block.ref_cnt, tokens), f"{where}: block {block.block_id}"
    assert [ids for _, ids in snap.hash_map] == [tuple(d) for d in pool.cached_block_hash_to_block.values()], where
    decisions = snap.scheduler
    assert decisions.running == tuple(r.request_id for r in scheduler.running), where
    assert decisions.waiting == tuple(r.request_id for r in scheduler.waiting), where
    assert {r.request_id for r in snap.requests} == set(scheduler.requests), where
    for r in snap.requests:
        live = scheduler.requests[r.request_id]
        assert (r.status, r.token_ids, r.num_computed_tokens, r.block_ids) == (
            live.status.name, tuple(live.all_token_ids), live.num_computed_tokens, tuple(kv.get_block_ids(r.request_id))
        ), f"{where}: request {r.request_id}"
    assert {x.request_id: x.num_tokens for x in decisions.scheduled} == dict(out.num_scheduled_tokens), where
    assert set(decisions.preempted) == set(out.preempted_req_ids), where
    assert snap.batch.rows == tuple(runner.input_batch.req_ids), where
    if not out.total_num_scheduled_tokens:
        assert snap.dispatch is None and snap.slots == (), where
        return
    d, live = snap.dispatch, runner.last_dispatch
    assert (d.runtime_mode, d.num_tokens, d.num_reqs, d.padded_num_tokens, d.padded_num_reqs) == (
        live.runtime_mode.name, live.num_tokens, live.num_reqs, live.batch_descriptor.num_tokens, live.batch_descriptor.num_reqs
    ), where
    want = []
    for rid in runner.input_batch.req_ids:  # the runner's own copy, after the step
        state, n = runner.requests[rid], out.num_scheduled_tokens[rid]
        start = state.num_computed_tokens - n
        want += [(rid, p, slot_for_position(state.block_ids, p, BLOCK_SIZE)) for p in range(start, start + n)]
    assert [(w.request_id, w.position, w.slot) for w in snap.slots] == want, where


requests = st.lists(
    st.tuples(
        st.integers(0, 12),  # tokens of SHARED it starts with
        st.integers(1, 8),  # tokens of its own
        st.integers(1, 8),  # max_tokens
        st.integers(0, 4),  # the step it arrives at
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=25, deadline=None)
@given(
    reqs=requests,
    num_blocks=st.integers(8, 20),
    budget=st.integers(4, 16),
    max_num_seqs=st.integers(1, 4),
    caching=st.booleans(),
)
def test_snapshots_agree_with_the_engine_at_every_step(reqs, num_blocks, budget, max_num_seqs, caching):
    llm = LLM(
        tiny_model_folder(), device="cpu", max_model_len=32, block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_prefix_caching=caching,
    )  # fmt: skip
    engine = llm.engine
    arrivals: dict[int, list] = {}
    for i, (shared, own, max_tokens, at) in enumerate(reqs):
        prompt = SHARED[:shared] + [100 + 10 * i + k for k in range(own)]
        arrivals.setdefault(at, []).append((f"R{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    recorder = AgreeingRecorder(llm)
    engine.add_observer(recorder)
    finished: dict[str, list[int]] = {}
    try:
        step = 0
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for rid, prompt, params in arrivals.get(step, []):
                engine.add_request(rid, prompt, params)
            for output in engine.step():
                finished[output.request_id] = output.outputs[0].token_ids
            step += 1
    finally:
        engine.remove_observer(recorder)
    trace = recorder.trace
    assert len(trace.steps) == step
    check_trace(trace)
    assert Trace.from_json(trace.to_json()) == trace
    sampled: dict[str, list[int]] = {}
    for s in trace.steps:
        for x in s.scheduler.scheduled:
            sampled.setdefault(x.request_id, []).extend(x.new_token_ids)
    assert sampled == finished
    scheduled = [x for s in trace.steps for x in s.scheduler.scheduled]
    for what, seen in (
        ("a preemption", any(s.scheduler.preempted for s in trace.steps)),
        ("a chunked prefill", any(x.kind == "chunk" for x in scheduled)),
        ("a prefix hit", any(x.num_hit_tokens for x in scheduled)),
        ("a resumed request", any(x.admitted == "resumed" for x in scheduled)),
    ):
        event(f"{what}: {'yes' if seen else 'no'}")
    assert trace.steps[-1].num_free_blocks == num_blocks and trace.steps[-1].requests == ()


class Injected(Exception):
    pass


@settings(max_examples=20, deadline=None)
@given(
    reqs=requests,
    num_blocks=st.integers(8, 20),
    budget=st.integers(4, 16),
    max_num_seqs=st.integers(1, 4),
    fail_at=st.integers(0, 8),
    where=st.sampled_from(["forward", "sampler"]),
)
def test_a_failed_step_raises_its_own_error_and_its_snapshot_holds(reqs, num_blocks, budget, max_num_seqs, fail_at, where):
    """Issue 36 item 6: the step ``fail_at`` raises (in the forward or the sampler), whatever
    left the batch before it. ``generate`` raises that exception, unchanged, and every
    snapshot (the failed one included) passes ``check_snapshot``; the recorder keeps no error."""
    llm = LLM(
        tiny_model_folder(), device="cpu", max_model_len=32, block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
    )  # fmt: skip
    runner = llm.engine.model_runner
    target = (llm.model, "forward") if where == "forward" else (runner, "sampler")
    original, calls = getattr(*target), []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_at + 1:
            raise Injected(f"{where} call {fail_at}")
        return original(*args, **kwargs)

    setattr(*target, faulty)
    prompts = [{"prompt_token_ids": SHARED[:shared] + [100 + 10 * i + k for k in range(own)]} for i, (shared, own, _, _) in enumerate(reqs)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _, _, max_tokens, _ in reqs]
    with record(llm) as t:
        try:
            llm.generate(prompts, params, use_tqdm=False)
        except Injected as error:
            assert str(error) == f"{where} call {fail_at}" and not getattr(error, "__notes__", None)
            failed = t.trace.steps[-1]
            assert failed.label.endswith(": failed") and f"Injected: {where} call {fail_at}" in failed.note
            assert failed.batch.rows == () and failed.slots == () and failed.dispatch is None
        else:
            assert len(calls) <= fail_at, "the fault never fired yet generate returned"
    event(f"failed: {'yes' if len(calls) > fail_at else 'no'}")
    assert t.error is None, t.error
    check_trace(t.trace)
    assert Trace.from_json(t.trace.to_json()) == t.trace
