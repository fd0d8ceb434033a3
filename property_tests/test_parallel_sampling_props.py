"""Hypothesis over ``SamplingParams.n`` on the real engine (tiny Qwen3, CPU): for random
prompts, n, pool sizes (preemption) and token budgets (chunked prefills), the children of one
parent never share a block that either of them writes. A block two children both hold is a
full block of the prompt, cached (it has a hash), at the same place in both block tables.
And each child's tokens are those of a lone request with the child's seed."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm import LLM, SamplingParams
from tinyvllm.models.tiny import build_tiny_model

BLOCK = 4


@functools.cache
def model_folder() -> str:
    return str(build_tiny_model(Path(tempfile.mkdtemp()) / "qwen3", "qwen3"))


@functools.cache
def alone(prompt: tuple[int, ...], seed: int) -> list[int]:
    llm = LLM(model_folder(), device="cpu", max_model_len=48, block_size=BLOCK, enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=seed)
    return llm.generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)[0].outputs[0].token_ids


def check_children_share_only_cached_prompt_blocks(llm: LLM, prompts: dict[str, tuple[int, ...]]) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    for parent, prompt in prompts.items():
        tables = {rid: kv.req_to_blocks.get(rid, []) for rid in kv.req_to_blocks if rid.endswith(f"_{parent}")}
        full = len(prompt) // BLOCK
        for a in tables:
            for b in tables:
                if a >= b:
                    continue
                shared = {blk.block_id for blk in tables[a]} & {blk.block_id for blk in tables[b]}
                for block_id in shared:
                    block = kv.block_pool.blocks[block_id]
                    where_a = [i for i, blk in enumerate(tables[a]) if blk.block_id == block_id]
                    where_b = [i for i, blk in enumerate(tables[b]) if blk.block_id == block_id]
                    assert where_a == where_b and where_a[0] < full, (a, b, block_id, where_a, where_b, full)
                    assert block.block_hash is not None, f"{a} and {b} share block {block_id}, which is not cached"


@settings(max_examples=12, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.lists(st.integers(5, 400), min_size=3, max_size=22), st.integers(2, 4)), min_size=1, max_size=3
    ),
    blocks=st.sampled_from([24, 60]),
    budget=st.sampled_from([8, 64]),
)
def test_children_never_share_a_block_they_write(requests, blocks, budget):
    llm = LLM(model_folder(), device="cpu", max_model_len=48, block_size=BLOCK, num_gpu_blocks_override=blocks,
              max_num_batched_tokens=budget, max_num_seqs=6)  # fmt: skip
    engine = llm.engine
    prompts = {}
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, n=n, seed=i))
        prompts[f"p{i}"] = tuple(prompt)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
        check_children_share_only_cached_prompt_blocks(llm, prompts)
        engine.scheduler.check_invariants()
    for i, (prompt, n) in enumerate(requests):
        out = finished[f"p{i}"]
        assert [c.index for c in out.outputs] == list(range(n))
        assert [c.token_ids for c in out.outputs] == [alone(tuple(prompt), i + j) for j in range(n)]
