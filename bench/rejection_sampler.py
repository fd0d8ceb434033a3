"""Benchmark: the rejection sampler's random path per request per step, before and after batching it.

What it measures: ``rejection_sample`` (``sample/rejection_sampler.py``) on random-sampling
requests, each verifying k = 3 n-gram drafts, as one speculative step hands it: before
(the implementation of commit fa5d4c8, copied below as ``old_rejection_sample``: one
``torch.rand``, one indexed read and one compare per draft, and on a rejection a ``clone``
of the row and a ``multinomial`` over the vocabulary) and now (every draft's uniform
compared at once, and one batched race for every request's one drawn token, NOTE 3 and
NOTE 4 of the module).

Workload: R requests (1, 16, 64), vocabularies of 32,768 and 151,936 (Qwen's), target rows
softmax(4 * N(0, 1)) (peaked, like a model's), drafts drawn from the rows themselves, so
some are kept and some rejected as in use; every other request seeded.

How: ``--repeats`` rounds, old and new alternating (their order reversed every other
round), each timing ``--steps`` calls; the figure is the median round's milliseconds per
step and the ratio old / new of medians from the same run. One torch thread. Both
implementations draw from the same distributions (``tests/test_rejection_sampler.py``
checks the new one by counting), not the same random streams.

Run: ``python3 bench/rejection_sampler.py`` (about a minute) writes
``bench/results/rejection_sampler.json``; ``--quick`` runs two small cases (the test
suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from harness import ROOT, run_header, set_threads, write_json

from tinyvllm.sample.rejection_sampler import rejection_sample
from tinyvllm.sample.sampler import random_sample

CASES = [(1, 32768), (16, 32768), (64, 32768), (1, 151936), (16, 151936), (64, 151936)]
QUICK_CASES = [(1, 512), (4, 512)]
K = 3


def old_rejection_sample(
    probs: torch.Tensor | None,
    argmax: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    is_greedy: Sequence[bool],
    generators: Mapping[int, torch.Generator],
) -> list[list[int]]:
    """``rejection_sample`` before this benchmark's change (commit fa5d4c8), kept to time it."""
    argmax_ids = argmax.tolist()  # [N]
    tokens: list[list[int]] = []
    bonus_rows: list[tuple[int, int]] = []  # (request, row) of the random requests that keep every draft
    offset = 0
    for r, drafts in enumerate(draft_token_ids):
        generator = generators.get(r)
        kept: list[int] = []
        for j, draft in enumerate(drafts):
            row = offset + j
            if is_greedy[r]:
                if argmax_ids[row] != draft:
                    kept.append(argmax_ids[row])  # the target's own token replaces the draft
                    break
            else:
                u = torch.rand((), generator=generator, device=probs.device)
                if u >= probs[row, draft]:  # kept with probability p(draft) (NOTE 1)
                    rest = probs[row].clone()
                    rest[draft] = 0.0
                    kept.append(int(torch.multinomial(rest, 1, generator=generator)))  # (p - q)+, renormalised
                    break
            kept.append(draft)
        else:  # every draft kept: the bonus row adds one more
            bonus = offset + len(drafts)
            if is_greedy[r]:
                kept.append(argmax_ids[bonus])
            else:
                bonus_rows.append((r, bonus))  # drawn below, all in one batch (NOTE 3)
        tokens.append(kept)
        offset += len(drafts) + 1
    if bonus_rows:
        rows = torch.tensor([row for _, row in bonus_rows], device=probs.device)
        own = {i: generators[r] for i, (r, _) in enumerate(bonus_rows) if r in generators}
        for (r, _), token in zip(bonus_rows, random_sample(probs[rows], own).tolist()):
            tokens[r].append(token)
    return tokens


def make_step(num_reqs: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Target rows (k + 1 per request) and drafts drawn from them."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(4 * torch.randn(num_reqs * (K + 1), vocab, generator=gen), dim=-1)  # [N, V]
    drafts = [
        torch.multinomial(probs[r * (K + 1) : r * (K + 1) + K], 1, generator=gen).squeeze(1).tolist()
        for r in range(num_reqs)
    ]
    return probs, probs.argmax(dim=-1), drafts


def run_case(num_reqs: int, vocab: int, steps: int, repeats: int) -> dict:
    probs, argmax, drafts = make_step(num_reqs, vocab, seed=num_reqs)
    greedy = [False] * num_reqs
    ways = {"old": old_rejection_sample, "new": rejection_sample}
    per_round: dict[str, list[float]] = {name: [] for name in ways}
    kept: dict[str, int] = {name: 0 for name in ways}
    for rnd in range(repeats):
        for name in (list(ways) if rnd % 2 == 0 else list(reversed(ways))):
            gens = {r: torch.Generator().manual_seed(1000 * rnd + r) for r in range(0, num_reqs, 2)}
            ways[name](probs, argmax, drafts, greedy, gens)  # warm-up
            begin = time.perf_counter()
            for _ in range(steps):
                out = ways[name](probs, argmax, drafts, greedy, gens)
            per_round[name].append((time.perf_counter() - begin) / steps * 1e3)
            kept[name] += sum(len(t) for t in out)
    medians = {name: statistics.median(v) for name, v in per_round.items()}
    return {
        "num_reqs": num_reqs,
        "vocab": vocab,
        "ms_per_step": medians,
        "rounds_ms_per_step": per_round,
        "tokens_kept_per_request_step": {name: kept[name] / (repeats * num_reqs) for name in ways},
        "old_over_new": medians["old"] / medians["new"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="two small cases, 2 steps, 2 rounds")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rejection_sampler.json")
    args = parser.parse_args(argv)
    threads = set_threads(1)
    cases, steps, repeats = (QUICK_CASES, 2, 2) if args.quick else (CASES, args.steps, args.repeats)
    results = []
    for num_reqs, vocab in cases:
        result = run_case(num_reqs, vocab, steps, repeats)
        results.append(result)
        ms = result["ms_per_step"]
        print(f"R={num_reqs:3d} V={vocab:6d}: old {ms['old']:8.3f} ms, new {ms['new']:8.3f} ms a step: x{result['old_over_new']:.2f}")
    record = {**run_header("rejection_sampler.py", argv), "quick": args.quick, "threads": threads, "k": K, "cases": results}
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
