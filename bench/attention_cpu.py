"""Benchmark (CPU): the batched torch attention backend against the torch reference.

What it measures: one ``paged_attention`` call (one layer) of ``attention/torch_sdpa.py``
and of ``attention/reference.py`` on the same inputs, for decode batches of R = 1, 8, 32
and 128 requests with contexts of about 256 tokens (drawn from 224-288, so the batch is
ragged), and for a mixed batch (16 decodes, two 64-token prompts, one 64-token chunk at
context 256). Shapes: the attention layer of the CPU throughput model (8 query heads, 4
KV heads, head size 64, float32), block size 16, blocks shuffled across a pool.

How: ``torch.set_num_threads(T)`` for T = 1 and 2 (recorded); per case, the two backends
alternate (order swapped every repeat), each sample times enough calls to last about 5 ms,
and the figure is the median sample. The figure reported is the ratio
``reference / torch`` of the medians (above 1: the torch backend is faster), measured in
the same run, because absolute times on a shared two-core machine mean little. The JSON
also holds the medians and the largest difference between the two outputs.

A second table, ``grouping``, times what the backend does for ragged decode batches: 32
decodes with contexts drawn from 40-384, attended over 8 layers (8 calls) three ways: all
in one group, each call planning for itself (``GROUP_PADDING`` set to infinity); in
length groups, each call planning for itself; in length groups with one ``plan_step``
for the 8 calls, as the model runs it. The ratios are against the first.

A third table, ``cascade``, times one layer of decodes that share a cached prefix (the
same blocks at the start of every row): 32 requests sharing 256 of 520 tokens, and the
cases that set ``CASCADE_MIN_SAVED_KEYS`` (8 sharing 256, 16 sharing 64, 2 sharing 256,
each with 264 tokens of its own: 1,792, 960 and 256 keys saved). Each is attended with
the prefix split off and attended once, and as one group over every request's whole
context; the ratio is one group / cascade.

A fourth table, ``chunks``, times one layer of requests with a few query tokens each over
contexts of 224-288 (32 requests of 4 tokens: a verification step of 3 drafts; 32 of 9:
beam search's tail at block size 16; 8 of 16): in chunk groups (NOTE 8 of ``torch_sdpa``)
and each request alone (``SHORT_QUERY_MAX`` set to 1); the ratio is alone / grouped.

Run: ``python bench/attention_cpu.py`` (about two minutes) writes
``bench/results/attention_cpu.json``; ``--tables chunks`` (or any of ``backends``,
``grouping``, ``cascade``, comma-separated) runs only those. ``--dry-run`` runs every case
on tiny shapes with timings that mean nothing (the test suite runs it).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, write_json  # noqa: E402
from tinyvllm.attention import reference, torch_sdpa  # noqa: E402

FULL = dict(
    num_heads=8, num_kv_heads=4, head_size=64, block_size=16, context=(224, 288),
    decode_batches=[1, 8, 32, 128], mixed=dict(decodes=16, prompts=2, prompt_len=64, chunk=64, chunk_context=256),
    threads=[1, 2], repeats=15, sample_s=0.005, grouping=dict(decodes=32, context=(40, 384), layers=8),
    cascade=[(32, 256, 264), (8, 256, 264), (16, 64, 264), (2, 256, 264)],  # (decodes, shared, own tokens)
    chunks=[(32, 4), (32, 9), (8, 16)],  # (requests, query tokens each)
)  # fmt: skip
DRY = dict(
    num_heads=4, num_kv_heads=2, head_size=16, block_size=4, context=(6, 12),
    decode_batches=[1, 3], mixed=dict(decodes=2, prompts=1, prompt_len=5, chunk=3, chunk_context=9),
    threads=[1, 2], repeats=2, sample_s=0.0, grouping=dict(decodes=6, context=(2, 20), layers=2),
    cascade=[(3, 8, 5)],
    chunks=[(3, 2)],
)  # fmt: skip


def make_batch(query_lens, seq_lens, cfg, gen, shared=0):
    """Paged inputs: each request's blocks drawn from a shuffled pool, random K/V and queries.
    ``shared`` (whole blocks of tokens): a prefix whose blocks every request holds, as
    prefix caching leaves them."""
    bs = cfg["block_size"]
    num_shared = shared // bs
    needed = [-(-s // bs) - num_shared for s in seq_lens]
    num_blocks = num_shared + sum(needed) + 8
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    width = num_shared + max(needed)
    table, start = [], num_shared
    for n in needed:
        table.append(pool[:num_shared] + pool[start : start + n] + [0] * (width - num_shared - n))
        start += n
    shape = (num_blocks, bs, cfg["num_kv_heads"], cfg["head_size"])
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(sum(query_lens), cfg["num_heads"], cfg["head_size"], generator=gen)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens, table = torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(table, dtype=torch.int32)
    return query, key_cache, value_cache, qsl, lens, table


def cases(cfg, gen):
    """(name, R, tensors) for each decode batch and the mixed batch."""
    low, high = cfg["context"]
    for r in cfg["decode_batches"]:
        lens = torch.randint(low, high + 1, (r,), generator=gen).tolist()
        yield f"decode R={r}", r, make_batch([1] * r, lens, cfg, gen)
    m = cfg["mixed"]
    lens = torch.randint(low, high + 1, (m["decodes"],), generator=gen).tolist()
    query_lens = [1] * m["decodes"] + [m["prompt_len"]] * m["prompts"] + [m["chunk"]]
    seq_lens = lens + [m["prompt_len"]] * m["prompts"] + [m["chunk_context"]]
    yield "mixed", len(query_lens), make_batch(query_lens, seq_lens, cfg, gen)


def time_pair(fns, repeats, sample_s):
    """Median seconds per call of each function, the functions alternating sample by sample."""
    calls = {name: max(1, round(sample_s / max(_once(fn), 1e-6))) for name, fn in fns.items()}
    samples = {name: [] for name in fns}
    names = list(fns)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fns[name]()
            samples[name].append((time.perf_counter() - t0) / calls[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def _once(fn):
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def grouping_fns(cfg, gen) -> dict:
    """The three ways of attending a ragged decode batch over several layers (module header)."""
    g = cfg["grouping"]
    lens = torch.randint(g["context"][0], g["context"][1] + 1, (g["decodes"],), generator=gen).tolist()
    tensors = make_batch([1] * g["decodes"], lens, cfg, gen)
    scale, layers = cfg["head_size"] ** -0.5, g["layers"]

    def one_group():
        saved, torch_sdpa.GROUP_PADDING = torch_sdpa.GROUP_PADDING, float("inf")
        try:
            return [torch_sdpa.paged_attention(*tensors, scale) for _ in range(layers)][-1]
        finally:
            torch_sdpa.GROUP_PADDING = saved

    def groups():
        return [torch_sdpa.paged_attention(*tensors, scale) for _ in range(layers)][-1]

    def groups_one_plan():
        plan = torch_sdpa.plan_step(tensors[3], tensors[4], tensors[5], cfg["block_size"])
        return [torch_sdpa.paged_attention(*tensors, scale, plan=plan) for _ in range(layers)][-1]

    return {"one_group": one_group, "groups": groups, "groups_one_plan": groups_one_plan}


def cascade_fns(case, cfg, gen) -> dict:
    """One layer of decodes that share a prefix: split off and attended once (NOTE 7 of
    ``torch_sdpa``), and not (one group over every request's whole context)."""
    num_reqs, shared, own = case
    tensors = make_batch([1] * num_reqs, [shared + own] * num_reqs, cfg, gen, shared=shared)
    scale, plans = cfg["head_size"] ** -0.5, {}
    for name, bound in (("one_group", float("inf")), ("cascade", 0)):
        plans[name] = torch_sdpa.plan_step(*tensors[3:], cfg["block_size"], cascade_min_saved_keys=bound)
    assert plans["cascade"].decode_groups[0].prefix_blocks is not None
    return {name: lambda p=plan: torch_sdpa.paged_attention(*tensors, scale, plan=p) for name, plan in plans.items()}


def chunk_fns(case, cfg, gen) -> dict:
    """One layer of short queries: in chunk groups, and each request alone (module header)."""
    num_reqs, num_queries = case
    low, high = cfg["context"]
    lens = torch.randint(low, high + 1, (num_reqs,), generator=gen).tolist()
    tensors = make_batch([num_queries] * num_reqs, lens, cfg, gen)
    scale, plans = cfg["head_size"] ** -0.5, {}
    for name, bound in (("alone", 1), ("grouped", torch_sdpa.SHORT_QUERY_MAX)):
        saved, torch_sdpa.SHORT_QUERY_MAX = torch_sdpa.SHORT_QUERY_MAX, bound
        try:
            plans[name] = torch_sdpa.plan_step(*tensors[3:], cfg["block_size"])
        finally:
            torch_sdpa.SHORT_QUERY_MAX = saved
    assert len(plans["alone"].prefills) == num_reqs and not plans["grouped"].prefills
    return {name: lambda p=plan: torch_sdpa.paged_attention(*tensors, scale, plan=p) for name, plan in plans.items()}


TABLES = ("backends", "grouping", "cascade", "chunks")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, timings meaningless")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "attention_cpu.json"))
    parser.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {TABLES}")
    args = parser.parse_args(argv)
    tables = args.tables.split(",")
    if unknown := [t for t in tables if t not in TABLES]:
        parser.error(f"--tables: unknown {unknown}; choose from {TABLES}")
    cfg = DRY if args.dry_run else FULL
    results = []
    for threads in cfg["threads"] if "backends" in tables else ():
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(0)
        for name, num_reqs, tensors in cases(cfg, gen):
            scale = cfg["head_size"] ** -0.5
            fns = {
                "reference": lambda t=tensors: reference.paged_attention(*t, scale),
                "torch": lambda t=tensors: torch_sdpa.paged_attention(*t, scale),
            }
            diff = (fns["reference"]() - fns["torch"]()).abs().max().item()
            medians = time_pair(fns, cfg["repeats"], cfg["sample_s"])
            ratio = medians["reference"] / medians["torch"]
            results.append(dict(
                case=name, threads=threads, num_reqs=num_reqs, num_tokens=tensors[0].shape[0],
                reference_median_s=medians["reference"], torch_median_s=medians["torch"],
                ratio_reference_over_torch=ratio, max_abs_diff=diff,
            ))  # fmt: skip
            print(f"threads={threads} {name:14s} reference/torch = {ratio:6.2f}x  "
                  f"(reference {medians['reference'] * 1e6:9.1f} us, torch {medians['torch'] * 1e6:9.1f} us, "
                  f"max |diff| {diff:.1e})")  # fmt: skip
    grouping = []
    for threads in cfg["threads"] if "grouping" in tables else ():
        torch.set_num_threads(threads)
        fns = grouping_fns(cfg, torch.Generator().manual_seed(1))
        diff = max((fns[name]() - fns["one_group"]()).abs().max().item() for name in fns)
        medians = time_pair(fns, cfg["repeats"], cfg["sample_s"])
        ratios = {name: medians["one_group"] / medians[name] for name in fns}
        grouping.append(dict(threads=threads, medians_s=medians, ratio_one_group_over=ratios, max_abs_diff=diff))
        print(f"threads={threads} grouping: " + ", ".join(f"{n} {r:.2f}x" for n, r in ratios.items()))
    cascade = []
    for threads in cfg["threads"] if "cascade" in tables else ():
        torch.set_num_threads(threads)
        for case in cfg["cascade"]:
            fns = cascade_fns(case, cfg, torch.Generator().manual_seed(2))
            diff = (fns["cascade"]() - fns["one_group"]()).abs().max().item()
            medians = time_pair(fns, cfg["repeats"], cfg["sample_s"])
            ratio = medians["one_group"] / medians["cascade"]
            num_reqs, shared, own = case
            cascade.append(dict(
                threads=threads, num_reqs=num_reqs, shared=shared, own=own, medians_s=medians,
                ratio_one_group_over_cascade=ratio, max_abs_diff=diff,
            ))  # fmt: skip
            print(f"threads={threads} cascade: {num_reqs} decodes sharing {shared} of {shared + own} tokens: "
                  f"one group / cascade = {ratio:.2f}x (cascade {medians['cascade'] * 1e3:.2f} ms)")  # fmt: skip
    chunks = []
    for threads in cfg["threads"] if "chunks" in tables else ():
        torch.set_num_threads(threads)
        for case in cfg["chunks"]:
            fns = chunk_fns(case, cfg, torch.Generator().manual_seed(3))
            diff = (fns["grouped"]() - fns["alone"]()).abs().max().item()
            medians = time_pair(fns, cfg["repeats"], cfg["sample_s"])
            ratio = medians["alone"] / medians["grouped"]
            chunks.append(dict(threads=threads, num_reqs=case[0], query_tokens=case[1], medians_s=medians,
                               ratio_alone_over_grouped=ratio, max_abs_diff=diff))  # fmt: skip
            print(f"threads={threads} chunks: {case[0]} requests of {case[1]} query tokens: alone / grouped = "
                  f"{ratio:.2f}x (grouped {medians['grouped'] * 1e3:.2f} ms)")  # fmt: skip
    record = dict(
        benchmark="attention_cpu", dry_run=args.dry_run, torch=torch.__version__,
        python=sys.version.split()[0], machine=platform.machine(), processor=platform.processor(),
        tables=tables, config=cfg, results=results, grouping=grouping, cascade=cascade, chunks=chunks,
    )  # fmt: skip
    out = Path(args.out)
    write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
