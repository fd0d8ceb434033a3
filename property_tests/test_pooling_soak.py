"""Soak test of a pooling engine (``runner="pooling"``, ``docs/pooling.md``) under random
adds, aborts, preemptions and steps, synchronous or with async scheduling.

``PoolingSoak`` (a Hypothesis state machine over ``llm.engine``; tiny random Qwen3, CPU, block
size 4, pools of 8-40 blocks, token budgets of 4-64 so that prompts chunk, prefix caching on
or off, LAST or MEAN pooling, FCFS or priority). Rules: add a request (prompts of 3-28 ids,
often sharing a stem: prefix hits for LAST, none read for MEAN); abort a live or an unknown
id; step 1-4 times; step once and preempt a running request, as the scheduler would (under
async scheduling its last step may be in flight: the case that once raised from
``running.remove``). Checked for every output: it is for a live request, a finished
``PoolingRequestOutput`` whose vector equals a fresh engine's for the prompt alone (float32
rounding apart: chunks and batches change the sums' order). Checked after every rule:
``LLMEngine.check_invariants()``, the engine's unfinished ids == the test's live ids, and the
block accounting (the blocks in use are exactly the unfinished requests', free + held == the
pool). Teardown: everything drains and the pool is whole.

Bounded for CI: explicit ``@settings``, tiny shapes, one torch thread.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_engine_soak import model_folder, one_torch_thread  # noqa: E402,F401  (the sync soak's model, one thread)

from tinyvllm import LLM, PoolingParams, PoolingRequestOutput  # noqa: E402

DRAIN_LIMIT = 500
TOL = 1e-4
STEM = [(11 * i + 3) % 300 + 10 for i in range(16)]
prompts = st.builds(
    lambda cut, tail: tuple((STEM[:cut] + tail)[:28]),
    st.sampled_from([0, 4, 8, 16]), st.lists(st.integers(5, 399), min_size=3, max_size=12),
)  # fmt: skip


@functools.cache
def reference(pooling_type: str) -> LLM:
    return LLM(model_folder(), device="cpu", max_model_len=32, block_size=4, enable_prefix_caching=False,
               runner="pooling", pooler_config={"pooling_type": pooling_type})  # fmt: skip


@functools.cache
def fresh(pooling_type: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """The vector a fresh engine gives ``prompt`` alone."""
    [out] = reference(pooling_type).encode({"prompt_token_ids": list(prompt)}, use_tqdm=False)
    return out.outputs.data


class PoolingSoak(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None
        self.live: dict[str, tuple[int, ...]] = {}
        self.counter = 0
        self.pooling_type = "LAST"
        self.priority = False

    @initialize(
        budget=st.sampled_from([4, 8, 8, 64]), blocks=st.sampled_from([8, 10, 40]), caching=st.booleans(),
        async_scheduling=st.booleans(), pooling_type=st.sampled_from(["LAST", "MEAN"]), priority=st.booleans(),
    )  # fmt: skip
    def build(self, budget: int, blocks: int, caching: bool, async_scheduling: bool, pooling_type: str, priority: bool) -> None:
        self.pooling_type, self.priority = pooling_type, priority
        self.llm = LLM(model_folder(), device="cpu", max_model_len=32, block_size=4, max_num_batched_tokens=budget,
                       num_gpu_blocks_override=blocks, max_num_seqs=4, enable_prefix_caching=caching,
                       async_scheduling=async_scheduling, runner="pooling", pooler_config={"pooling_type": pooling_type},
                       scheduling_policy="priority" if priority else "fcfs")  # fmt: skip

    @property
    def engine(self):
        return self.llm.engine

    def _take(self, outputs: list) -> None:
        for out in outputs:
            assert out.request_id in self.live, f"an output for {out.request_id!r}, which is not live"
            assert isinstance(out, PoolingRequestOutput) and out.finished and out.outputs is not None, out
            want = fresh(self.pooling_type, self.live.pop(out.request_id))
            assert (out.outputs.data - want).abs().max().item() < TOL, f"{out.request_id}: the vector differs"

    @rule(prompt=prompts, rank=st.integers(0, 2))
    def add(self, prompt: tuple[int, ...], rank: int) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        self.engine.add_request(rid, list(prompt), PoolingParams(), priority=rank if self.priority else 0)
        self.live[rid] = prompt

    @precondition(lambda self: self.llm is not None)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live) + ["unknown"]))
        outputs = self.engine.abort_request(rid)
        if rid in self.live:
            del self.live[rid]
            assert [(type(o), o.outputs) for o in outputs] == [(PoolingRequestOutput, None)]  # no vector was made
        else:
            assert outputs == []

    @precondition(lambda self: self.llm is not None)
    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            if not self.engine.has_unfinished_requests():
                return
            self._take(self.engine.step())

    @precondition(lambda self: self.llm is not None and self.engine.has_unfinished_requests())
    @rule(data=st.data())
    def step_then_preempt(self, data) -> None:
        """One step, then a running request preempted (mid-prompt, or with its last step in
        flight under async scheduling), as the scheduler's victim."""
        self._take(self.engine.step())
        running = self.engine.scheduler.running
        if running:
            self.engine.scheduler._preempt(data.draw(st.integers(0, len(running) - 1)))

    @invariant()
    def consistent(self) -> None:
        if self.llm is None:
            return
        engine = self.engine
        engine.check_invariants()
        assert engine.unfinished_request_ids() == set(self.live)
        kv = engine.scheduler.kv_cache_manager
        unfinished = set(engine.scheduler.requests)
        held = {block.block_id for rid in unfinished for block in kv.req_to_blocks.get(rid, [])}
        in_use = {block.block_id for block in kv.block_pool.blocks if block.ref_cnt > 0}
        assert in_use == held, f"blocks in use {sorted(in_use)} != held {sorted(held)}"
        assert kv.block_pool.get_num_free_blocks() + len(held) == kv.num_gpu_blocks

    def teardown(self) -> None:
        if self.llm is None:
            return
        for _ in range(DRAIN_LIMIT):
            if not self.engine.has_unfinished_requests():
                break
            self._take(self.engine.step())
        assert not self.live, f"never finished: {sorted(self.live)}"
        kv = self.engine.scheduler.kv_cache_manager
        assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


PoolingSoak.TestCase.settings = settings(max_examples=40, stateful_step_count=20)
TestPoolingSoak = PoolingSoak.TestCase
