"""Benchmark: the unified Triton paged-attention kernel against torch SDPA on contiguous K/V.

What it measures: decode (batches 1-256 at contexts 512-8192, one query token per
request) and prefill (one request of 128-4096 tokens), for the Triton kernel reading a paged
cache through a shuffled block table, and for ``torch.nn.functional.scaled_dot_product_attention``
on the same math with contiguous K/V (the best a user gets without paging). The kernel runs
at its default KV tile (``choose_kv_tile``) and at each width of ``kv_tiles`` (keys per
loop trip; 16 is one cache block, the kernel before tiles were decoupled from blocks), so
one run says which width to choose. Times are the device's: ten calls captured in one
CUDA graph and replayed, as the engine's full graphs run attention. Each decode shape is
also timed with the context forced into 1, 4 and 16 segments (the split-KV path; the
measurement the split rule, ``choose_num_segments``, needs). Ragged decode batches (contexts
100-2048, as nano-vllm's workload makes them) are timed against a batch of the same size at
their mean context. A call launched alone
by the host is also timed ("launched"): at small shapes that is the host's launch, not
the kernel (the first GPU run timed only that, and read 160-190 us for a 5 us kernel).
For decode it reports the achieved bandwidth (K and V bytes read / time) next to the
device's measured copy bandwidth. Every timing goes to a JSON file in ``bench/results/``
with the device and versions.

Run on a GPU: ``python3 bench/attention.py`` (about two minutes on an H100).
``--dry-run`` runs every code path (the split-KV one too) on tiny shapes (on the CPU under the Triton interpreter),
with wall-clock timings that mean nothing; the test suite runs it. Without CUDA and without
``--dry-run`` it prints a message and exits 0.

Shapes: a Llama-3-8B attention layer (32 query heads, 8 KV heads, head size 128), bf16,
block size 16.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, write_json  # noqa: E402

FULL = dict(
    num_heads=32, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16",
    decode_batches=[1, 4, 16, 64, 256], decode_contexts=[512, 2048, 8192],
    prefill_lengths=[128, 512, 1024, 2048, 4096], kv_tiles=[16, 32, 64, 128], decode_segments=[1, 4, 16],
    ragged_decode=[(64, 100, 2048), (256, 100, 2048)],
    copy_bytes=1 << 30, iters=20, warmup=5, graph_reps=10,
)  # fmt: skip
DRY = dict(
    num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype="float32",
    decode_batches=[1, 2], decode_contexts=[20, 520], prefill_lengths=[16], kv_tiles=[16, 32], decode_segments=[1, 4],
    ragged_decode=[(3, 5, 60)],
    copy_bytes=1 << 20, iters=1, warmup=0, graph_reps=1,
)  # fmt: skip
# The prefill sweep (triton_attention.py NOTE 5): rows per query tile, keys per KV tile, warps and
# pipelining stages, the kinds of choice Triton's fused-attention tutorial autotunes its forward over,
# at the attention shapes of Llama-3-8B (32 query heads) and Qwen3-0.6B (16), 8 KV heads of 128.
# "staged" (sweep_stages): the default and the default with the other K/V loads (kv_desc), every
# (block_m, kv_tile) at the default launch (a warp per 16 rows: warps_for_rows), every (num_warps,
# num_stages) at the best so far at the longest length, and that best with the other loads: 12
# configs a shape instead of the grid's 48, since each config is one more compile (about 1.5 s for
# sm_90) and gpu.sh's step starts none after ATTENTION_SWEEP_LIMIT_S. 32 keys a tile, the default's,
# is timed as the default; in the H200 sweep of 2026-11-30 it was at best 3% faster than 64 (and
# slower at 4,096 tokens for both shapes), so stage 0 tries 64 and 128.
# plain_flash: the baseline (bench/plain_flash.py) timed at the longest length before each shape's
# configs, at these of its (rows, keys, warps, stages) configs: two compiles a shape.
SWEEP_FULL = dict(
    shapes=[("Llama-3-8B", 32, 8), ("Qwen3-0.6B", 16, 8)], head_size=128, block_size=16, dtype="bfloat16",
    lengths=[512, 1024, 2048, 4096], block_m=[64, 128], kv_tile=[64, 128], num_warps=[4, 8], num_stages=[2, 3, 4],
    kv_desc=[False, True], iters=10, warmup=3, graph_reps=10, atol=3e-2, plain_flash=[(128, 64, 8, 3), (64, 64, 4, 3)],
)  # fmt: skip
SWEEP_DRY = dict(
    shapes=[("tiny", 4, 2)], head_size=16, block_size=16, dtype="float32", lengths=[16],
    block_m=[64], kv_tile=[16, 32], num_warps=[4], num_stages=[3], kv_desc=[False, True], iters=1, warmup=0, graph_reps=1, atol=1e-4,
    plain_flash=[(16, 16, 4, 1)],
)  # fmt: skip


def timer(fn, device: str, iters: int, warmup: int) -> float:
    """Median seconds per call, each call launched by the host: CUDA events on a GPU, wall
    clock otherwise. A call whose kernels take less than their launch times the host."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_timer(fn, device: str, iters: int, warmup: int, graph_reps: int) -> float:
    """Median seconds per call of the device's own time: ``graph_reps`` calls captured in one
    CUDA graph and replayed, as the engine's full graphs run the kernel, so no host launch
    sits between them. Without CUDA, the host timer (the dry run)."""
    if device != "cuda":
        return timer(fn, device, iters, warmup)
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_reps):
            fn()
    return timer(graph.replay, device, iters, warmup) / graph_reps


def copy_bandwidth(device: str, num_bytes: int, iters: int, warmup: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timer(lambda: dst.copy_(src), device, iters, warmup)


def make_batch(query_lens, seq_lens, cfg, device, contiguous: bool = True):
    """A paged batch with shuffled block ids, and (``contiguous``, one length for all) the
    same K/V laid out contiguously for SDPA."""
    h, hkv, d, s = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_size"], cfg["block_size"]
    dtype = getattr(torch, cfg["dtype"])
    blocks = [-(-n // s) for n in seq_lens]
    perm = torch.randperm(sum(blocks), device=device).to(torch.int32)
    key_cache = torch.randn(sum(blocks), s, hkv, d, device=device, dtype=dtype)  # [B, S, Hkv, D]
    value_cache = torch.randn_like(key_cache)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)  # [R, max_blocks]
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[start : start + n]
        start += n
    query = torch.randn(sum(query_lens), h, d, device=device, dtype=dtype)  # [N, H, D]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if not contiguous:
        return (query, key_cache, value_cache, qsl, sl, table), (None, None)
    length = seq_lens[0]  # contiguous copies for SDPA: every request has this length
    k = key_cache[table.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()  # [R, Hkv, L, D]
    v = value_cache[table.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()  # [R, Hkv, L, D]
    return (query, key_cache, value_cache, qsl, sl, table), (k, v)


def sdpa(q, k, v, causal: bool):
    """SDPA with grouped-query heads (``enable_gqa`` where torch has it)."""
    try:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def time_tiles(paged, reference, cfg, device) -> dict:
    """The kernel at its default KV tile and at each of ``cfg['kv_tiles']``, as device time,
    each checked against ``reference`` first."""
    from tinyvllm.attention import triton_attention

    scale = cfg["head_size"] ** -0.5
    timing = dict(device=device, iters=cfg["iters"], warmup=cfg["warmup"], graph_reps=cfg["graph_reps"])
    out = torch.empty_like(paged[0])
    by_tile, max_diff = {}, 0.0
    for tile in [None, *cfg["kv_tiles"]]:
        triton_attention.paged_attention(*paged, scale, out=out, kv_tile=tile)
        max_diff = max(max_diff, (out.float() - reference.float()).abs().max().item())
        call = lambda tile=tile: triton_attention.paged_attention(*paged, scale, out=out, kv_tile=tile)  # noqa: E731
        by_tile["default" if tile is None else str(tile)] = device_timer(call, **timing)
    return dict(
        triton_us=by_tile["default"] * 1e6,
        triton_us_by_kv_tile={t: v * 1e6 for t, v in by_tile.items() if t != "default"},
        best_kv_tile=min(cfg["kv_tiles"], key=lambda t: by_tile[str(t)]), max_abs_diff_vs_sdpa=max_diff,
    )  # fmt: skip


def time_case(paged, reference, run_sdpa, cfg, device) -> dict:
    """One shape: ``time_tiles``, SDPA as device time, and the kernel and SDPA as one
    host-launched call each."""
    from tinyvllm.attention import triton_attention

    scale = cfg["head_size"] ** -0.5
    timing = dict(device=device, iters=cfg["iters"], warmup=cfg["warmup"])
    out = torch.empty_like(paged[0])
    return time_tiles(paged, reference, cfg, device) | dict(
        sdpa_us=device_timer(run_sdpa, graph_reps=cfg["graph_reps"], **timing) * 1e6,
        triton_launched_us=timer(lambda: triton_attention.paged_attention(*paged, scale, out=out), **timing) * 1e6,
        sdpa_launched_us=timer(run_sdpa, **timing) * 1e6,
    )  # fmt: skip


def ragged_decode(cfg: dict, device: str, bw_copy: float) -> list[dict]:
    """Decode over ragged contexts, as a generation workload has them (nano-vllm's prompts
    and outputs of 100-1024 tokens make contexts of 100-2048), against one batch of the
    same size where every context is the mean: what the spread costs the kernel, each
    program walking its own request's context. Checked against the torch reference."""
    from tinyvllm.attention import reference as torch_reference

    elt = torch.finfo(getattr(torch, cfg["dtype"])).bits // 8
    rows = []
    for batch, low, high in cfg["ragged_decode"]:
        rng = random.Random(batch)
        contexts = [rng.randint(low, high) for _ in range(batch)]
        mean = round(sum(contexts) / batch)
        for shape, seq_lens in (("ragged", contexts), ("uniform", [mean] * batch)):
            paged, _ = make_batch([1] * batch, seq_lens, cfg, device, contiguous=False)
            expected = torch_reference.paged_attention(*paged, cfg["head_size"] ** -0.5)
            row = time_tiles(paged, expected, cfg, device)
            row["max_abs_diff_vs_reference"] = row.pop("max_abs_diff_vs_sdpa")
            kv_bytes = 2 * sum(seq_lens) * cfg["num_kv_heads"] * cfg["head_size"] * elt
            rows.append(dict(
                shape=shape, batch=batch, contexts=[min(seq_lens), max(seq_lens)], mean_context=mean, **row,
                triton_GBps=kv_bytes / row["triton_us"] / 1e3,
                triton_fraction_of_copy=kv_bytes / (row["triton_us"] / 1e6) / bw_copy,
            ))  # fmt: skip
            del paged
    return rows


def time_segments(paged, reference, cfg, device) -> dict:
    """The decode kernel at its default tile with each split of ``cfg['decode_segments']``
    forced (``choose_num_segments`` decides otherwise): the measurement for the split rule."""
    from tinyvllm.attention import triton_attention

    scale = cfg["head_size"] ** -0.5
    out = torch.empty_like(paged[0])
    times = {}
    for segments in cfg["decode_segments"]:
        call = lambda n=segments: triton_attention.paged_attention(*paged, scale, out=out, num_segments=n)  # noqa: E731
        call()
        torch.testing.assert_close(out.float(), reference.float(), atol=3e-2, rtol=3e-2)
        times[str(segments)] = device_timer(
            call, device, iters=cfg["iters"], warmup=cfg["warmup"], graph_reps=cfg["graph_reps"]
        ) * 1e6  # fmt: skip
    return times


def run(cfg: dict, device: str) -> dict:
    from tinyvllm.attention import triton_attention

    h, d = cfg["num_heads"], cfg["head_size"]
    elt = torch.finfo(getattr(torch, cfg["dtype"])).bits // 8
    bw_copy = copy_bandwidth(device, cfg["copy_bytes"], cfg["iters"], cfg["warmup"])
    results = {"copy_bandwidth_GBps": bw_copy / 1e9, "decode": [], "prefill": []}
    results["ragged_decode"] = ragged_decode(cfg, device, bw_copy)

    for batch in cfg["decode_batches"]:
        for context in cfg["decode_contexts"]:
            paged, (k, v) = make_batch([1] * batch, [context] * batch, cfg, device)
            q4 = paged[0].view(batch, 1, h, d).transpose(1, 2)  # [R, H, 1, D]
            reference = sdpa(q4, k, v, causal=False).transpose(1, 2).reshape_as(paged[0])
            row = time_case(paged, reference, lambda: sdpa(q4, k, v, causal=False), cfg, device)
            row["triton_us_by_segments"] = time_segments(paged, reference, cfg, device)
            kv_bytes = 2 * batch * context * cfg["num_kv_heads"] * d * elt
            segments = triton_attention.choose_num_segments(batch, batch, cfg["num_kv_heads"], paged[5].shape[1] * cfg["block_size"])
            results["decode"].append(dict(
                batch=batch, context=context, num_segments=segments,
                default_kv_tile=triton_attention.choose_kv_tile(decode_only=True), **row,
                triton_GBps=kv_bytes / row["triton_us"] / 1e3, sdpa_GBps=kv_bytes / row["sdpa_us"] / 1e3,
                triton_fraction_of_copy=kv_bytes / (row["triton_us"] / 1e6) / bw_copy,
            ))  # fmt: skip
            del paged, k, v

    for length in cfg["prefill_lengths"]:
        paged, (k, v) = make_batch([length], [length], cfg, device)
        q4 = paged[0].view(1, length, h, d).transpose(1, 2)  # [1, H, L, D]
        reference = sdpa(q4, k, v, causal=True).transpose(1, 2).reshape_as(paged[0])
        row = time_case(paged, reference, lambda: sdpa(q4, k, v, causal=True), cfg, device)
        flops = 2 * 2 * h * d * length * (length + 1) / 2  # QK^T and PV over the causal half
        results["prefill"].append(dict(
            length=length, default_kv_tile=triton_attention.choose_kv_tile(decode_only=False), **row,
            triton_TFLOPs=flops / row["triton_us"] / 1e6, sdpa_TFLOPs=flops / row["sdpa_us"] / 1e6,
        ))  # fmt: skip
        del paged, k, v
    return results


def config_key(c: dict) -> str:
    return f"m{c['block_m']}-n{c['kv_tile']}-w{c['num_warps']}-s{c['num_stages']}" + ("-desc" if c["kv_desc"] else "")


def default_prefill_config(num_heads: int, num_kv_heads: int, head_size: int = 128, dtype: str = "bfloat16",
                           device: str = "cpu") -> dict:  # fmt: skip
    """What the launcher chooses for a prefill batch of this shape on ``device`` (``choose_*``)."""
    import torch

    from tinyvllm.attention import triton_attention as ta
    from tinyvllm.attention.metadata import AttentionLayout

    _, block_m = ta.choose_query_tile(num_heads // num_kv_heads, decode_only=False)
    num_warps, num_stages = ta.choose_launch_options(decode_only=False)
    return dict(block_m=block_m, kv_tile=ta.choose_kv_tile(decode_only=False), num_warps=num_warps, num_stages=num_stages,
                kv_desc=ta.choose_kv_desc(AttentionLayout(num_heads, num_kv_heads, head_size, 16, getattr(torch, dtype), torch.device(device))))  # fmt: skip


def warps_for_rows(block_m: int, default_warps: int) -> int:
    """Stage 0's warps for a query tile of ``block_m`` rows: one warp per 16 rows, never fewer
    than the default's. On sm_90 a warpgroup (4 warps) computes 64 rows of a ``tl.dot``, so 128
    rows at 4 warps make one warpgroup do two tiles' work: timed that way, a 128-row tile loses
    to a 64-row one for its warps, not for its rows (the H200 sweep of 2026-11-30, staged before
    this rule, timed 128 rows at 8 warps only where 128 rows at 4 had already won)."""
    return max(default_warps, block_m // 16)


SWEEP_STAGES = 3


def sweep_stages(sweep: dict, default: dict, best: dict | None, mode: str, stage: int) -> list[dict]:
    """The configs ``stage`` times, ``best`` being the fastest so far at the longest length: the
    whole grid at stage 0, or (``staged``) stage 0 the default, the default with its K/V loads
    the other way (``kv_desc``, triton_kernels.py NOTE 4: early, since gpu.sh's step may cut
    the sweep short), then every (block_m, kv_tile) at the default launch with
    ``warps_for_rows`` warps; stage 1 every (num_warps, num_stages) at ``best``; stage 2
    ``best`` with its loads the other way. No config twice."""
    if mode == "grid":
        return [dict(block_m=m, kv_tile=n, num_warps=w, num_stages=st, kv_desc=d) for m in sweep["block_m"]
                for n in sweep["kv_tile"] for w in sweep["num_warps"] for st in sweep["num_stages"]
                for d in sweep["kv_desc"]] if stage == 0 else []  # fmt: skip
    if stage == 0:
        tiles = [dict(default, block_m=m, kv_tile=n, num_warps=warps_for_rows(m, default["num_warps"]))
                 for m in sweep["block_m"] for n in sweep["kv_tile"]]  # fmt: skip
        configs = [default, dict(default, kv_desc=not default["kv_desc"]), *tiles]
    elif stage == 1:
        configs = [dict(best, num_warps=w, num_stages=st) for w in sweep["num_warps"] for st in sweep["num_stages"]]
    else:
        configs = [dict(best, kv_desc=not best["kv_desc"])]
    return list({config_key(c): c for c in configs}.values())


def time_cache_only(paged, rows, expected, cfg, default, timing, atol) -> float | None:
    """The default config reading every key from the cache (``step_kv=False``: the block-table
    walk of triton_kernels.py NOTE 3, not the step's own rows of NOTE 1): device microseconds,
    None if it disagrees. The walk has no step rows for descriptors to load (NOTE 4), so it
    keeps the pointer loads where the device's default takes descriptors."""
    from tinyvllm.attention import triton_attention

    out = torch.empty_like(paged[0])
    walk = dict(default, kv_desc=False)
    call = lambda: triton_attention.paged_attention(  # noqa: E731
        *paged, cfg["head_size"] ** -0.5, out=out, **rows, step_kv=False, **walk
    )  # fmt: skip
    call()
    if not (out.float() - expected.float()).abs().max().item() <= atol:
        return None
    return device_timer(call, **timing) * 1e6


def time_plain_flash(case: dict, sweep: dict, timing: dict) -> dict:
    """``plain_flash.py``'s kernel on the case's contiguous q, k, v at each of its sweep
    configs: µs by config (a config that fails or disagrees with SDPA is recorded as an error)."""
    from plain_flash import plain_causal_flash

    q = case["paged"][0]  # [L, H, D], contiguous
    us, errors = {}, {}
    for block_m, block_n, warps, stages in sweep["plain_flash"]:
        key = f"m{block_m}-n{block_n}-w{warps}-s{stages}"
        call = lambda: plain_causal_flash(q, case["rows"]["key"], case["rows"]["value"], block_m, block_n, warps, stages)  # noqa: E731
        try:
            diff = (call().float() - case["expected"].float()).abs().max().item()
        except Exception as exc:  # recorded, not fatal: the paged sweep goes on
            errors[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            continue
        if not diff <= sweep["atol"]:
            errors[key] = f"wrong: max abs diff {diff:.3g} > {sweep['atol']}"
            continue
        us[key] = device_timer(call, **timing) * 1e6
    return dict(us=us, errors=errors)


def prefill_sweep(sweep: dict, device: str, mode: str = "staged", time_limit_s: float | None = None) -> dict:
    """Prefill attention (one request of each length) for each config of ``sweep_stages``, as
    device time, against SDPA in the same run: TFLOP/s, the ratio to SDPA, and the best config
    per length. Each config is checked against SDPA first; one that fails to launch (too much
    shared memory) or disagrees is recorded and left out of the best. Past ``time_limit_s`` no
    further config starts (``complete: false`` and the configs left untimed are named)."""
    from tinyvllm.attention import triton_attention

    start, rows, skipped = time.perf_counter(), [], []
    timing = dict(device=device, iters=sweep["iters"], warmup=sweep["warmup"], graph_reps=sweep["graph_reps"])
    for name, num_heads, num_kv_heads in sweep["shapes"]:
        cfg = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=sweep["head_size"],
                   block_size=sweep["block_size"], dtype=sweep["dtype"])  # fmt: skip
        default = default_prefill_config(num_heads, num_kv_heads, sweep["head_size"], sweep["dtype"], device)
        cases = []
        for length in sweep["lengths"]:
            paged, (k, v) = make_batch([length], [length], cfg, device)
            q4 = paged[0].view(1, length, num_heads, cfg["head_size"]).transpose(1, 2)  # [1, H, L, D]
            expected = sdpa(q4, k, v, causal=True).transpose(1, 2).reshape_as(paged[0])  # [N, H, D]
            sdpa_us = device_timer(lambda q4=q4, k=k, v=v: sdpa(q4, k, v, causal=True), **timing) * 1e6
            flops = 2 * 2 * num_heads * cfg["head_size"] * length * (length + 1) / 2  # QK^T and PV, causal half
            own = dict(key=k[0].transpose(0, 1).contiguous(), value=v[0].transpose(0, 1).contiguous())  # [L, Hkv, D]
            cache_only = time_cache_only(paged, own, expected, cfg, default, timing, sweep["atol"])
            cases.append(dict(length=length, paged=paged, rows=own, expected=expected, sdpa_us=sdpa_us, flops=flops,
                              us={}, errors={}, max_abs_diff={}, cache_only_default_us=cache_only))  # fmt: skip
        plain = time_plain_flash(cases[-1], sweep, timing)  # the longest length, before any config of the sweep
        best, timed = None, {}  # the fastest at the longest length so far; every config started, by key
        for stage in range(SWEEP_STAGES):
            for config in sweep_stages(sweep, default, best, mode, stage):
                key = config_key(config)
                if key in timed:
                    continue
                if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
                    skipped.append(f"{name}:{key}")
                    continue
                timed[key] = config
                for case in cases:
                    out = torch.empty_like(case["paged"][0])
                    call = lambda case=case, out=out: triton_attention.paged_attention(  # noqa: E731
                        *case["paged"], cfg["head_size"] ** -0.5, out=out, **case["rows"], **config
                    )  # fmt: skip
                    try:
                        call()
                    except Exception as exc:  # a config the device cannot launch: recorded, not fatal
                        case["errors"][key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                        continue
                    diff = (out.float() - case["expected"].float()).abs().max().item()
                    case["max_abs_diff"][key] = diff
                    if not diff <= sweep["atol"]:
                        case["errors"][key] = f"wrong: max abs diff {diff:.3g} > {sweep['atol']}"
                        continue
                    case["us"][key] = device_timer(call, **timing) * 1e6
            longest = cases[-1]["us"]
            if not longest:
                break
            best = timed[min(longest, key=longest.get)]
        for case in cases:
            us, default_key = case["us"], config_key(default)
            best = min(us, key=us.get) if us else None
            tflops = lambda t, case=case: case["flops"] / t / 1e6  # noqa: E731
            rows.append(dict(
                shape=name, num_heads=num_heads, num_kv_heads=num_kv_heads, length=case["length"],
                sdpa_us=case["sdpa_us"], sdpa_TFLOPs=tflops(case["sdpa_us"]), default_config=default_key,
                default_us=us.get(default_key), default_TFLOPs=tflops(us[default_key]) if default_key in us else None,
                default_ratio_to_sdpa=case["sdpa_us"] / us[default_key] if default_key in us else None,
                best_config=best, best_us=us.get(best), best_TFLOPs=tflops(us[best]) if best else None,
                best_ratio_to_sdpa=case["sdpa_us"] / us[best] if best else None,
                cache_only_default_us=case["cache_only_default_us"],
                cache_only_default_ratio_to_sdpa=case["sdpa_us"] / case["cache_only_default_us"]
                if case["cache_only_default_us"] else None,
                triton_us_by_config=us, errors=case["errors"], max_abs_diff_by_config=case["max_abs_diff"],
                **(plain_flash_figures(plain, case, us.get(best)) if case is cases[-1] else {}),
            ))  # fmt: skip
        del cases
    return dict(mode=mode, complete=not skipped, not_timed=skipped, seconds=time.perf_counter() - start, rows=rows)


def plain_flash_figures(plain: dict, case: dict, best_us: float | None) -> dict:
    """The baseline's figures for the longest row: its fastest config, TFLOP/s, ratio to SDPA,
    and the paged kernel's best against it (above 1: the paged kernel is faster)."""
    us = plain["us"]
    fastest = min(us, key=us.get) if us else None
    return dict(
        plain_flash_us_by_config=us, plain_flash_errors=plain["errors"], plain_flash_best_config=fastest,
        plain_flash_TFLOPs=case["flops"] / us[fastest] / 1e6 if fastest else None,
        plain_flash_ratio_to_sdpa=case["sdpa_us"] / us[fastest] if fastest else None,
        best_ratio_to_plain_flash=us[fastest] / best_us if fastest and best_us else None,
    )  # fmt: skip


def print_sweep(sweep: dict) -> None:
    print(f"prefill sweep ({sweep['mode']}, {sweep['seconds']:.0f} s{'' if sweep['complete'] else ', cut short'}): "
          "shape length | sdpa TFLOP/s | cache only, default x sdpa | default config TFLOP/s x sdpa | "
          "best config TFLOP/s x sdpa | configs")  # fmt: skip
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for r in sweep["rows"]:
        print(
            f"  {r['shape']:10s} {r['length']:5d} | {r['sdpa_TFLOPs']:7.1f} | "
            f"{fmt(r['cache_only_default_ratio_to_sdpa'], '5.2f')} | {r['default_config']} "
            f"{fmt(r['default_TFLOPs'], '7.1f')} {fmt(r['default_ratio_to_sdpa'], '5.2f')} | {r['best_config']} "
            f"{fmt(r['best_TFLOPs'], '7.1f')} {fmt(r['best_ratio_to_sdpa'], '5.2f')} | "
            f"{len(r['triton_us_by_config'])} timed, {len(r['errors'])} failed"
        )
        if "plain_flash_best_config" in r:
            print(f"  {'':10s} {'':5s}   plain flash (plain_flash.py) {r['plain_flash_best_config']} "
                  f"{fmt(r['plain_flash_TFLOPs'], '7.1f')} {fmt(r['plain_flash_ratio_to_sdpa'], '5.2f')} x sdpa; "
                  f"the best config x{fmt(r['best_ratio_to_plain_flash'], '.2f')} of it")  # fmt: skip


def print_table(results: dict) -> None:
    print(f"copy bandwidth: {results['copy_bandwidth_GBps']:.0f} GB/s")
    print("device time in us (graph replays); 'launched': one call launched by the host")
    tiles = list(results["decode"][0]["triton_us_by_kv_tile"]) if results["decode"] else []
    head = " ".join(f"{'kv' + t:>7}" for t in tiles)
    splits = list(results["decode"][0]["triton_us_by_segments"]) if results["decode"] else []
    split_head = " ".join(f"{'seg' + n:>7}" for n in splits)
    print(f"decode: batch context segs | triton {head} | default  GB/s %copy | {split_head} "
          "| sdpa us  GB/s | launched triton sdpa | max diff")  # fmt: skip
    for r in results["decode"]:
        by = " ".join(f"{r['triton_us_by_kv_tile'][t]:7.1f}" for t in tiles)
        seg = " ".join(f"{r['triton_us_by_segments'][n]:7.1f}" for n in splits)
        print(
            f"  {r['batch']:5d} {r['context']:7d} {r['num_segments']:4d} |        {by} | {r['triton_us']:7.1f} "
            f"{r['triton_GBps']:5.0f} {100 * r['triton_fraction_of_copy']:5.1f} | {seg} | {r['sdpa_us']:7.1f} "
            f"{r['sdpa_GBps']:5.0f} | {r['triton_launched_us']:15.1f} {r['sdpa_launched_us']:5.1f} "
            f"| {r['max_abs_diff_vs_sdpa']:.1e}"
        )
    print(f"ragged decode: shape batch contexts | triton {head} | default  GB/s %copy | max diff vs the reference")
    for r in results["ragged_decode"]:
        by = " ".join(f"{r['triton_us_by_kv_tile'][t]:7.1f}" for t in tiles)
        print(
            f"  {r['shape']:7s} {r['batch']:5d} {r['contexts'][0]:5d}-{r['contexts'][1]:<5d} |        {by} | "
            f"{r['triton_us']:7.1f} {r['triton_GBps']:5.0f} {100 * r['triton_fraction_of_copy']:5.1f} "
            f"| {r['max_abs_diff_vs_reference']:.1e}"
        )
    print(f"prefill: length | triton {head} | default TFLOP/s | sdpa us TFLOP/s | launched triton sdpa | max diff")
    for r in results["prefill"]:
        by = " ".join(f"{r['triton_us_by_kv_tile'][t]:7.1f}" for t in tiles)
        print(
            f"  {r['length']:6d} |        {by} | {r['triton_us']:7.1f} {r['triton_TFLOPs']:7.1f} | {r['sdpa_us']:7.1f} "
            f"{r['sdpa_TFLOPs']:7.1f} | {r['triton_launched_us']:15.1f} {r['sdpa_launched_us']:5.1f} "
            f"| {r['max_abs_diff_vs_sdpa']:.1e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; on the CPU under the Triton interpreter")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/attention-<time>.json)")
    parser.add_argument("--prefill-sweep", action="store_true", help="only the prefill sweep (what bench/gpu.sh runs)")
    parser.add_argument("--sweep-mode", choices=("staged", "grid"), default="staged", help="staged: 12 configs a shape; grid: 48")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds after which the sweep starts no config")
    args = parser.parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.dry_run:
        print("bench/attention.py: no CUDA device; nothing to time (use --dry-run to exercise the code on the CPU)")
        return 0
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
    sys.path.insert(0, str(ROOT / "src"))
    import triton

    device = "cuda" if has_cuda else "cpu"
    cfg = DRY if args.dry_run else FULL
    sweep = SWEEP_DRY if args.dry_run else SWEEP_FULL
    torch.manual_seed(0)
    results = {} if args.prefill_sweep else run(cfg, device)
    results["prefill_sweep"] = prefill_sweep(sweep, device, args.sweep_mode, args.time_limit)
    record = dict(
        benchmark="attention", dry_run=args.dry_run, config=cfg, sweep_config=sweep,
        device=torch.cuda.get_device_name() if has_cuda else f"cpu ({platform.processor() or platform.machine()})",
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"), results=results,
    )  # fmt: skip
    out = args.out or ROOT / "bench" / "results" / f"attention-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if not args.prefill_sweep:
        print_table(results)
    print_sweep(results["prefill_sweep"])
    write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
