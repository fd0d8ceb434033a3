"""Benchmark: the n-gram proposer's search per decoding request per step, one at a time against the batch.

What it measures: the CPU time ``LLMEngine`` spends on drafts in one decode step of a
speculative-decoding run, for R decoding requests of n tokens each, two ways:

- ``one_by_one``: ``find_ngram_drafts`` (Knuth-Morris-Pratt in Python) on each request's
  token list, what the engine did before ``spec_decode/ngram_proposer.py`` NOTE 2;
- ``batch``: ``NgramProposer.propose_batch``, what the engine does now: the
  ``TokenTable`` sync (each request's new tokens copied into its row) and the numpy search
  over every row together.

Workload: real text, as the proposer meets it in use: the Python sources of a few
standard-library modules, tokenized by the shipped model's tokenizer (``stdlib_tiny``), cut
into R windows of n tokens at seeded random offsets, and one mixed batch (one request of
16,384 tokens among 255 of 512: a padded ``[R, W]`` search would pay for 256 long rows);
``num_speculative_tokens`` 3,
``prompt_lookup_min`` 2, ``prompt_lookup_max`` 5 (vLLM's defaults when both are unset are
5 and 5; the spread makes the search longer, not shorter). Each timed step first appends
one token to every request (the token the step before kept), so the batch pays for its
table update as it does in an engine; the first step, which fills the table, is not timed.

How: for each (R, n) the two ways run ``--steps`` steps each, interleaved over
``--repeats`` rounds (their order alternating); the figure is the median round's
microseconds per request per step, and the ratio one_by_one / batch is taken between the
medians of the same run. Both ways return the same drafts (checked every step).
``torch`` is not involved; numpy's own threads do not apply to these calls.

Run: ``python3 bench/ngram_proposer.py`` (about half a minute) writes
``bench/results/ngram_proposer.json``; ``--quick`` runs two small cases, one of them
mixed (the test suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from harness import ROOT, run_header, write_json

CASES = [[128], [2048], [512] * 8, [1024] * 32, [512] * 64, [1024] * 256, [2048] * 256, [16384] + [512] * 255]
QUICK_CASES = [[64], [128] * 3 + [256]]
MODULES = ("json/decoder.py", "json/encoder.py", "inspect.py", "email/message.py", "http/server.py", "argparse.py")


def stdlib_token_ids() -> list[int]:
    """The sources of ``MODULES``, tokenized by the shipped model's tokenizer."""
    import sysconfig

    from transformers import AutoTokenizer

    from tinyvllm.stdlib_tiny import STDLIB_TINY

    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((lib / name).read_text() for name in MODULES)
    return AutoTokenizer.from_pretrained(STDLIB_TINY).encode(text)


class Seq:
    """A decoding request as the proposer reads it: a token list that only grows."""

    def __init__(self, tokens: list[int]) -> None:
        self.all_token_ids = tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


def run_case(ids: list[int], lengths: list[int], steps: int, repeats: int, seed: int) -> dict:
    from tinyvllm.spec_decode.ngram_proposer import NgramProposer, find_ngram_drafts

    rng = random.Random(seed)
    k, min_n, max_n = 3, 2, 5
    num_reqs, longest = len(lengths), max(lengths)
    starts = [rng.randrange(len(ids) - n - steps - repeats - 2) for n in lengths]

    def fresh(start_offset: int) -> list[Seq]:
        return [Seq(ids[s + start_offset : s + start_offset + n]) for s, n in zip(starts, lengths)]

    def one_by_one(seqs: list[Seq], proposer: NgramProposer) -> list[list[int]]:
        return [find_ngram_drafts(seq.all_token_ids, min_n, max_n, k) for seq in seqs]

    def batch(seqs: list[Seq], proposer: NgramProposer) -> list[list[int]]:
        return proposer.propose_batch(seqs)

    ways = {"one_by_one": one_by_one, "batch": batch}
    per_round: dict[str, list[float]] = {name: [] for name in ways}
    for rnd in range(repeats):
        order = list(ways) if rnd % 2 == 0 else list(reversed(ways))
        for name in order:
            seqs = fresh(rnd)
            proposer = NgramProposer(k, min_n, max_n, max_model_len=longest + steps + 8)
            ways[name](seqs, proposer)  # the first step fills the table: not timed
            elapsed = 0.0
            for step in range(steps):
                for seq, s, n in zip(seqs, starts, lengths):
                    seq.all_token_ids.append(ids[s + rnd + n + step])
                begin = time.perf_counter()
                drafts = ways[name](seqs, proposer)
                elapsed += time.perf_counter() - begin
                assert drafts == [find_ngram_drafts(q.all_token_ids, min_n, max_n, k) for q in seqs]
            per_round[name].append(elapsed / steps / num_reqs * 1e6)
    medians = {name: statistics.median(values) for name, values in per_round.items()}
    return {
        "num_reqs": num_reqs,
        "tokens_per_request": sorted(set(lengths), reverse=True) if len(set(lengths)) > 1 else lengths[0],
        "us_per_request_step": medians,
        "rounds_us_per_request_step": per_round,
        "one_by_one_over_batch": medians["one_by_one"] / medians["batch"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="two small cases, 3 steps, 2 rounds")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ngram_proposer.json")
    args = parser.parse_args(argv)
    cases, steps, repeats = (QUICK_CASES, 3, 2) if args.quick else (CASES, args.steps, args.repeats)
    ids = stdlib_token_ids()
    results = []
    for lengths in cases:
        result = run_case(ids, lengths, steps, repeats, args.seed)
        results.append(result)
        times = result["us_per_request_step"]
        print(
            f"R={len(lengths):4d} n={result['tokens_per_request']}: one by one {times['one_by_one']:7.2f} us, "
            f"batch {times['batch']:7.2f} us per request per step: x{result['one_by_one_over_batch']:.2f}"
        )
    record = {
        **run_header("ngram_proposer.py", argv),
        "quick": args.quick,
        "workload": {"modules": list(MODULES), "tokens": len(ids), "num_speculative_tokens": 3,
                     "prompt_lookup_min": 2, "prompt_lookup_max": 5, "steps": steps, "repeats": repeats},
        "cases": results,
    }  # fmt: skip
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()
