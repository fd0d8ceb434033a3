"""Benchmark: the engine's bookkeeping per running request per decode step, on the CPU.

What it measures: everything ``LLMEngine.step()`` does besides the model's forward, the
LM head and the sampler: scheduling, KV-cache allocation, the runner's state and batch
updates, the block table, the step's index arithmetic and input buffers, the sampling
metadata, ``update_from_output``, the engine's output handling. The goal is at most
10 us per running request per step, and a figure that does not grow as requests get
longer (more blocks each).

How: a tiny random Qwen3 (``models/tiny.py``: hidden 64, 2 layers, vocabulary 512) in an
``LLM(device="cpu")``; ``--num-reqs`` requests (prompts of 16-64 tokens, temperature 0.6,
``ignore_eos``, all ``--max-tokens`` long), stepped until all are in decode, then every
step is timed. Hooks time the model's ``forward``, ``compute_logits`` and the sampler
call in each step; bookkeeping = step - those three. Further hooks split the
bookkeeping into scheduling, the runner's ``_update_states``, the rest of
``execute_model``, ``update_from_output`` and the engine's own loop. The figure is the
median over steps of bookkeeping / running requests, over all decode steps and over the
first and the last tenth of them (when requests hold the fewest and the most blocks).

Three cases: ``tiny`` (the real forward), ``stub`` (``--stub-tokens`` long outputs with
the forward replaced by one that returns zeros: no attention cost, so long contexts stay
quick; the bookkeeping runs exactly as with a real model), and ``tiny_wide`` (the real
forward with ``--wide-reqs`` requests, 128). From ``tiny`` and ``tiny_wide`` the script
splits the bookkeeping of a step into a part that grows with the running requests and
one that does not: with ``B(R)`` the median bookkeeping per step at R requests,
``marginal = (B(wide) - B(R)) / (wide - R)`` per request and ``per_step = B(R) - R *
marginal``. At R = 32 the per-step part, divided by R, is a large share of the figure
per request.

Run: ``python3 bench/bookkeeping.py`` (under a minute on a quiet machine) writes
``bench/results/bookkeeping.json``; ``--quick`` runs a few short requests (the test suite
runs it; its timings mean nothing). ``torch.set_num_threads`` is ``--threads`` (1).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine_info, versions  # noqa: E402
from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

BLOCK_SIZE = 16


class StepClock:
    """Seconds spent in each hooked part during the current step."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[name] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        parts, self.parts = dict(self.parts), defaultdict(float)
        return parts


def instrument(llm: LLM, clock: StepClock, stub: bool) -> None:
    """Hook the parts of a step; with ``stub`` the forward returns zeros of the right shape."""
    engine, runner = llm.engine, llm.engine.model_runner
    model = runner.model
    hidden_size = llm.spec.hidden_size
    if stub:

        def forward(input_ids, positions, kv_caches, attn_metadata):
            return torch.zeros(input_ids.shape[0], hidden_size)

        model.forward = clock.wrap("forward", forward)
    else:
        model.forward = clock.wrap("forward", model.forward)
    model.compute_logits = clock.wrap("logits", model.compute_logits)
    runner.sampler = clock.wrap("sample", runner.sampler)
    runner._update_states = clock.wrap("update_states", runner._update_states)
    runner.execute_model = clock.wrap("execute_model", runner.execute_model)
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = clock.wrap("update_from_output", engine.scheduler.update_from_output)


def run_case(folder: Path, num_reqs: int, max_tokens: int, stub: bool, seed: int = 0) -> dict:
    max_model_len = 64 + max_tokens
    llm = LLM(str(folder), device="cpu", max_model_len=max_model_len, block_size=BLOCK_SIZE, seed=seed)
    clock = StepClock()
    instrument(llm, clock, stub)
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_reqs):
        engine.add_request(f"r{i}", [rng.randrange(3, 500) for _ in range(rng.randrange(16, 65))], params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill: not timed
    clock.take()
    steps = []
    gc.collect()
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        held = engine.scheduler.kv_cache_manager.req_to_blocks
        blocks = sum(len(held[r.request_id]) for r in engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        parts = clock.take()
        model_time = parts.get("forward", 0.0) + parts.get("logits", 0.0) + parts.get("sample", 0.0)
        steps.append(
            {
                "running": running,
                "blocks_per_request": blocks / running,
                "total_s": total,
                "model_and_sampling_s": model_time,
                "bookkeeping_s": total - model_time,
                "parts_s": {
                    "schedule": parts.get("schedule", 0.0),
                    "update_states": parts.get("update_states", 0.0),
                    "execute_model_other": parts.get("execute_model", 0.0) - parts.get("update_states", 0.0)
                    - model_time,
                    "update_from_output": parts.get("update_from_output", 0.0),
                    "engine_other": total - parts.get("execute_model", 0.0) - parts.get("schedule", 0.0)
                    - parts.get("update_from_output", 0.0),
                },
            }
        )
    full = [s for s in steps if s["running"] == num_reqs]  # the steps where every request decodes
    tenth = max(1, len(full) // 10)

    def us_per_req(subset: list[dict], key: str = "bookkeeping_s") -> float:
        return statistics.median(s[key] / s["running"] for s in subset) * 1e6

    def part_us(subset: list[dict], part: str) -> float:
        return statistics.median(s["parts_s"][part] / s["running"] for s in subset) * 1e6

    return {
        "num_reqs": num_reqs,
        "max_tokens": max_tokens,
        "stub_forward": stub,
        "decode_steps_timed": len(full),
        "bookkeeping_us_per_step": statistics.median(s["bookkeeping_s"] for s in full) * 1e6,
        "bookkeeping_us_per_req_step": us_per_req(full),
        "bookkeeping_us_per_req_step_first_tenth": us_per_req(full[:tenth]),
        "bookkeeping_us_per_req_step_last_tenth": us_per_req(full[-tenth:]),
        "blocks_per_request_first_tenth": statistics.mean(s["blocks_per_request"] for s in full[:tenth]),
        "blocks_per_request_last_tenth": statistics.mean(s["blocks_per_request"] for s in full[-tenth:]),
        "model_and_sampling_us_per_req_step": us_per_req(full, "model_and_sampling_s"),
        "parts_us_per_req_step": {p: part_us(full, p) for p in full[0]["parts_s"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-reqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512, help="output length of the tiny case")
    parser.add_argument("--stub-tokens", type=int, default=2048, help="output length of the stub case")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wide-reqs", type=int, default=128, help="requests of the tiny_wide case")
    parser.add_argument("--cases", default="tiny,stub,tiny_wide", help="comma-separated subset of tiny,stub,tiny_wide")
    parser.add_argument("--quick", action="store_true", help="4 requests of 40 tokens (8 wide): checks the script runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bookkeeping.json")
    args = parser.parse_args()
    if args.quick:
        args.num_reqs, args.max_tokens, args.stub_tokens, args.wide_reqs = 4, 40, 40, 8
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        longest = max(args.max_tokens, args.stub_tokens)
        folder = build_tiny_model(Path(tmp) / "tiny", max_position_embeddings=64 + longest)
        lengths = {"tiny": args.max_tokens, "stub": args.stub_tokens, "tiny_wide": args.max_tokens}
        num_reqs = {"tiny": args.num_reqs, "stub": args.num_reqs, "tiny_wide": args.wide_reqs}
        cases = {
            name: run_case(folder, num_reqs[name], lengths[name], stub=name == "stub") for name in args.cases.split(",")
        }
    split = None
    if "tiny" in cases and "tiny_wide" in cases:  # the module header: per request and per step
        narrow, wide = cases["tiny"], cases["tiny_wide"]
        extra_us = wide["bookkeeping_us_per_step"] - narrow["bookkeeping_us_per_step"]
        marginal = extra_us / (wide["num_reqs"] - narrow["num_reqs"])
        per_step = narrow["bookkeeping_us_per_step"] - narrow["num_reqs"] * marginal
        reqs = [narrow["num_reqs"], wide["num_reqs"]]
        split = {"marginal_us_per_request": marginal, "per_step_us": per_step, "reqs": reqs}
    for name, case in cases.items():
        print(
            f"{name}: bookkeeping {case['bookkeeping_us_per_req_step']:.1f} us per request per step "
            f"(first tenth {case['bookkeeping_us_per_req_step_first_tenth']:.1f} at "
            f"{case['blocks_per_request_first_tenth']:.1f} blocks/request, last tenth "
            f"{case['bookkeeping_us_per_req_step_last_tenth']:.1f} at {case['blocks_per_request_last_tenth']:.1f}); "
            f"model + sampling {case['model_and_sampling_us_per_req_step']:.1f} us"
        )
        print("   " + ", ".join(f"{k} {v:.1f}" for k, v in case["parts_us_per_req_step"].items()))
    if split is not None:
        print(f"real tiny model, {split['reqs'][0]} and {split['reqs'][1]} requests: "
              f"{split['marginal_us_per_request']:.1f} us per running request per step "
              f"+ {split['per_step_us']:.0f} us per step")
    record = {
        "benchmark": "bookkeeping",
        "quick": args.quick,
        "threads": args.threads,
        "block_size": BLOCK_SIZE,
        "goal": "bookkeeping_us_per_req_step <= 10, flat from the first to the last tenth",
        "cases": cases,
        "split_per_request_and_per_step": split,
        "machine": machine_info(),
        "versions": versions(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
