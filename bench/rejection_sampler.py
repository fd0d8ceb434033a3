"""Benchmark: the verification step's random path, before and after keying draws by position.

What it measures: the random path of a speculative step on random-sampling requests, each
verifying k = 3 n-gram drafts: before (the implementation of commit aa210d2, copied below
as ``old_rejection_sample``: one uniform per draft compared at once with ``p(draft)``, then
one batched race for each request's replacement or bonus token) and now (every row of every
request draws its token by the race, keyed by its position for seeded requests, and
``rejection_sample`` walks the rows on the host: ``sample/rejection_sampler.py`` NOTE 2).
"Now" draws over the vocabulary k + 1 times a request where "old" drew once: this is the
price of a seeded stream that does not depend on how many drafts a step verified.

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

from tinyvllm.arith import spec_row_starts
from tinyvllm.sample.draw_keys import draw_key
from tinyvllm.sample.rejection_sampler import rejection_sample
from tinyvllm.sample.ops.random_sample import random_sample, rows_without_a_token

CASES = [(1, 32768), (16, 32768), (64, 32768), (1, 151936), (16, 151936), (64, 151936)]
QUICK_CASES = [(1, 512), (4, 512)]
K = 3


def old_rejection_sample(
    probs: torch.Tensor,
    argmax: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    is_greedy: Sequence[bool],
    generators: Mapping[int, torch.Generator],
) -> list[list[int]]:
    """Commit aa210d2's rejection sampler: a uniform per draft, then one race for the tokens drawn."""
    firsts = spec_row_starts(draft_token_ids)
    spans = [(r, firsts[r], len(d)) for r, d in enumerate(draft_token_ids) if d and not is_greedy[r]]
    rows = [first + j for _, first, k in spans for j in range(k)]
    drafts = [t for r, _, _ in spans for t in draft_token_ids[r]]
    u = torch.rand(len(rows))
    at = 0
    for r, _, k in spans:
        if r in generators:
            u[at : at + k] = torch.rand(k, generator=generators[r])
        at += k
    passed = (u < probs[torch.tensor(rows, dtype=torch.int64), torch.tensor(drafts, dtype=torch.int64)]).tolist()
    kept_draft = dict(zip(rows, passed))
    argmax_ids = argmax.tolist()
    tokens: list[list[int]] = []
    draws: list[tuple[int, int, int | None]] = []
    for r, drafts_r in enumerate(draft_token_ids):
        kept: list[int] = []
        for j, draft in enumerate(drafts_r):
            row = firsts[r] + j
            if is_greedy[r]:
                if argmax_ids[row] != draft:
                    kept.append(argmax_ids[row])
                    break
            elif not kept_draft[row]:
                draws.append((r, row, draft))
                break
            kept.append(draft)
        else:
            bonus = firsts[r] + len(drafts_r)
            if is_greedy[r]:
                kept.append(argmax_ids[bonus])
            else:
                draws.append((r, bonus, None))
        tokens.append(kept)
    if draws:
        dist = probs[torch.tensor([row for _, row, _ in draws], dtype=torch.int64)]
        for i, (_, _, draft) in enumerate(draws):
            if draft is not None:
                dist[i, draft] = 0.0
        q = torch.empty_like(dist).uniform_(torch.finfo(torch.float32).tiny, 1.0)
        for i, (r, _, _) in enumerate(draws):
            if r in generators:
                q[i].uniform_(torch.finfo(torch.float32).tiny, 1.0, generator=generators[r])
        for (r, _, _), token in zip(draws, dist.div(q.log_().neg_()).argmax(dim=-1).tolist()):
            tokens[r].append(token)
    return tokens


def new_rejection_sample(
    probs: torch.Tensor, draft_token_ids: Sequence[Sequence[int]], seeds: Mapping[int, int]
) -> list[list[int]]:
    """Now: every row draws (keyed by position for the seeded requests), then the host walk."""
    firsts = spec_row_starts(draft_token_ids)
    keys = {firsts[r] + j: draw_key(seed, j) for r, seed in seeds.items() for j in range(len(draft_token_ids[r]) + 1)}
    tokens, no_token = random_sample(probs, keys), rows_without_a_token(probs)  # [N], [N]
    host = torch.cat([tokens, no_token.to(tokens.dtype)]).tolist()  # one transfer, as the sampler's
    return rejection_sample(host[: len(tokens)], host[len(tokens) :], draft_token_ids)


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

    def old(rnd: int):
        gens = {r: torch.Generator().manual_seed(1000 * rnd + r) for r in range(0, num_reqs, 2)}
        return lambda: old_rejection_sample(probs, argmax, drafts, greedy, gens)

    def new(rnd: int):
        seeds = {r: 1000 * rnd + r for r in range(0, num_reqs, 2)}
        return lambda: new_rejection_sample(probs, drafts, seeds)

    ways = {"old": old, "new": new}
    per_round: dict[str, list[float]] = {name: [] for name in ways}
    kept: dict[str, int] = {name: 0 for name in ways}
    for rnd in range(repeats):
        for name in (list(ways) if rnd % 2 == 0 else list(reversed(ways))):
            call = ways[name](rnd)
            call()  # warm-up
            begin = time.perf_counter()
            for _ in range(steps):
                out = call()
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
