"""Benchmark: allocate-and-free throughput of KVCacheManager, prefix caching off vs on.

Concept: the block bookkeeping cost per request on a workload that shares prefixes:
1,000 requests, each one of 10 system prompts (256-512 tokens) plus a unique tail
(32-128 tokens), block_size 16, a pool large enough that nothing is ever short. One
benchmarked round runs every request through its whole life, one at a time:
``get_computed_blocks``, ``allocate_slots`` for the rest of its prompt, a few decode
allocations, ``free``.

Reported: ``requests_per_s`` (from the median round) in ``extra_info`` and, for the
caching-on variants, the ratio to the caching-off baseline measured in the same run
(bench/README.md: we report ratios against a named baseline, never bare timings across
machines or runs).

NOTE 1 (what is and is not timed): building the manager (its block objects) and the
``Request`` objects is per-round set-up, outside the timing; hashing the prompts is
inside it, because ``get_computed_blocks`` hashes a request at its first lookup. With
caching off nothing is hashed and nothing is hit, so the ratio shows the price of the
sha256 hashing against the blocks it saves from the free queue.
NOTE 2 (the workload is checked): each round returns the hit tokens and the free blocks
at its end; the test asserts them against values computed from the workload alone, so
a broken cache cannot produce a flattering number.

Run: ``pytest bench/ --benchmark-only`` (bench/ is not in the default testpaths).
"""

from __future__ import annotations

import random

import pytest

from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams

NUM_REQUESTS = 1_000
NUM_SYSTEM_PROMPTS = 10
SYSTEM_PROMPT_LEN = (256, 512)
TAIL_LEN = (32, 128)
NUM_DECODE_STEPS = 4
BLOCK_SIZE = 16
# Every system prompt stays cached: a request holds at most 41 blocks, so a prompt would
# have to go unused for ~200 requests (probability ~1e-9 here) before its blocks reach
# the head of the free queue.
NUM_GPU_BLOCKS = 8_192
MAX_MODEL_LEN = 1_024
VOCAB = 32_000
ROUNDS = 10

# name -> (enable_caching, hash_algo); "caching-off" is the baseline the others are divided by.
VARIANTS = {
    "caching-off": (False, "sha256"),
    "caching-on": (True, "sha256"),
    "caching-on-builtin-hash": (True, "builtin"),
}
BASELINE = "caching-off"
_requests_per_s: dict[str, float] = {}


def _workload() -> tuple[list[list[int]], list[int], list[list[int]]]:
    """(system prompts, system prompt index per request, unique tail per request), seeded."""
    rng = random.Random(0)
    systems = [
        [rng.randrange(VOCAB) for _ in range(rng.randint(*SYSTEM_PROMPT_LEN))] for _ in range(NUM_SYSTEM_PROMPTS)
    ]
    which = [rng.randrange(NUM_SYSTEM_PROMPTS) for _ in range(NUM_REQUESTS)]
    tails = [[rng.randrange(VOCAB) for _ in range(rng.randint(*TAIL_LEN))] for _ in range(NUM_REQUESTS)]
    return systems, which, tails


SYSTEMS, WHICH, TAILS = _workload()


def _expected_hit_tokens(enable_caching: bool) -> int:
    """Every request after the first of its system prompt hits that prompt's full blocks
    (tails are random over a 32k vocabulary, so the block after the prompt misses)."""
    if not enable_caching:
        return 0
    seen: set[int] = set()
    hits = 0
    for s in WHICH:
        if s in seen:
            hits += len(SYSTEMS[s]) // BLOCK_SIZE * BLOCK_SIZE
        seen.add(s)
    return hits


def _run_round(mgr: KVCacheManager, requests: list[Request]) -> tuple[int, int]:
    """Every request's life, one after another. Returns (hit tokens, free blocks at the end)."""
    hit_tokens = 0
    for req in requests:
        computed, num_computed = mgr.get_computed_blocks(req)
        hit_tokens += num_computed
        if mgr.allocate_slots(req, req.num_tokens - num_computed, computed) is None:
            raise AssertionError(f"{req.request_id}: pool of {mgr.num_gpu_blocks} blocks ran short")
        req.num_computed_tokens = req.num_tokens
        for step in range(NUM_DECODE_STEPS):
            req.append_output_token_ids(step)
            if mgr.allocate_slots(req, 1) is None:
                raise AssertionError(f"{req.request_id}: pool ran short at decode step {step}")
            req.num_computed_tokens += 1
        mgr.free(req)
        mgr.free_block_hashes(req)
    return hit_tokens, mgr.block_pool.get_num_free_blocks()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bench_prefix_caching_allocate_free_throughput(benchmark, variant: str) -> None:
    enable_caching, hash_algo = VARIANTS[variant]
    sampling = SamplingParams(max_tokens=NUM_DECODE_STEPS)

    def setup() -> tuple[tuple, dict]:
        mgr = KVCacheManager(
            BLOCK_SIZE, NUM_GPU_BLOCKS, MAX_MODEL_LEN, enable_caching=enable_caching, hash_algo=hash_algo
        )
        requests = [Request(f"req-{i}", SYSTEMS[WHICH[i]] + TAILS[i], sampling) for i in range(NUM_REQUESTS)]
        return (mgr, requests), {}

    hit_tokens, num_free = benchmark.pedantic(_run_round, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)

    expected_hits = _expected_hit_tokens(enable_caching)
    assert hit_tokens == expected_hits, f"{variant}: {hit_tokens} hit tokens, workload implies {expected_hits}"
    assert num_free == NUM_GPU_BLOCKS, f"{variant}: {num_free} of {NUM_GPU_BLOCKS} blocks free after the round"

    if benchmark.stats is None:  # --benchmark-disable: the round ran once, untimed
        return
    # The median round: on two shared cores one slow round (GC, a neighbour) moves the mean.
    rps = NUM_REQUESTS / benchmark.stats.stats.median
    _requests_per_s[variant] = rps
    benchmark.extra_info["requests_per_s"] = round(rps, 1)
    benchmark.extra_info["hit_tokens_per_round"] = hit_tokens
    if variant != BASELINE and BASELINE in _requests_per_s:
        benchmark.extra_info[f"ratio_vs_{BASELINE}"] = round(rps / _requests_per_s[BASELINE], 3)
