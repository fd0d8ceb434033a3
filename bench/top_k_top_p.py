"""Benchmark: top-k and top-p, one sort of every row against rows split by the plan.

What it measures: ``apply_top_k_top_p`` (``sample/top_k_top_p.py``) on a random step's
logits ``[R, V]``, before (one descending sort of every row as soon as any row uses top-k
or top-p: the implementation of commit 025881e, copied below as ``old_apply_top_k_top_p``)
and now (``topk`` for the rows with top-k, their top-p among those; a sort only for the
rows with top-p alone; nothing for the others).

Workloads, R = 32 rows, vocabularies of 6,144 (the shipped model), 32,768 and 151,936
(Qwen's):
- ``qwen3_defaults``: every row top_k = 20, top_p = 0.95, the values Qwen3's
  ``generation_config.json`` sets, which ``LLM`` applies by default;
- ``mixed``: a quarter of the rows top_p = 0.9, a quarter top_k = 50, the rest neither;
- ``top_p_only``: every row top_p = 0.9 (both sort every row: no gain expected).

How: one torch thread and then two (``torch.set_num_threads``), ``--repeats`` rounds, old
and new alternating (their order reversed every other round), each timing ``--steps``
calls; the figure is the median round's milliseconds per call, the ratio old / new of the
medians of the same run. ``tests/test_top_k_top_p.py`` checks that both mask the same tokens.

Run: ``python3 bench/top_k_top_p.py`` (about two minutes) writes
``bench/results/top_k_top_p.json``; ``--quick`` runs one small case (the test suite runs
it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from harness import ROOT, run_header, set_threads, write_json

from tinyvllm.sample.top_k_top_p import apply_top_k_top_p, plan_top_k_top_p

VOCABS = [6144, 32768, 151936]
QUICK_VOCABS = [512]
ROWS = 32


def old_apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Commit 025881e's ``apply_top_k_top_p``: one sort of every row."""
    if top_k is None and top_p is None:
        return logits.clone()
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)  # [R, V]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)  # [R, 1]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)  # [R, V]
        mass_before = probs.cumsum(dim=-1) - probs
        outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)  # [R, V]
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def workload(name: str) -> tuple[list[int], list[float]]:
    """Each row's top_k (0 = off) and top_p (1 = off)."""
    if name == "qwen3_defaults":
        return [20] * ROWS, [0.95] * ROWS
    if name == "mixed":
        quarter = ROWS // 4
        return [0] * quarter + [50] * quarter + [0] * (ROWS - 2 * quarter), [0.9] * quarter + [1.0] * (ROWS - quarter)
    return [0] * ROWS, [0.9] * ROWS


def run_case(name: str, vocab: int, steps: int, repeats: int) -> dict:
    logits = 4 * torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(vocab))  # peaked, like a model's
    ks, ps = workload(name)
    top_k, top_p = torch.tensor(ks), torch.tensor(ps)
    plan = plan_top_k_top_p(ks, ps)
    ways = {
        "old": lambda: old_apply_top_k_top_p(logits, top_k, top_p),
        "new": lambda: apply_top_k_top_p(logits, top_k, top_p, plan),
    }
    assert torch.equal(torch.isinf(ways["old"]()), torch.isinf(ways["new"]())), "the two masks differ"
    per_round: dict[str, list[float]] = {way: [] for way in ways}
    for rnd in range(repeats):
        for way in list(ways) if rnd % 2 == 0 else list(reversed(ways)):
            ways[way]()  # warm-up
            begin = time.perf_counter()
            for _ in range(steps):
                ways[way]()
            per_round[way].append((time.perf_counter() - begin) / steps * 1e3)
    medians = {way: statistics.median(v) for way, v in per_round.items()}
    return {
        "workload": name,
        "rows": ROWS,
        "vocab": vocab,
        "ms_per_call": medians,
        "rounds_ms_per_call": per_round,
        "old_over_new": medians["old"] / medians["new"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one vocabulary of 512, 2 steps, 2 rounds")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "top_k_top_p.json")
    args = parser.parse_args(argv)
    vocabs, steps, repeats = (QUICK_VOCABS, 2, 2) if args.quick else (VOCABS, args.steps, args.repeats)
    by_threads = {}
    for threads in (1, 2):
        got = set_threads(threads)
        results = []
        for name in ("qwen3_defaults", "mixed", "top_p_only"):
            for vocab in vocabs:
                result = run_case(name, vocab, steps, repeats)
                results.append(result)
                ms = result["ms_per_call"]
                print(f"threads {got} {name:15s} V={vocab:6d}: old {ms['old']:8.3f} ms, new {ms['new']:8.3f} ms: "
                      f"x{result['old_over_new']:.2f}")  # fmt: skip
        by_threads[str(got)] = results
    record = {**run_header("top_k_top_p.py", argv), "quick": args.quick, "cases_by_threads": by_threads}
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
