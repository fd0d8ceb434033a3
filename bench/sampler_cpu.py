"""Benchmark: random sampling on the CPU, ``exponential_`` against ``-log(U)``.

What it measures: ``random_sample`` (the exponential race ``argmax(p / q)``) on ``R x V``
probabilities, as it was (``q = exponential_()``, copied below as ``old_random_sample``)
and as it is now on the CPU (``q = -log(U)``, ``sample/sampler.py`` NOTE 2), with and
without seeded rows; and the whole ``Sampler`` call (temperature 0.6, no top-k/top-p)
with each of the two. Default shape: R = 32, V = 16384, the decode step of the project's
CPU workload.

How: for each thread count (``torch.set_num_threads``: 1, then 2), ``--repeats`` rounds;
each round times every case once, in an order that alternates between rounds, so a slow
spell of the machine hits old and new alike. The figure per case is the median; the
ratio old/new is taken between medians of the same run.

Run: ``python3 bench/sampler_cpu.py`` (about 20 s) writes ``bench/results/sampler_cpu.json``;
``--quick`` runs a few small rounds (the test suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, machine_info, versions, write_json  # noqa: E402  (it puts src/ on the path)
from tinyvllm.sample import sampler as sampler_module  # noqa: E402
from tinyvllm.sample.logits_processors import LogitsProcessors  # noqa: E402
from tinyvllm.sample.metadata import SamplingMetadata  # noqa: E402
from tinyvllm.sample.ops.random_sample import random_sample  # noqa: E402
from tinyvllm.sample.sampler import Sampler  # noqa: E402


def old_random_sample(probs: torch.Tensor, draw_keys: Mapping[int, int]) -> torch.Tensor:
    """The sampler's draw before this change, on every device: ``q = exponential_()`` (keyed
    rows from a generator seeded with their key, as ``random_sample`` draws them now)."""
    q = torch.empty_like(probs).exponential_()  # [R, V]
    keyed = torch.Generator()
    for row, key in draw_keys.items():
        q[row].exponential_(generator=keyed.manual_seed(key))
    return probs.div(q).argmax(dim=-1)


def metadata(num_reqs: int, seeds: dict[int, int]) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_reqs,), 0.6),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        seeds=seeds,
        logitsprocs=LogitsProcessors(),
        thinking_budget=None,
        output_token_ids=tuple([] for _ in range(num_reqs)),
    )


def cases(num_reqs: int, vocab: int) -> dict[str, callable]:
    logits = torch.randn(num_reqs, vocab, generator=torch.Generator().manual_seed(0)) * 3  # [R, V]
    probs = logits.softmax(dim=-1)
    seeded = {row: row for row in range(0, num_reqs, 8)}  # 1 row in 8, keyed by its row
    sampler, md_plain, md_seeded = Sampler(), metadata(num_reqs, {}), metadata(num_reqs, seeded)

    def whole_sampler(draw, md):
        def run():
            with mock.patch.object(sampler_module, "random_sample", draw):
                return sampler(logits, md)

        return run

    return {
        "random_sample/old": lambda: old_random_sample(probs, {}),
        "random_sample/new": lambda: random_sample(probs, {}),
        "random_sample_seeded/old": lambda: old_random_sample(probs, seeded),
        "random_sample_seeded/new": lambda: random_sample(probs, seeded),
        "sampler/old": whole_sampler(old_random_sample, md_plain),
        "sampler/new": whole_sampler(random_sample, md_plain),
        "sampler_seeded/old": whole_sampler(old_random_sample, md_seeded),
        "sampler_seeded/new": whole_sampler(random_sample, md_seeded),
    }


def measure(fns: dict[str, callable], repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each case, rounds interleaved, order alternating."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-reqs", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 3 rounds: checks the script runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sampler_cpu.json")
    args = parser.parse_args()
    if args.quick:
        args.num_reqs, args.vocab, args.repeats = 4, 256, 3
    fns = cases(args.num_reqs, args.vocab)
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        medians = measure(fns, args.repeats, warmup=0 if args.quick else 3)
        ratios = {}
        for name in medians:
            if name.endswith("/old"):
                case = name[: -len("/old")]
                ratios[f"{case}_old_over_new"] = medians[name] / medians[f"{case}/new"]
        results[str(threads)] = {"median_ms": {k: v * 1e3 for k, v in medians.items()}, "ratios": ratios}
        print(f"threads={threads}")
        for name, value in medians.items():
            print(f"  {name:28s} {value * 1e3:8.3f} ms")
        for name, value in ratios.items():
            print(f"  {name:36s} {value:6.2f}x")
    record = {
        "benchmark": "sampler_cpu",
        "quick": args.quick,
        "num_reqs": args.num_reqs,
        "vocab": args.vocab,
        "repeats": args.repeats,
        "machine": machine_info(),
        "versions": versions(),
        "results_by_threads": results,
    }
    write_json(args.out, record)


if __name__ == "__main__":
    main()
