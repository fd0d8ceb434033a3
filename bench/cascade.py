"""Benchmark (CPU): cascade attention end to end, a shared prefix attended once or per request.

What it measures: whole engine runs with prefix caching on, where every request shares a
cached prompt prefix, with the torch backend's split on (``attention/torch_sdpa.py``
NOTE 7: a decode group attends to the shared prefix once, then each request to its own
keys) against off (``CASCADE_MIN_SAVED_KEYS`` set to infinity: one group over every
request's whole context). Two workloads on the 33.6M-parameter CPU model of
``harness.py``, temperature 0.6, ``ignore_eos``, all requests at once:

- ``decode_heavy``: 32 requests sharing a 512-token prefix, 16 tokens of their own, 64
  outputs each: a shared system prompt, then generation. Most of the run is decode steps
  of 32 requests over about 560 keys.
- ``prefix_caching_hit_49``: the ``hit_49`` case of ``prefix_caching.py`` (32 requests,
  256 shared + 248 own tokens, 8 outputs): most of the run is prefill, so attention to the
  prefix in decode is a small part of it.

How: two engines with caching on, built alike; the bound is set before each run. Each
engine warms up on a full-size run. Then ``--repeats`` rounds (5), in each of which both
engines run the same new prompts (each engine has its own cache, so neither hits the
other's blocks), in alternating order. The figure is the ratio of the median seconds,
one group / cascade (above 1: the split is faster), at ``torch.set_num_threads`` 1 and 2.
``split_decode_groups`` counts, per engine, the decode groups of the timed runs that
attended a shared prefix once (layers times steps times groups): 0 for one group.

Run: ``python bench/cascade.py`` (about six minutes) writes ``bench/results/cascade.json``;
``--dry-run`` runs a tiny model in seconds (the test suite runs it; its timings mean
nothing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, build_cpu_model, median, run_header, set_threads, write_json  # noqa: E402
from prefix_caching import make_prompts, run_engine  # noqa: E402

from tinyvllm import LLM  # noqa: E402
from tinyvllm.attention import torch_sdpa  # noqa: E402

WORKLOADS = {
    "full": {
        "decode_heavy": dict(num_seqs=32, shared=512, unique=16, output=64),
        "prefix_caching_hit_49": dict(num_seqs=32, shared=256, unique=248, output=8),
    },
    "dry": {"decode_heavy": dict(num_seqs=6, shared=32, unique=4, output=6)},
}
BOUNDS = {"cascade": 0, "one_group": float("inf")}  # CASCADE_MIN_SAVED_KEYS of each engine


def count_calls(module, name: str, counter: list[int]) -> None:
    """Count the calls of ``module.name`` in ``counter[0]`` (the split's decode groups)."""
    fn = getattr(module, name)

    def counted(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)

    setattr(module, name, counted)


def bench_workload(engines: dict, case: dict, vocab: int, repeats: int, seed: int, ids, calls: list[int]) -> dict:
    """Median seconds of each engine over ``repeats`` rounds of the same new prompts, and
    how many decode groups of each engine's timed runs attended a shared prefix once."""
    saved = torch_sdpa.CASCADE_MIN_SAVED_KEYS
    split_groups = dict.fromkeys(engines, 0)

    def run(name: str, prompts: list[list[int]], run_seed: int, timed: bool = True) -> float:
        torch_sdpa.CASCADE_MIN_SAVED_KEYS = BOUNDS[name]
        before = calls[0]
        try:
            return run_engine(engines[name], prompts, case["output"], 0.0, run_seed, ids)["seconds"]
        finally:
            torch_sdpa.CASCADE_MIN_SAVED_KEYS = saved
            split_groups[name] += (calls[0] - before) if timed else 0

    shape = (case["num_seqs"], case["shared"], case["unique"], vocab)
    for name in engines:  # warm-up at full size, on prompts of its own
        run(name, make_prompts(*shape, seed=seed - 1), seed - 1, timed=False)
    seconds = {name: [] for name in engines}
    for r in range(repeats):
        prompts = make_prompts(*shape, seed=seed + r)
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            seconds[name].append(run(name, prompts, seed + r))
    medians = {name: median(s) for name, s in seconds.items()}
    return {
        **case, "seconds": seconds, "median_s": medians, "split_decode_groups": split_groups,
        "ratio_one_group_over_cascade": medians["one_group"] / medians["cascade"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model and workload, seconds")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per workload (default 5; dry run 1)")
    parser.add_argument("--threads", default=None, help="torch thread counts, comma-separated (default 1,2; dry run 1)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/cascade.json)")
    args = parser.parse_args(argv)
    mode = "dry" if args.dry_run else "full"
    repeats = args.repeats or (1 if args.dry_run else 5)
    threads = [int(t) for t in (args.threads or ("1" if args.dry_run else "1,2")).split(",")]
    workloads = WORKLOADS[mode]
    ids = itertools.count()
    results, calls = {}, [0]
    count_calls(torch_sdpa, "cascade_decode", calls)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_cpu_model(Path(tmp) / "model", dry_run=args.dry_run)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        longest = max(c["shared"] + c["unique"] + c["output"] for c in workloads.values())
        common = dict(device="cpu", block_size=16, max_model_len=-(-longest // 256) * 256, seed=0,
                      max_num_batched_tokens=2048, enable_prefix_caching=True, attention_backend="torch")  # fmt: skip
        engines = {name: LLM(str(folder), **common) for name in BOUNDS}
        for i, n in enumerate(threads):
            actual = set_threads(n)
            results[str(n)] = {"torch_threads": actual, "workloads": {
                name: bench_workload(engines, case, vocab, repeats, 1000 * (i + 1) + 100 * j, ids, calls)
                for j, (name, case) in enumerate(workloads.items())
            }}  # fmt: skip
            for name, w in results[str(n)]["workloads"].items():
                med = w["median_s"]
                print(f"threads={n} {name}: one group / cascade = {w['ratio_one_group_over_cascade']:.2f}x "
                      f"(cascade {med['cascade']:.2f} s, one group {med['one_group']:.2f} s)")  # fmt: skip
    record = {
        "benchmark": "cascade",
        "dry_run": args.dry_run,
        **run_header("cascade.py", argv),
        "engine": {**common, "cascade_min_saved_keys": {k: str(v) for k, v in BOUNDS.items()}},
        "workloads": workloads,
        "repeats": repeats,
        "threads": results,
    }
    out = args.out or ROOT / "bench" / "results" / ("cascade-dry.json" if args.dry_run else "cascade.json")
    write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
