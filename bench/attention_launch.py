"""Benchmark (CPU): the host's own work in the Triton attention launcher, per step of 28 layers.

What it measures: the Python cost of ``triton_attention.paged_attention`` with the kernel
itself taken away. The two ``@triton.jit`` kernels are replaced, in this script only (the
library is not touched), by a stand-in whose ``[grid](...)`` does nothing, so what is left
is the launcher's host work: the checks of its arguments, the split and tile choices, the
partial-result buffers, the grid, the strides. Three ways for one step over ``layers``
layers (each with its own cache):

- ``per_layer``: every layer calls ``paged_attention`` without a plan, so each one checks
  and plans for itself (the launcher before the step plan did the same work, per call);
- ``planned``: ``plan_step`` once, then every layer calls it with the plan (what the model
  does now: triton_attention NOTE 4);
- ``baseline`` (with ``--baseline REV``): ``per_layer`` through the module as it was at git
  revision REV (``git show``; e.g. the commit before the step plan).

Not measured here: Triton's own dispatch inside ``kernel[grid](...)`` (binding the
arguments, the specialization key, the compiled kernel's lookup, the driver's launch),
which needs a GPU; ``bench/cudagraphs.py``'s mixed-step case measures the whole step there.

Shapes: the attention of Qwen3-0.6B (16 query heads, 8 KV heads, head size 128, bf16,
block size 16, 28 layers), on CPU tensors (the launcher reads no value, and the kernel does
not run); the cases are a decode of 1 and of 32 requests (the single request's context long
enough to split its keys into segments) and a mixed step of 32 decodes and one 32-token chunk.

How: ``torch.set_num_threads(T)`` for each T (recorded); the ways alternate within each
repeat (order reversed every other repeat), each sample times ``steps`` whole steps, and
the figure is the median sample, in µs per step and per layer, with ``per_layer / planned``.

Run: ``python bench/attention_launch.py`` (about a minute) writes
``bench/results/attention_launch.json``; ``--dry-run`` runs every path on a few layers and
repeats, timings meaningless (the test suite runs it).
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import inspect
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the launcher's device check

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, run_header, set_threads, write_json  # noqa: E402

from tinyvllm.attention import triton_attention  # noqa: E402
from tinyvllm.attention.metadata import AttentionLayout  # noqa: E402

FULL = dict(layers=28, num_heads=16, num_kv_heads=8, head_size=128, block_size=16, dtype="bfloat16",
            cases={"decode_1": ([1], [2048]), "decode_32": ([1] * 32, [300] * 32),
                   "mixed_32_plus_32": ([1] * 32 + [32], [300] * 32 + [32])},
            threads=[1, 2], repeats=15, steps=20)  # fmt: skip
DRY = dict(FULL, layers=3, threads=[1], repeats=2, steps=2,
           cases={"decode_1": ([1], [600]), "mixed_2_plus_5": ([1, 1, 5], [20, 9, 5])})  # fmt: skip


class NoLaunch:
    """A stand-in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` does nothing."""

    calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            NoLaunch.calls += 1

        return launch


def load_module(rev: str, folder: Path):
    """The launcher's module as it was at git revision ``rev`` (its kernels defined afresh)."""
    source = subprocess.run(["git", "show", f"{rev}:src/tinyvllm/attention/triton_attention.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = folder / "baseline_triton_attention.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_triton_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def make_step(cfg: dict, query_lens: list[int], seq_lens: list[int]) -> dict:
    """One step's tensors: the query, every layer's cache, the metadata (values never read)."""
    dtype, s, hkv, d = getattr(torch, cfg["dtype"]), cfg["block_size"], cfg["num_kv_heads"], cfg["head_size"]
    max_blocks = max(-(-n // s) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 1
    caches = [torch.zeros(2, num_blocks, s, hkv, d, dtype=dtype) for _ in range(cfg["layers"])]  # [2, B, S, Hkv, D]
    n = sum(query_lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)  # [R + 1]
    table = torch.arange(len(seq_lens) * max_blocks, dtype=torch.int32).view(len(seq_lens), max_blocks)
    rows = {name: torch.zeros(n, hkv, d, dtype=dtype) for name in ("key", "value")}  # the step's own rows [N, Hkv, D]
    return dict(query=torch.zeros(n, cfg["num_heads"], d, dtype=dtype), caches=caches, query_start_loc=qsl,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table, rows=rows)  # fmt: skip


def ways(cfg: dict, step: dict, baseline=None) -> dict:
    """The step's attention, every layer, each way (the module header)."""
    q, qsl, sl, bt, caches = step["query"], step["query_start_loc"], step["seq_lens"], step["block_table"], step["caches"]
    out = torch.empty_like(q)  # [N, H, D]
    scale = cfg["head_size"] ** -0.5

    def per_layer(module=triton_attention):
        # the step's own key and value rows, as the model passes them, where the launcher takes them
        rows = step["rows"] if "key" in inspect.signature(module.paged_attention).parameters else {}
        for kv in caches:
            module.paged_attention(q, kv[0], kv[1], qsl, sl, bt, scale, out=out, **rows)

    def planned():
        kv = caches[0]
        layout = AttentionLayout(q.shape[1], kv.shape[3], kv.shape[4], kv.shape[2], kv.dtype, kv.device)
        plan = triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout)
        for kv in caches:
            triton_attention.paged_attention(q, kv[0], kv[1], qsl, sl, bt, scale, out=out, plan=plan, **step["rows"])

    found = {"per_layer": per_layer, "planned": planned}
    if baseline is not None:
        found["baseline"] = lambda: per_layer(baseline)
    return found


def measure(cfg: dict, fns: dict) -> dict[str, float]:
    """Median µs per step of each way, alternating them within every repeat."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for repeat in range(cfg["repeats"]):
        order = list(fns) if repeat % 2 == 0 else list(reversed(fns))
        for name in order:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(cfg["steps"]):
                fn()
            samples[name].append((time.perf_counter() - start) / cfg["steps"] * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="a few layers and repeats: every path, timings meaningless")
    parser.add_argument("--baseline", default=None, help="a git revision whose launcher to time per layer too")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/attention_launch.json)")
    args = parser.parse_args(argv)
    cfg = DRY if args.dry_run else FULL
    folder = tempfile.mkdtemp(prefix="attention-launch-")  # the baseline's source: kept until exit (Triton reads it)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    baseline = load_module(args.baseline, Path(folder)) if args.baseline else None
    for module in (triton_attention, baseline):
        if module is not None:  # the kernels never run: only the launcher's host work is timed
            module._paged_attention_kernel = module._merge_segments_kernel = NoLaunch()
    record = dict(benchmark="attention_launch", dry_run=args.dry_run, **run_header("attention_launch.py", argv),
                  config={k: v for k, v in cfg.items() if k != "cases"},
                  cases={k: dict(query_lens=q, seq_lens=s) for k, (q, s) in cfg["cases"].items()},
                  baseline_rev=args.baseline, results_by_threads={})  # fmt: skip
    for threads in cfg["threads"]:
        got = set_threads(threads)
        by_case = {}
        for case, (query_lens, seq_lens) in cfg["cases"].items():
            step = make_step(cfg, query_lens, seq_lens)
            NoLaunch.calls = 0
            fns = ways(cfg, step, baseline)
            for fn in fns.values():
                fn()
            launches_per_step = NoLaunch.calls / len(fns)  # the attention kernel (and the merge, if split)
            us = measure(cfg, fns)
            by_case[case] = dict(
                us_per_step=us, us_per_layer={k: v / cfg["layers"] for k, v in us.items()},
                launches_per_step=launches_per_step, per_layer_over_planned=us["per_layer"] / us["planned"],
            )  # fmt: skip
            if baseline is not None:
                by_case[case]["baseline_over_planned"] = us["baseline"] / us["planned"]
            line = "  ".join(f"{k} {v:8.1f} µs ({v / cfg['layers']:5.1f} a layer)" for k, v in us.items())
            print(f"threads {got}  {case:18s} {line}  per_layer / planned x{us['per_layer'] / us['planned']:.2f}")
        record["results_by_threads"][str(got)] = by_case
    out = args.out or ROOT / "bench" / "results" / ("attention_launch-dry.json" if args.dry_run else "attention_launch.json")
    write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
