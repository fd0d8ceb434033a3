"""The step recorder: how it attaches to an engine, what it refuses, and what breaks a snapshot.

- ``record(llm)`` adds itself to ``LLMEngine.observers`` inside its block only (also when the
  block raises), beside any other observer (a second recorder, a server's metrics), and takes
  one snapshot per step, a failed step too; an observer that raises leaves the others theirs;
- ``record`` refuses what it cannot read, panels with nothing to draw, and a hand-driven
  manager snapshot that leaves out a request holding blocks;
- ``check_snapshot`` rejects snapshots whose parts disagree (a tampered copy of a real
  one, one fault at a time), naming the values;
- importing ``tinyvllm.trace`` (and its command, viewer and workloads) imports no torch.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from trace_fixtures import workload_trace

from tinyvllm import LLM, SamplingParams
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.request import Request
from tinyvllm.trace import check_snapshot, check_trace, record
from tinyvllm.trace.snapshot import BatchMove, FreeQueue, PoolBlocks, Trace
from tinyvllm.trace.workloads import tiny_model_folder


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_folder(), device="cpu", max_model_len=32, block_size=4, num_gpu_blocks_override=16,
               max_num_batched_tokens=8)  # fmt: skip


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_record_observes_the_engine_only_inside_its_block(llm):
    engine = llm.engine
    assert engine.observers == (), "an engine must start unobserved"
    with record(llm, title="two prompts") as t:
        assert engine.observers == (t,)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [11, 12]}], _greedy(3), use_tqdm=False)
    assert engine.observers == ()
    trace = t.trace
    # 6 + 2 tokens fit the budget of 8 in step 0; two more steps of decodes finish both.
    assert len(trace.steps) == 3 and [s.label for s in trace.steps] == ["step 0", "step 1", "step 2"]
    assert trace.source == "LLMEngine" and trace.title == "two prompts"
    tokens = {}
    for s in trace.steps:
        for x in s.scheduler.scheduled:
            tokens.setdefault(x.request_id, []).extend(x.new_token_ids)
    assert sorted(tokens.values()) == sorted(o.outputs[0].token_ids for o in outs)
    assert trace.steps[-1].scheduler.finished == tuple(sorted(o.request_id for o in outs)) and trace.steps[-1].requests == ()
    llm.generate("more", _greedy(2), use_tqdm=False)  # outside the block: nothing recorded
    assert len(t.trace.steps) == 3
    with pytest.raises(RuntimeError, match="inside"):
        with record(llm):
            raise RuntimeError("inside")
    assert engine.observers == (), "an exception in the block must still detach the recorder"


class Counting:
    """An observer that counts the steps it is told of, and raises on the first when asked."""

    def __init__(self, raise_first: bool = False) -> None:
        self.steps: list[int] = []
        self.raise_first = raise_first

    def on_step(self, engine, scheduler_output, core_outputs, error) -> None:
        self.steps.append(scheduler_output.total_num_scheduled_tokens)
        if self.raise_first and len(self.steps) == 1:
            raise LabelError("the observer's own bug")


def test_observers_stand_side_by_side_and_one_that_raises_leaves_the_others_theirs(llm):
    """Two recorders nested, and a counting observer added before them that raises once: each
    is told of every step, in the order they were added; the raise is logged, not the step's;
    a recorder's block ends by removing only itself."""
    engine = llm.engine
    first = Counting(raise_first=True)
    engine.add_observer(first)
    try:
        with pytest.raises(ValueError, match="already observes this engine"):
            engine.add_observer(first)  # twice would count every step twice
        assert engine.observers == (first,)
        with record(llm, title="outer") as outer:
            with record(llm, title="inner") as inner:
                assert engine.observers == (first, outer, inner)
                outs = llm.generate([{"prompt_token_ids": [30, 31, 32, 33, 34, 35]}, {"prompt_token_ids": [40, 41]}],
                                    _greedy(3), use_tqdm=False)  # fmt: skip  (no cached block: 8 tokens in step 0)
            assert engine.observers == (first, outer)
    finally:
        engine.remove_observer(first)
    assert engine.observers == ()
    assert first.steps == [8, 2, 2], "the step after the observer raised must still be observed"
    assert len(outer.trace.steps) == len(inner.trace.steps) == 3
    assert [s.scheduler for s in outer.trace.steps] == [s.scheduler for s in inner.trace.steps]
    assert outer.error is None and inner.error is None
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    with pytest.raises(ValueError, match="does not observe this engine"):
        engine.remove_observer(first)
    with pytest.raises(ValueError, match="an observer needs an on_step method, got 7"):
        engine.add_observer(7)
    assert engine.observers == ()


def test_a_failed_step_is_recorded_after_its_undo(llm):
    runner = llm.engine.model_runner
    sampler = runner.sampler
    calls = []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return sampler(*args)

    runner.sampler = failing_once
    try:
        with record(llm) as t:
            with pytest.raises(RuntimeError, match="injected"):
                llm.generate({"prompt_token_ids": [3, 4, 5, 6, 7]}, _greedy(4), use_tqdm=False)
            llm.generate({"prompt_token_ids": [8, 9, 10]}, _greedy(2), use_tqdm=False)
    finally:
        runner.sampler = sampler
    steps = t.trace.steps
    (first,) = steps[0].scheduler.running  # the failing call's request
    failed = steps[1]
    assert failed.label == "step 1: failed" and "RuntimeError: injected" in failed.note
    assert failed.scheduler.scheduled == () and failed.scheduler.finished == (first,)
    assert failed.batch.previous_rows == (first,) and failed.batch.rows == () and failed.batch.removed == (0,)
    assert failed.dispatch is None and failed.slots == () and failed.num_free_blocks == 16
    after = steps[2]  # the next call starts from the emptied batch
    (second,) = after.scheduler.running
    assert second != first and after.batch.previous_rows == () and after.batch.rows == (second,)
    check_trace(t.trace)


def test_a_constrained_request_that_waits_with_its_grammar_unclaimed_is_a_waiting_request(llm):
    """A constrained request is ``WAITING_FOR_FSM`` from ``add_request`` until a ``schedule()``
    reaches it (``core/scheduler.py`` NOTE 6); behind a prompt that takes the step's whole token
    budget, it is still so when the step is recorded: a waiting request like any other."""
    pytest.importorskip("xgrammar")
    from tinyvllm.sampling_params import StructuredOutputsParams

    grammar = StructuredOutputsParams(regex="[a-c]{3}")
    llm.engine.structured_output_manager.compile(grammar).result(timeout=60)
    with record(llm) as rec:
        llm.engine.add_request("long", list(range(5, 17)), _greedy(2))  # 12 tokens: the 8-token budget, twice
        llm.engine.add_request("constrained", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3,
                                                                        structured_outputs=grammar))  # fmt: skip
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert rec.error is None, rec.error
    first = rec.trace.steps[0]
    assert [x.request_id for x in first.scheduler.scheduled] == ["long"] and first.request("constrained").status == "WAITING_FOR_FSM"
    check_trace(rec.trace)


def test_record_refuses_what_it_cannot_draw():
    with pytest.raises(TypeError, match="record\\(\\) takes an LLM"):
        with record(object()):
            pass
    manager = KVCacheManager(block_size=4, num_gpu_blocks=4, max_model_len=16)
    with pytest.raises(ValueError, match=r"panels \['batch'\] have nothing to draw"):
        record(manager, panels=["block_pool", "batch"]).__enter__()
    with record(manager, panels=["block_pool", "free_queue"]) as t:
        request = Request("r", [1, 2, 3, 4, 5], SamplingParams())
        manager.allocate_slots(request, 5)
        with pytest.raises(ValueError, match=r"missing \['r'\]"):
            t.capture("r left out")
        request.num_computed_tokens = 5
        snapshot = t.capture("r", requests=[request], scheduled={"r": 5})
    assert t.trace.panels == ("block_pool", "free_queue")
    assert snapshot.request("r").block_ids == (0, 1) and snapshot.free_queue == (2, 3)
    assert [(w.position, w.slot) for w in snapshot.slots] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]


def _broken(name: str, index: int, **changes):
    trace = workload_trace(name)
    return trace, dataclasses.replace(trace.steps[index], **changes)


def _assert_rejected(trace: Trace, snapshot, *phrases: str) -> None:
    with pytest.raises(AssertionError) as info:
        check_snapshot(snapshot, trace.block_size, trace.num_blocks)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)


def test_check_snapshot_rejects_a_pool_whose_parts_disagree():
    trace = workload_trace("seed002-prefix-caching")
    step6 = trace.steps[-1]  # free queue (6, 5)
    _assert_rejected(trace, dataclasses.replace(step6, free_queue=(5, 6)), "block 5 says free_position 1")
    blocks = list(step6.blocks)
    blocks[0] = dataclasses.replace(blocks[0], ref_cnt=2)
    _assert_rejected(trace, dataclasses.replace(step6, blocks=tuple(blocks)), "block 0 has ref_cnt 2 but 1 block tables hold it")
    _assert_rejected(trace, dataclasses.replace(step6, hash_map=step6.hash_map[1:]), "carry a hash the map does not list")
    last = dataclasses.replace(step6.slots[-1], slot=13)  # position 28 lies in block 3: slot 12
    _assert_rejected(trace, dataclasses.replace(step6, slots=(*step6.slots[:-1], last)), "'req2' position 28 wrote slot 13, its table says 12")
    # The pool keeps only what is not plain free (snapshot.py NOTE 3); the check still sees the rest.
    assert isinstance(step6.blocks, PoolBlocks) and step6.free_queue == (6, 5) and step6.blocks[6].free_position == 0
    assert [b.block_id for b in step6.blocks.kept] == [0, 1, 2, 3, 4, 5, 7, 8, 9]  # 6 is plain: free, uncached
    five = [dataclasses.replace(b, free_position=0) if b.block_id == 5 else b for b in step6.blocks.kept]
    lost = dataclasses.replace(step6, blocks=PoolBlocks(10, five, FreeQueue([5])), free_queue=FreeQueue([5]))
    _assert_rejected(trace, lost, "the free queue has 1 blocks, 2 have ref_cnt 0")  # block 6 is in no queue
    (req2,) = step6.requests
    holds_six = dataclasses.replace(req2, block_ids=(*req2.block_ids, 6))
    _assert_rejected(trace, dataclasses.replace(step6, requests=(holds_six,)), "blocks [6] have ref_cnt 0 but block tables hold them")


def test_check_snapshot_rejects_decisions_batches_and_dispatches_that_do_not_add_up():
    trace = workload_trace("scheduler-preemption")
    step = trace.steps[0]
    over = dataclasses.replace(step.scheduler, token_budget=9)
    _assert_rejected(trace, dataclasses.replace(step, scheduler=over), "10 tokens scheduled > budget 9")
    swapped = dataclasses.replace(step.scheduler, waiting=(), running=("A", "B"))
    _assert_rejected(trace, dataclasses.replace(step, scheduler=swapped), "running request 'B' has status WAITING")
    condense = workload_trace("seed001-condense")
    one = condense.steps[1]
    lost = dataclasses.replace(one.batch, moved=(BatchMove(6, 4, "UNIDIRECTIONAL"),))
    _assert_rejected(condense, dataclasses.replace(one, batch=lost), "give ('r0', 'r1', 'r2', 'A', 'r6'")
    graphs = workload_trace("cuda-graphs-padding")
    three = graphs.steps[3]
    odd = dataclasses.replace(three.dispatch, padded_num_tokens=3)
    _assert_rejected(graphs, dataclasses.replace(three, dispatch=odd), "FULL replays 3 tokens, not a capture size")


def test_importing_the_trace_package_does_not_import_torch():
    code = (
        "import sys, tinyvllm.trace, tinyvllm.trace.workloads, tinyvllm.trace.viewer, tinyvllm.trace.command, "
        "tinyvllm.trace.svg_runs\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "from tinyvllm.trace.workloads import run_workload\n"
        "run_workload('seed002-prefix-caching'); run_workload('scheduler-preemption')\n"
        "assert 'torch' not in sys.modules, 'a workload without a model imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_step_that_fails_after_a_request_left_raises_its_own_error_and_is_recorded(llm):
    """Issue 36 item 6: A finishes in step 0, so step 1's batch drops A's row and moves B
    up before the sampler raises. The caller gets that RuntimeError (not an AssertionError
    of the recorder), and the failed step's snapshot passes check_snapshot: its batch goes
    from the rows of step 0 to none, every one of them removed."""
    runner = llm.engine.model_runner
    sampler = runner.sampler
    calls = []

    def failing_second(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected in step 1")
        return sampler(*args)

    runner.sampler = failing_second
    try:
        with record(llm) as t:
            with pytest.raises(RuntimeError, match="injected in step 1") as info:
                llm.generate(
                    [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7, 8]}],
                    [_greedy(1), _greedy(4)], use_tqdm=False,
                )  # fmt: skip
    finally:
        runner.sampler = sampler
    assert type(info.value) is RuntimeError
    assert t.error is None, "the recorder itself must not have failed"
    steps = t.trace.steps
    assert len(steps) == 2
    a, b = steps[0].batch.rows
    assert steps[0].scheduler.finished == (a,), "A finished in step 0"
    failed = steps[1]
    assert failed.label == "step 1: failed" and "RuntimeError: injected in step 1" in failed.note
    assert failed.batch.previous_rows == (a, b) and failed.batch.rows == ()
    assert failed.batch.removed == (1, 0) and failed.batch.added == () and failed.batch.moved == ()
    assert failed.scheduler.finished == (b,) and failed.requests == () and failed.num_free_blocks == 16
    check_trace(t.trace)
    assert llm.engine.observers == ()


class LabelError(Exception):
    pass


def test_an_error_of_the_recorder_stops_the_recording_and_leaves_generate_alone():
    """The recorder's own failure (here: its ``label_token``, on the second call's prompt)
    never reaches ``generate``: the outputs are an unrecorded run's, a warning says at which
    step recording stopped, the trace keeps the steps before, and no later step is tried."""
    llm = LLM(tiny_model_folder(), device="cpu", max_model_len=32, block_size=4, num_gpu_blocks_override=16,
              max_num_batched_tokens=8, enable_prefix_caching=False)  # fmt: skip
    first, second = [20, 21, 22], [90, 91, 92, 93]
    unrecorded = [llm.generate({"prompt_token_ids": p}, _greedy(3), use_tqdm=False)[0].outputs[0].token_ids for p in (first, second)]
    refused = []

    def label(token_id: int) -> str:
        if token_id in second:
            refused.append(token_id)
            raise LabelError(f"no label for {token_id}")
        return str(token_id)

    with pytest.warns(RuntimeWarning, match=r"recording stopped at step 3: the recorder raised LabelError: no label for 9"):
        with record(llm, label_token=label) as t:
            outs = [llm.generate({"prompt_token_ids": p}, _greedy(3), use_tqdm=False)[0].outputs[0].token_ids for p in (first, second)]
    assert outs == unrecorded
    assert isinstance(t.error, LabelError) and len(refused) == 1, "recording must stop at the first error"
    assert len(t.trace.steps) == 3 and t.trace.steps[-1].scheduler.finished != ()
    check_trace(t.trace)
    assert llm.engine.observers == ()


def test_an_error_of_the_recorder_in_a_failed_step_leaves_the_steps_own_error(llm):
    """Step 0 fails in the sampler; taking its snapshot fails too (B, left waiting, has a
    token the label function refuses). The caller gets the sampler's RuntimeError."""
    runner = llm.engine.model_runner
    sampler = runner.sampler

    def failing(*args):
        raise RuntimeError("injected in the sampler")

    def label(token_id: int) -> str:
        if token_id >= 90:
            raise LabelError(f"no label for {token_id}")
        return str(token_id)

    runner.sampler = failing
    try:
        with pytest.warns(RuntimeWarning, match="recording stopped at step 0"):
            with record(llm, label_token=label) as t:
                with pytest.raises(RuntimeError, match="injected in the sampler") as info:
                    prompts = [{"prompt_token_ids": list(range(20, 28))}, {"prompt_token_ids": [90, 91]}]
                    llm.generate(prompts, _greedy(2), use_tqdm=False)
    finally:
        runner.sampler = sampler
    assert type(info.value) is RuntimeError
    assert isinstance(t.error, LabelError) and t.trace.steps == ()
    assert not llm.engine.has_unfinished_requests()


def test_max_steps_caps_the_recording_with_one_warning(llm):
    with pytest.raises(ValueError, match="max_steps must be a positive int or None, got 0"):
        with record(llm, max_steps=0):
            pass
    assert llm.engine.observers == ()
    with pytest.warns(RuntimeWarning, match="recorded max_steps=2 steps; the later steps are not recorded") as caught:
        with record(llm, max_steps=2) as t:
            llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(5), use_tqdm=False)
    assert len([w for w in caught if "max_steps" in str(w.message)]) == 1
    assert [s.label for s in t.trace.steps] == ["step 0", "step 1"] and t.num_unrecorded == 3
    assert t.error is None


def _deep_size(obj, seen: set[int]) -> int:
    """The bytes of ``obj`` and everything it references, each object once (shared ones once)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, (tuple, list)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif dataclasses.is_dataclass(obj):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:  # a slotted sequence of the snapshot (PoolBlocks, FreeQueue) or an atom
        children = [getattr(obj, a) for c in type(obj).__mro__ for a in getattr(c, "__slots__", ()) if hasattr(obj, a)]
    return size + sum(_deep_size(child, seen) for child in children)


def _kept_bytes_per_step(num_blocks: int) -> float:
    """What the snapshots of a recorded run hold, per step, on a pool of ``num_blocks``."""
    llm = LLM(tiny_model_folder(), device="cpu", max_model_len=32, block_size=4, num_gpu_blocks_override=num_blocks,
              max_num_batched_tokens=8)  # fmt: skip
    prompts = [{"prompt_token_ids": [20 + i, 21 + i, 22 + i]} for i in range(3)]
    with record(llm) as t:
        llm.generate(prompts, _greedy(8), use_tqdm=False)
    steps = t.trace.steps
    assert len(steps) == 9
    return _deep_size(steps, set()) / len(steps)


def test_a_recorded_step_keeps_what_is_in_use_not_the_whole_pool():
    """Issue 36 item 6: a snapshot copied every block of the pool (about 1 KB a step with
    16 blocks, about 100 KB with 1024). Now the plain free blocks are not kept (snapshot.py
    NOTE 3) and what did not change is shared (recorder NOTE 6): the same few KB a step
    whatever the pool's size."""
    small, large = _kept_bytes_per_step(16), _kept_bytes_per_step(1024)
    assert large < 1.5 * small + 1024 and large < 8 * 1024, (small, large)
