"""Benchmark: the cost of prefix hashing per block, before and after packed serialization.

What it measures: the time to hash full blocks of 16 tokens, as the KV cache manager does
it, with the implementation before this change (copied below under ``old_`` names: a
block's key serialized with ``repr``, one ``hash_block_tokens`` call and one extra-keys
call per block) and with today's ``core/prefix_hash.py`` (``stable_bytes``: tagged,
length-prefixed, token ids packed once per request). Two paths, for both hash functions
(sha256, the default, and builtin):

- ``request``: ``hash_request_tokens`` over a whole request (a prompt at admission);
- ``per_block``: one block at a time, each chained to the previous one, as decode fills
  blocks (``BlockPool.cache_full_blocks``: old, its per-block loop; new,
  ``append_block_hashes`` for one block).

Workload: 1,000 requests of 64 full blocks (1,024 random token ids below 151,936, Qwen's
vocabulary), no LoRA, no cache salt; one request in ten carries a salt.

How: ``--repeats`` rounds; each round runs every case once over all requests, in an order
that alternates between rounds. The figure per case is the median round, divided by the
number of blocks; the ratio old/new is taken between medians of the same run. The goal is
new <= old / 2 for sha256 (ratio >= 2).

Run: ``python3 bench/hashing.py`` (about 30 s) writes ``bench/results/hashing.json``;
``--quick`` runs 20 requests, 2 rounds (the test suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, machine_info, versions, write_json  # noqa: E402  (it puts src/ on the path)
from tinyvllm.core.prefix_hash import (  # noqa: E402
    BlockHash,
    append_block_hashes,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
)
from tinyvllm.request import Request  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 151_936


# -- the implementation before this change, verbatim but for the old_ names ----------------


def old_stable_bytes(obj: Any) -> bytes:
    return repr(obj).encode("utf-8")


def old_sha256_hash(obj: Any) -> int:
    return int.from_bytes(hashlib.sha256(old_stable_bytes(obj)).digest(), "big")


def old_builtin_hash(obj: Any) -> int:
    return hash(obj)


_OLD_HASH_SEED: str = os.environ.get("TINYVLLM_HASH_SEED", "0")
_OLD_NONE_HASH_CACHE: dict = {}


def old_none_hash(hash_fn: Callable[[Any], int]) -> int:
    value = _OLD_NONE_HASH_CACHE.get(hash_fn)
    if value is None:
        value = hash_fn(("tinyvllm.none_hash", _OLD_HASH_SEED))
        _OLD_NONE_HASH_CACHE[hash_fn] = value
    return value


def old_hash_block_tokens(
    hash_fn: Callable[[Any], int],
    parent_block_hash_value: int | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    if parent_block_hash_value is None:
        parent_block_hash_value = old_none_hash(hash_fn)
    token_ids = tuple(curr_block_token_ids)
    value = hash_fn((parent_block_hash_value, token_ids, extra_keys))
    return BlockHash(value, token_ids, extra_keys)


def old_generate_block_hash_extra_keys(request: Request, start_token_idx: int, end_token_idx: int) -> tuple | None:
    keys: list[tuple[str, str]] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    if start_token_idx == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys) if keys else None


def old_hash_request_tokens(hash_fn: Callable[[Any], int], block_size: int, request: Request) -> list[BlockHash]:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    token_ids = request.all_token_ids
    hashes: list[BlockHash] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = old_generate_block_hash_extra_keys(request, start, end)
        block_hash = old_hash_block_tokens(hash_fn, parent, token_ids[start:end], extra)
        hashes.append(block_hash)
        parent = block_hash.hash_value
    return hashes


def old_cache_full_block(hash_fn, block_size: int, request: Request, block_hashes: list[BlockHash]) -> None:
    """The old ``BlockPool.cache_full_blocks`` loop body for one block past ``block_hashes``."""
    token_ids = request.all_token_ids
    i = len(block_hashes)
    start, end = i * block_size, (i + 1) * block_size
    parent = block_hashes[i - 1].hash_value if i > 0 else None
    extra = old_generate_block_hash_extra_keys(request, start, end)
    block_hashes.append(old_hash_block_tokens(hash_fn, parent, token_ids[start:end], extra))


# -- the cases -------------------------------------------------------------------------------


def make_requests(num_requests: int, num_blocks: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}", [rng.randrange(VOCAB) for _ in range(num_blocks * BLOCK_SIZE)], SamplingParams(),
            cache_salt="tenant" if i % 10 == 0 else None,
        )  # fmt: skip
        for i in range(num_requests)
    ]


def cases(requests: list[Request], num_blocks: int) -> dict[str, Callable[[], int]]:
    """Each case hashes every block of every request and returns how many it hashed."""
    out: dict[str, Callable[[], int]] = {}
    for name in ("sha256", "builtin"):
        old_fn = old_sha256_hash if name == "sha256" else old_builtin_hash
        new_fn = get_hash_fn(name)

        def old_request(fn=old_fn):
            return sum(len(old_hash_request_tokens(fn, BLOCK_SIZE, r)) for r in requests)

        def new_request(fn=new_fn):
            return sum(len(hash_request_tokens(fn, BLOCK_SIZE, r)) for r in requests)

        def old_per_block(fn=old_fn):
            total = 0
            for r in requests:
                hashes: list[BlockHash] = []
                for _ in range(num_blocks):
                    old_cache_full_block(fn, BLOCK_SIZE, r, hashes)
                total += len(hashes)
            return total

        def new_per_block(fn=new_fn):
            total = 0
            for r in requests:
                hashes: list[BlockHash] = []
                for n in range(1, num_blocks + 1):
                    append_block_hashes(fn, BLOCK_SIZE, r, hashes, n)
                total += len(hashes)
            return total

        out[f"{name}/request/old"], out[f"{name}/request/new"] = old_request, new_request
        out[f"{name}/per_block/old"], out[f"{name}/per_block/new"] = old_per_block, new_per_block
    return out


def check(requests: list[Request]) -> None:
    """The new fast paths give the same hashes as the block-by-block reference."""
    fn = get_hash_fn("sha256")
    for r in requests[:3] + [next(r for r in requests if r.cache_salt is not None)]:
        hashes, parent = hash_request_tokens(fn, BLOCK_SIZE, r), None
        for i, h in enumerate(hashes):
            block = r.all_token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            extra = (("salt", r.cache_salt),) if i == 0 and r.cache_salt is not None else None
            assert h == hash_block_tokens(fn, parent, block, extra), f"{r.request_id} block {i}"
            parent = h.hash_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="20 requests, 2 rounds: checks the script runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hashing.json")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.repeats = 20, 2
    requests = make_requests(args.num_requests, args.num_blocks)
    check(requests)
    fns = cases(requests, args.num_blocks)
    num_blocks = args.num_requests * args.num_blocks
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.repeats):
        for name in names if i % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            hashed = fns[name]()
            times[name].append(time.perf_counter() - t0)
            assert hashed == num_blocks, f"{name} hashed {hashed} blocks, not {num_blocks}"
    us_per_block = {name: statistics.median(ts) / num_blocks * 1e6 for name, ts in times.items()}
    ratios = {
        name[: -len("/old")].replace("/", "_") + "_old_over_new": us_per_block[name] / us_per_block[name[:-4] + "/new"]
        for name in names
        if name.endswith("/old")
    }
    for name, value in us_per_block.items():
        print(f"{name:24s} {value:7.3f} us/block")
    for name, value in ratios.items():
        print(f"{name:36s} {value:5.2f}x")
    record = {
        "benchmark": "hashing",
        "quick": args.quick,
        "num_requests": args.num_requests,
        "blocks_per_request": args.num_blocks,
        "block_size": BLOCK_SIZE,
        "repeats": args.repeats,
        "us_per_block_median": us_per_block,
        "ratios": ratios,
        "goal": "sha256 ratios >= 2 (new at most half the old cost per block)",
        "machine": machine_info(),
        "versions": versions(),
    }
    write_json(args.out, record)


if __name__ == "__main__":
    main()
