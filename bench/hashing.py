"""Benchmark: prefix hashing per block, old against new, and what block hashes cost the GC.

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

Second section, ``gc`` (issue 23): the cost of one full ``gc.collect()`` while a
``BlockPool`` holds N cached full blocks (``--gc-blocks``, default 100k and 300k), the
population of a long-running server whose prefix cache is full. The pool's blocks are
cached and then freed, so they sit in the free queue and in ``cached_block_hash_to_block``
as a finished request's blocks do. The variants differ only in the key each block
carries (the same hash values, tokens and extra keys):

- ``namedtuple``: the ``BlockHash`` NamedTuple before issue 23 (copied below as
  ``OldBlockHash``), the baseline: a tuple subclass, which the GC tracks for ever;
- ``tuple``: the same three fields as an exact tuple, which a collection untracks once its
  items are all untracked;
- ``bytes``: ``stable_bytes((hash value, token ids, extra keys))``, which the GC never
  tracks (vLLM's keys are bytes too);
- ``current``: the keys today's ``hash_request_tokens`` returns, whatever their type;
- ``blocks_only``: the pool with nothing cached, what its ``KVCacheBlock`` objects cost;
- ``tuple_flat``: ``tuple`` keys in a map that holds the block itself, not a dict
  ``{block id: block}`` per key (as vLLM's ``BlockHashToBlockMap`` does while a key has
  one block): what the inner dicts cost. tinyvllm's pool does not do this; it is measured
  to say what is left once the keys are untracked;
- ``tuple_frozen``: ``tuple``, with ``gc.freeze()`` called once the pool is made (as an
  engine could at the end of its start-up; vLLM does, in ``freeze_gc_heap``):
  the process's objects and the pool's blocks move to the permanent generation, which
  collections skip. Not done by tinyvllm's engine either; measured for the same reason.

Per variant: the median of ``--gc-collections`` timed ``gc.collect()`` calls (after three
untimed ones, so every key that can be untracked is), over ``--gc-rounds`` builds whose
order alternates; the GC-tracked objects it adds (``len(gc.get_objects())`` against the
process before any pool, frozen ones counted); the bytes of one key (its objects, the
ints of its tokens included); and the time of a first prefix-cache lookup with a freshly
built equal key (as a new request's lookup is). Ratios: ``namedtuple`` over each
variant, same run.

Run: ``python3 bench/hashing.py`` (about 2-3 minutes) writes ``bench/results/hashing.json``;
``--sections speed`` or ``--sections gc`` runs one section. ``--quick`` runs 20 requests,
2 rounds, and 2,000 blocks for ``gc`` (the test suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, machine_info, versions, write_json  # noqa: E402  (it puts src/ on the path)
from tinyvllm.core.block_pool import BlockPool  # noqa: E402
from tinyvllm.core.prefix_hash import (  # noqa: E402
    HASH_VALUE,
    append_block_hashes,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
    none_hash,
    sha256_hash,
    stable_bytes,
)
from tinyvllm.request import Request  # noqa: E402
from tinyvllm.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 151_936


# -- the implementation before this change, verbatim but for the old_ names ----------------


class OldBlockHash(NamedTuple):
    """``BlockHash`` before issue 23: a NamedTuple, which the GC tracks (the ``gc`` baseline)."""

    hash_value: int
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None


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
) -> OldBlockHash:
    if parent_block_hash_value is None:
        parent_block_hash_value = old_none_hash(hash_fn)
    token_ids = tuple(curr_block_token_ids)
    value = hash_fn((parent_block_hash_value, token_ids, extra_keys))
    return OldBlockHash(value, token_ids, extra_keys)


def old_generate_block_hash_extra_keys(request: Request, start_token_idx: int, end_token_idx: int) -> tuple | None:
    keys: list[tuple[str, str]] = []
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    if start_token_idx == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys) if keys else None


def old_hash_request_tokens(hash_fn: Callable[[Any], int], block_size: int, request: Request) -> list[OldBlockHash]:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    token_ids = request.all_token_ids
    hashes: list[OldBlockHash] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = old_generate_block_hash_extra_keys(request, start, end)
        block_hash = old_hash_block_tokens(hash_fn, parent, token_ids[start:end], extra)
        hashes.append(block_hash)
        parent = block_hash.hash_value
    return hashes


def old_cache_full_block(hash_fn, block_size: int, request: Request, block_hashes: list[OldBlockHash]) -> None:
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
                hashes: list[OldBlockHash] = []
                for _ in range(num_blocks):
                    old_cache_full_block(fn, BLOCK_SIZE, r, hashes)
                total += len(hashes)
            return total

        def new_per_block(fn=new_fn):
            total = 0
            for r in requests:
                hashes: list = []
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
            parent = h[HASH_VALUE]


# -- the gc section: one full collection with a full prefix cache -----------------------------

GC_VARIANTS = ("namedtuple", "tuple", "bytes", "current", "blocks_only", "tuple_flat", "tuple_frozen")
GC_LOOKUPS = 20_000  # fresh keys looked up per lookup timing (fewer if the pool is smaller)

KeyParts = tuple  # (hash value, token ids, extra keys) of one block


def block_tokens(num_blocks: int, seed: int = 1) -> list[int]:
    """The token ids of ``num_blocks`` full blocks, the same for every call with ``seed``.

    Made anew for every build and dropped before the timing: a finished request's token
    list is gone, and only its cached keys hold its tokens.
    """
    return random.Random(seed).choices(range(VOCAB), k=num_blocks * BLOCK_SIZE)


def block_parts(num_blocks: int) -> Iterator[KeyParts]:
    """(hash value, token ids, extra keys) of ``num_blocks`` full blocks, one at a time, as
    today's sha256 chain hashes them: requests of 64 blocks, the first block of one in ten
    salted."""
    tokens = block_tokens(num_blocks)
    root = none_hash(sha256_hash)
    parent = root
    for i in range(num_blocks):
        r, b = divmod(i, 64)  # request r, its block b
        if b == 0:
            parent = root
        block = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        extra = (("salt", "tenant"),) if b == 0 and r % 10 == 0 else None
        parent = sha256_hash((parent, block, extra))
        yield parent, block, extra


def variant_keys(variant: str, num_blocks: int) -> list:
    """Fresh keys of the first ``num_blocks`` blocks, in the form ``variant`` stores them,
    each built from its parts at once (no list of parts outlives the build)."""
    if variant == "blocks_only":
        return []
    if variant == "current":  # whatever today's core builds, from the same requests
        tokens, keys = block_tokens(num_blocks), []
        for r, start in enumerate(range(0, num_blocks * BLOCK_SIZE, 64 * BLOCK_SIZE)):
            salt = "tenant" if r % 10 == 0 else None
            request = Request(f"r{r}", tokens[start : start + 64 * BLOCK_SIZE], SamplingParams(), cache_salt=salt)
            keys += hash_request_tokens(get_hash_fn("sha256"), BLOCK_SIZE, request)
        return keys
    if variant == "namedtuple":
        return [OldBlockHash(*p) for p in block_parts(num_blocks)]
    if variant in ("tuple", "tuple_flat", "tuple_frozen"):
        return list(block_parts(num_blocks))  # each part is already an exact tuple
    if variant == "bytes":
        return [stable_bytes(p) for p in block_parts(num_blocks)]
    raise ValueError(f"unknown variant {variant!r}")


def cache_blocks(pool: BlockPool, keys: list, flat: bool = False) -> None:
    """Cache block i of ``pool`` under ``keys[i]`` (as ``cache_full_blocks`` does), then free
    them all: the prefix cache of finished requests, every block of the pool in it.
    ``flat``: the map holds each block itself instead of ``{block id: block}``."""
    if not keys:
        return
    blocks = pool.get_new_blocks(len(keys))
    cache: dict = pool.cached_block_hash_to_block
    for block, key in zip(blocks, keys):
        block.block_hash = key
        if flat:
            cache[key] = block
        else:
            cache.setdefault(key, {})[block.block_id] = block
    pool.free_blocks(reversed(blocks))


def key_bytes(key: object) -> int:
    """The memory of one key: its objects and theirs (ints of the small-int cache and None
    are shared by everything and not counted; a token tuple's ints are, since once the
    request is gone only the cached key holds them)."""
    seen: set[int] = set()

    def size(obj: object) -> int:
        if obj is None or id(obj) in seen or (type(obj) is int and -5 <= obj <= 256):
            return 0
        seen.add(id(obj))
        return sys.getsizeof(obj) + (sum(size(x) for x in obj) if isinstance(obj, tuple) else 0)

    return size(key)


def timed_collections(n: int) -> list[float]:
    """Seconds of ``n`` full collections, one by one."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return times


def measure_gc_variant(variant: str, num_blocks: int, collections: int) -> dict:
    """Build the variant's pool and time full collections with it alive (the module doc)."""
    gc.collect()
    tracked_before = len(gc.get_objects())
    pool = BlockPool(num_blocks)  # first, as the engine makes it at start-up
    if variant == "tuple_frozen":
        gc.freeze()  # everything alive now, the blocks included, leaves the collections
    try:
        keys = variant_keys(variant, num_blocks)
        sample = keys[:: max(1, len(keys) // 1000)]
        size = statistics.mean(key_bytes(k) for k in sample) if sample else 0.0
        cache_blocks(pool, keys, flat=variant == "tuple_flat")
        del keys, sample
        for _ in range(3):  # one collection untracks one level of nesting (prefix_hash.py NOTE 5)
            gc.collect()
        tracked = len(gc.get_objects()) + gc.get_freeze_count() - tracked_before  # frozen ones too
        times = timed_collections(collections)
    finally:
        gc.unfreeze()
    lookup_s: list[float] = []
    if variant != "blocks_only":
        num_lookups = min(num_blocks, GC_LOOKUPS)
        for _ in range(3):  # a new request's keys are new objects: nothing cached in them yet
            fresh = variant_keys(variant, num_lookups)
            get = pool.cached_block_hash_to_block.get if variant == "tuple_flat" else pool.get_cached_block
            t0 = time.perf_counter()
            hits = sum(get(k) is not None for k in fresh)
            lookup_s.append((time.perf_counter() - t0) / num_lookups)
            assert hits == num_lookups, f"{variant}: {hits} of {num_lookups} fresh keys hit"
    del pool
    gc.collect()
    return {
        "gc_ms_runs": [t * 1e3 for t in times],
        "tracked_objects_added": tracked,
        "key_bytes": size,
        "lookup_ns_runs": [t * 1e9 for t in lookup_s],
        "key_type": "" if variant == "blocks_only" else type(variant_keys(variant, 1)[0]).__name__,
    }


def run_gc(sizes: list[int], rounds: int, collections: int) -> dict:
    """The ``gc`` section: every variant at every size, ``rounds`` builds each, order alternating."""
    for variant in GC_VARIANTS:  # first calls fill module caches (struct, hash functions): not per block
        variant_keys(variant, 64)
    gc.collect()
    floor = {"tracked_objects": len(gc.get_objects()), "gc_ms": statistics.median(timed_collections(collections)) * 1e3}
    print(f"gc floor (this process, no pool): {floor['tracked_objects']} tracked objects, {floor['gc_ms']:.1f} ms")
    out: dict = {"floor": floor, "collections_per_build": collections, "rounds": rounds, "by_num_blocks": {}}
    was_enabled = gc.isenabled()
    gc.disable()  # only the collections this section runs, none in the middle of a build
    try:
        for n in sizes:
            runs: dict[str, list[dict]] = {v: [] for v in GC_VARIANTS}
            for r in range(rounds):
                for variant in GC_VARIANTS if r % 2 == 0 else reversed(GC_VARIANTS):
                    runs[variant].append(measure_gc_variant(variant, n, collections))
            variants = {}
            for v, rs in runs.items():
                gc_ms = [t for run in rs for t in run["gc_ms_runs"]]
                lookups = [t for run in rs for t in run["lookup_ns_runs"]]
                tracked = statistics.median(run["tracked_objects_added"] for run in rs)
                variants[v] = {
                    "key_type": rs[0]["key_type"],
                    "gc_ms_median": statistics.median(gc_ms),
                    "gc_ms_median_per_round": [statistics.median(run["gc_ms_runs"]) for run in rs],
                    "tracked_objects_added": tracked,
                    "tracked_objects_per_block": tracked / n,
                    "key_bytes": rs[0]["key_bytes"],
                    "lookup_ns_median": statistics.median(lookups) if lookups else None,
                }
            base = variants["namedtuple"]
            ratios = {f"namedtuple_over_{v}_gc_ms": base["gc_ms_median"] / variants[v]["gc_ms_median"] for v in GC_VARIANTS[1:]}
            out["by_num_blocks"][str(n)] = {"variants": variants, "ratios": ratios}
            print(f"\n{n} cached blocks: median of {rounds} x {collections} full gc.collect()")
            print(f"  {'variant':12s} {'key':10s} {'gc ms':>8s} {'base/this':>9s} {'tracked/block':>13s} {'key B':>6s} {'lookup ns':>9s}")
            for v, d in variants.items():
                ratio = base["gc_ms_median"] / d["gc_ms_median"]
                lookup = "-" if d["lookup_ns_median"] is None else f"{d['lookup_ns_median']:.0f}"
                print(
                    f"  {v:12s} {d['key_type']:10s} {d['gc_ms_median']:8.1f} {ratio:9.2f} "
                    f"{d['tracked_objects_per_block']:13.2f} {d['key_bytes']:6.0f} {lookup:>9s}"
                )
    finally:
        if was_enabled:
            gc.enable()
    return out


def run_speed(args: argparse.Namespace) -> dict:
    """The ``speed`` section: hashing cost per block, old against new (the module doc)."""
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
    return {
        "num_requests": args.num_requests,
        "blocks_per_request": args.num_blocks,
        "block_size": BLOCK_SIZE,
        "repeats": args.repeats,
        "us_per_block_median": us_per_block,
        "ratios": ratios,
        "goal": "sha256 ratios >= 2 (new at most half the old cost per block)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="speed,gc", help="comma-separated: speed, gc")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gc-blocks", default="100000,300000", help="cached blocks per gc measurement, comma-separated")
    parser.add_argument("--gc-rounds", type=int, default=3)
    parser.add_argument("--gc-collections", type=int, default=7, help="timed full collections per build")
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds: checks the script runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hashing.json")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if unknown := set(sections) - {"speed", "gc"}:
        parser.error(f"unknown sections {sorted(unknown)}")
    if args.quick:
        args.num_requests, args.repeats = 20, 2
        args.gc_blocks, args.gc_rounds, args.gc_collections = "2000", 2, 3
    record: dict = {
        "benchmark": "hashing",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python bench/hashing.py", *sys.argv[1:]]),
        "quick": args.quick,
        "sections": sections,
        "machine": machine_info(),
        "versions": versions(),
    }
    if "speed" in sections:
        record.update(run_speed(args))
    if "gc" in sections:
        sizes = [int(n) for n in args.gc_blocks.split(",")]
        record["gc"] = run_gc(sizes, args.gc_rounds, args.gc_collections)
    write_json(args.out, record)


if __name__ == "__main__":
    main()
