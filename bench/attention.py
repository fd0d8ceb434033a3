"""Benchmark: the unified Triton paged-attention kernel against torch SDPA on contiguous K/V.

What it measures: decode (batches 1-256 at contexts 512-8192, one query token per
request) and prefill (one request of 128-4096 tokens), for the Triton kernel reading a paged
cache through a shuffled block table, and for ``torch.nn.functional.scaled_dot_product_attention``
on the same math with contiguous K/V (the best a user gets without paging). For decode it
reports the achieved bandwidth (K and V bytes read / time) next to the device's measured
copy bandwidth. Every timing goes to a JSON file in ``bench/results/`` with the device and
versions.

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
    prefill_lengths=[128, 512, 1024, 2048, 4096], copy_bytes=1 << 30, iters=20, warmup=5,
)  # fmt: skip
DRY = dict(
    num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype="float32",
    decode_batches=[1, 2], decode_contexts=[20, 520], prefill_lengths=[16, 24],
    copy_bytes=1 << 20, iters=1, warmup=0,
)  # fmt: skip


def timer(fn, device: str, iters: int, warmup: int) -> float:
    """Median seconds per call: CUDA events on a GPU, wall clock otherwise."""
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


def copy_bandwidth(device: str, num_bytes: int, iters: int, warmup: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timer(lambda: dst.copy_(src), device, iters, warmup)


def make_batch(query_lens, seq_lens, cfg, device):
    """A paged batch with shuffled block ids, and the same K/V laid out contiguously."""
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
    # Contiguous copies for SDPA (all requests share one length in this benchmark).
    length = seq_lens[0]
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


def run(cfg: dict, device: str) -> dict:
    from tinyvllm.attention import triton_attention

    h, d = cfg["num_heads"], cfg["head_size"]
    scale = d**-0.5
    elt = torch.finfo(getattr(torch, cfg["dtype"])).bits // 8
    bw_copy = copy_bandwidth(device, cfg["copy_bytes"], cfg["iters"], cfg["warmup"])
    results = {"copy_bandwidth_GBps": bw_copy / 1e9, "decode": [], "prefill": []}
    timing = dict(device=device, iters=cfg["iters"], warmup=cfg["warmup"])

    for batch in cfg["decode_batches"]:
        for context in cfg["decode_contexts"]:
            paged, (k, v) = make_batch([1] * batch, [context] * batch, cfg, device)
            query = paged[0]
            q4 = query.view(batch, 1, h, d).transpose(1, 2)  # [R, H, 1, D]
            segments = triton_attention.choose_num_segments(batch, batch, cfg["num_kv_heads"], paged[5].shape[1] * cfg["block_size"])
            out = triton_attention.paged_attention(*paged, scale)
            ref = sdpa(q4, k, v, causal=False).transpose(1, 2).reshape_as(out)
            t_tri = timer(lambda: triton_attention.paged_attention(*paged, scale, out=out), **timing)
            t_sdpa = timer(lambda: sdpa(q4, k, v, causal=False), **timing)
            kv_bytes = 2 * batch * context * cfg["num_kv_heads"] * d * elt
            results["decode"].append(dict(
                batch=batch, context=context, num_segments=segments,
                triton_us=t_tri * 1e6, sdpa_us=t_sdpa * 1e6,
                triton_GBps=kv_bytes / t_tri / 1e9, sdpa_GBps=kv_bytes / t_sdpa / 1e9,
                triton_fraction_of_copy=kv_bytes / t_tri / bw_copy,
                max_abs_diff_vs_sdpa=(out.float() - ref.float()).abs().max().item(),
            ))  # fmt: skip
            del paged, k, v

    for length in cfg["prefill_lengths"]:
        paged, (k, v) = make_batch([length], [length], cfg, device)
        query = paged[0]
        q4 = query.view(1, length, h, d).transpose(1, 2)  # [1, H, L, D]
        out = triton_attention.paged_attention(*paged, scale)
        ref = sdpa(q4, k, v, causal=True).transpose(1, 2).reshape_as(out)
        t_tri = timer(lambda: triton_attention.paged_attention(*paged, scale, out=out), **timing)
        t_sdpa = timer(lambda: sdpa(q4, k, v, causal=True), **timing)
        flops = 2 * 2 * h * d * length * (length + 1) / 2  # QK^T and PV over the causal half
        results["prefill"].append(dict(
            length=length, triton_us=t_tri * 1e6, sdpa_us=t_sdpa * 1e6,
            triton_TFLOPs=flops / t_tri / 1e12, sdpa_TFLOPs=flops / t_sdpa / 1e12,
            max_abs_diff_vs_sdpa=(out.float() - ref.float()).abs().max().item(),
        ))  # fmt: skip
        del paged, k, v
    return results


def print_table(results: dict) -> None:
    print(f"copy bandwidth: {results['copy_bandwidth_GBps']:.0f} GB/s")
    print("decode: batch context segs | triton us  GB/s  %copy | sdpa us  GB/s | max diff")
    for r in results["decode"]:
        print(
            f"  {r['batch']:5d} {r['context']:7d} {r['num_segments']:4d} | {r['triton_us']:9.1f} "
            f"{r['triton_GBps']:5.0f} {100 * r['triton_fraction_of_copy']:5.1f} | {r['sdpa_us']:8.1f} "
            f"{r['sdpa_GBps']:5.0f} | {r['max_abs_diff_vs_sdpa']:.1e}"
        )
    print("prefill: length | triton us TFLOP/s | sdpa us TFLOP/s | max diff")
    for r in results["prefill"]:
        print(
            f"  {r['length']:6d} | {r['triton_us']:9.1f} {r['triton_TFLOPs']:6.1f} | {r['sdpa_us']:8.1f} "
            f"{r['sdpa_TFLOPs']:6.1f} | {r['max_abs_diff_vs_sdpa']:.1e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; on the CPU under the Triton interpreter")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/attention-<time>.json)")
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
    torch.manual_seed(0)
    results = run(cfg, device)
    record = dict(
        benchmark="attention", dry_run=args.dry_run, config=cfg,
        device=torch.cuda.get_device_name() if has_cuda else f"cpu ({platform.processor() or platform.machine()})",
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%S"), results=results,
    )  # fmt: skip
    out = args.out or ROOT / "bench" / "results" / f"attention-{time.strftime('%Y%m%d-%H%M%S')}.json"
    print_table(results)
    write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
