"""Hypothesis state machine over a speculative engine (n-gram drafts, tiny Qwen3, CPU): adds of
prompts that repeat themselves (so drafts are proposed and some rejected), aborts, steps,
small pools (preemption with drafts in flight), small budgets (drafts cut) and faults in the
forward. After every step: the scheduler's and the KV manager's invariants, every block
free that no request holds, and **no cached block holds a token the request does not have**:
a block under a hash is full of the request's own tokens, never of a rejected draft. At the
end, every request that finished has the tokens a plain engine (no speculation) gives it. Half
the runs schedule asynchronously (placeholder drafts counted as if kept, the runner proposing
the real ones: ``core/async_scheduler.py`` NOTE 6), where the same must hold."""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine_failures import Boom, Fault, inject  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.core.prefix_hash import TOKEN_IDS  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

BLOCK = 4
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@functools.cache
def model_folder() -> str:
    return str(build_tiny_model(Path(tempfile.mkdtemp()) / "qwen3", "qwen3"))


@functools.cache
def plain_tokens(prompt: tuple[int, ...]) -> list[int]:
    llm = LLM(model_folder(), device="cpu", max_model_len=40, block_size=BLOCK, enable_prefix_caching=False)
    return llm.generate({"prompt_token_ids": list(prompt)}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


# A pattern repeated: the proposer finds drafts; the tiny model's continuation rejects some.
prompts = st.builds(lambda unit, times, tail: tuple(unit * times + tail),
                    st.lists(st.integers(5, 60), min_size=1, max_size=4), st.integers(2, 4),
                    st.lists(st.integers(5, 60), max_size=2))  # fmt: skip


class SpecEngine(RuleBasedStateMachine):
    @initialize(blocks=st.sampled_from([14, 20, 60]), budget=st.sampled_from([5, 9, 64]), caching=st.booleans(),
                async_scheduling=st.booleans())  # fmt: skip
    def build(self, blocks: int, budget: int, caching: bool, async_scheduling: bool) -> None:
        self.llm = LLM(model_folder(), device="cpu", max_model_len=40, block_size=BLOCK, num_gpu_blocks_override=blocks,
                       max_num_batched_tokens=budget, max_num_seqs=4, enable_prefix_caching=caching,
                       speculative_config=SPEC, async_scheduling=async_scheduling)  # fmt: skip
        self.engine = self.llm.engine
        self.fault = Fault(at=10**9)
        inject(self.llm, "forward", self.fault)
        self.live: dict[str, tuple[int, ...]] = {}
        self.finished: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        self.next_id = 0

    @rule(prompt=prompts)
    def add(self, prompt: tuple[int, ...]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.engine.add_request(rid, list(prompt), GREEDY)
        self.live[rid] = prompt

    @rule(data=st.data())
    def abort(self, data) -> None:
        if self.live:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.engine.abort_request(rid)
            del self.live[rid]

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            if not self.engine.has_unfinished_requests():
                return
            before = set(self.engine.unfinished_request_ids())
            try:
                outputs = self.engine.step()
            except Boom:
                for rid in before - self.engine.unfinished_request_ids():
                    self.live.pop(rid, None)  # the failed step's requests are aborted
                continue
            for out in outputs:
                prompt = self.live.pop(out.request_id)
                self.finished[out.request_id] = (prompt, out.outputs[0].token_ids)
            self.check()

    @rule(at=st.integers(1, 3))
    def arm_fault(self, at: int) -> None:
        self.fault.at, self.fault.calls = at, 0

    def check(self) -> None:
        scheduler = self.engine.scheduler
        scheduler.check_invariants()
        kv = scheduler.kv_cache_manager
        for rid, request in scheduler.requests.items():
            blocks = kv.req_to_blocks.get(rid, [])
            tokens = request.all_token_ids
            for i, block in enumerate(blocks[: kv.num_cached_block.get(rid, 0)]):
                assert block.block_hash is not None, f"{rid}: block {i} counted as cached but has no hash"
                got = list(block.block_hash[TOKEN_IDS])
                assert got == tokens[i * BLOCK : (i + 1) * BLOCK], (
                    f"{rid}: cached block {i} holds {got}, but the request's tokens there are "
                    f"{tokens[i * BLOCK : (i + 1) * BLOCK]} (a rejected draft's KV under a hash?)"
                )
        held = {b.block_id for blocks in kv.req_to_blocks.values() for b in blocks}
        assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks - len(held)

    @invariant()
    def tracked_is_live(self) -> None:
        if hasattr(self, "engine"):
            assert self.engine.unfinished_request_ids() == set(self.live)

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        self.fault.at = 10**9
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                self.finished[out.request_id] = (self.live.pop(out.request_id), out.outputs[0].token_ids)
            self.check()
        for rid, (prompt, tokens) in self.finished.items():
            assert tokens == plain_tokens(prompt), f"{rid}: speculation gave {tokens}, a plain engine {plain_tokens(prompt)}"
        kv = self.engine.scheduler.kv_cache_manager
        assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


TestSpecEngine = SpecEngine.TestCase
TestSpecEngine.settings = settings(max_examples=20, stateful_step_count=25, deadline=None)
