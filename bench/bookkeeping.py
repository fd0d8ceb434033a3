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

Five cases: ``tiny`` (the real forward), ``stub`` (``--stub-tokens`` long outputs with
the forward replaced by one that returns zeros: no attention cost, so long contexts stay
quick; the bookkeeping runs exactly as with a real model), ``stub_sweep`` (the stub, with
``tiny``'s output length, whose forward first rewrites a ``--sweep-mb`` buffer, 32 MiB by
default: the order of what a real decode step of the tiny model moves, whose attention reads
every request's keys and values from the cache and gathers them into a padded copy, about
20 MB at 32 requests of 300 tokens), and ``tiny_wide`` and
``stub_wide``, the same with ``--wide-reqs`` requests (128). From each narrow case and its
wide twin the script splits the bookkeeping of a step, in total and part by part, into a
part that grows with the running requests and one that does not: with ``B(R)`` the median
bookkeeping per step at R requests, ``marginal = (B(wide) - B(R)) / (wide - R)`` per
request and ``per_step = B(R) - R * marginal``. For the stub at R = 32 the per-step part,
divided by R, is about a third of the figure per request. ``stub_sweep`` runs the same
Python as ``stub`` and differs only in what the forward did to the memory caches; where it
lands near ``tiny``, memory traffic between steps is enough to explain why the same code
costs more after a real forward. The real figure moves with the machine more than the
stub's; ``tiny`` is the figure the goal is read against and ``stub`` the steadier one.

Each case runs ``--repeats`` times (3), the cases interleaved and their order reversed
every other round; the run with the median figure counts, and every run's figure is kept
beside it (``runs_bookkeeping_us_per_req_step``): the real-forward figure moves by half
between runs minutes apart on this machine.

Run: ``python3 bench/bookkeeping.py`` (about a minute on a quiet machine) writes
``bench/results/bookkeeping.json``; ``--quick`` runs a few short requests (the test suite
runs it; its timings mean nothing). ``torch.set_num_threads`` is ``--threads`` (1).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, machine_info, versions, write_json  # noqa: E402  (it puts src/ on the path)
from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

BLOCK_SIZE = 16
CASES = ("tiny", "stub", "stub_sweep", "tiny_wide", "stub_wide")


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


def instrument(llm: LLM, clock: StepClock, stub: bool, sweep_mb: int = 0) -> Counter:
    """Hook the parts of a step; with ``stub`` the forward returns zeros of the right shape,
    and with ``sweep_mb`` it first adds 1 to every float of a buffer that large (inside the
    forward's clock). Returns the counts of forward calls and sweeps, kept up to date."""
    if sweep_mb and not stub:
        raise ValueError(f"sweep_mb = {sweep_mb} needs the stub forward")
    engine, runner = llm.engine, llm.engine.model_runner
    model = runner.model
    hidden_size = llm.spec.hidden_size
    counts: Counter = Counter(forward_calls=0, sweeps=0)
    sweep = torch.zeros(sweep_mb * 2**20 // 4)  # [sweep_mb MiB of float32]
    if stub:

        def forward(input_ids, positions, kv_caches, attn_metadata):
            counts["forward_calls"] += 1
            if sweep_mb:
                sweep.add_(1.0)  # reads and writes every cache line of the buffer
                counts["sweeps"] += 1
            return torch.zeros(input_ids.shape[0], hidden_size)

        model.forward = clock.wrap("forward", forward)
    else:
        real_forward = model.forward

        def forward(*args, **kwargs):
            counts["forward_calls"] += 1
            return real_forward(*args, **kwargs)

        model.forward = clock.wrap("forward", forward)
    model.compute_logits = clock.wrap("logits", model.compute_logits)
    runner.sampler = clock.wrap("sample", runner.sampler)
    runner._update_states = clock.wrap("update_states", runner._update_states)
    runner.execute_model = clock.wrap("execute_model", runner.execute_model)
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update_from_output = clock.wrap("update_from_output", engine.scheduler.update_from_output)
    return counts


def run_case(folder: Path, num_reqs: int, max_tokens: int, stub: bool, sweep_mb: int = 0, seed: int = 0) -> dict:
    max_model_len = 64 + max_tokens
    llm = LLM(str(folder), device="cpu", max_model_len=max_model_len, block_size=BLOCK_SIZE, seed=seed)
    clock = StepClock()
    counts = instrument(llm, clock, stub, sweep_mb)
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
        "sweep_mb": sweep_mb,
        **counts,  # forward_calls and sweeps over the whole run, prefill included
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


def median_run(runs: list[dict]) -> dict:
    """The run whose figure per request is the median of ``runs`` (the upper middle of an
    even count), with every run's figure beside it."""
    ordered = sorted(runs, key=lambda run: run["bookkeeping_us_per_req_step"])
    chosen = ordered[len(ordered) // 2]
    return {**chosen, "runs_bookkeeping_us_per_req_step": [run["bookkeeping_us_per_req_step"] for run in runs]}


def split_costs(narrow: dict, wide: dict) -> dict:
    """Bookkeeping per step at two request counts, as ``marginal`` us per running request plus
    ``per_step`` us (the module header), in total and for each part of the step."""
    r, w = narrow["num_reqs"], wide["num_reqs"]

    def split(per_step_r: float, per_step_w: float) -> dict:
        marginal = (per_step_w - per_step_r) / (w - r)
        return {"marginal_us_per_request": marginal, "per_step_us": per_step_r - r * marginal}

    parts = {
        part: split(narrow["parts_us_per_req_step"][part] * r, wide["parts_us_per_req_step"][part] * w)
        for part in narrow["parts_us_per_req_step"]
    }
    return {**split(narrow["bookkeeping_us_per_step"], wide["bookkeeping_us_per_step"]), "reqs": [r, w], "parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-reqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=512, help="output length of the tiny case")
    parser.add_argument("--stub-tokens", type=int, default=2048, help="output length of the stub case")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wide-reqs", type=int, default=128, help="requests of the *_wide cases")
    parser.add_argument("--sweep-mb", type=int, default=32, help="MiB the stub_sweep case's forward rewrites")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {','.join(CASES)}",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="runs of every case, interleaved; the median run counts (3; --quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help="4 requests of 40 tokens (8 wide), 1 run: checks the script runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "bookkeeping.json")
    args = parser.parse_args()
    if args.quick:
        args.num_reqs, args.max_tokens, args.stub_tokens, args.wide_reqs = 4, 40, 40, 8
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        longest = max(args.max_tokens, args.stub_tokens)
        folder = build_tiny_model(Path(tmp) / "tiny", max_position_embeddings=64 + longest)
        names = args.cases.split(",")
        unknown = sorted(set(names) - set(CASES))
        if unknown:
            parser.error(f"unknown cases {unknown}: choose from {','.join(CASES)}")
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for repeat in range(args.repeats):  # interleaved, the order reversed every other round
            for name in names if repeat % 2 == 0 else reversed(names):
                stub, wide, swept = name.startswith("stub"), name.endswith("_wide"), name == "stub_sweep"
                max_tokens = args.stub_tokens if stub and not swept else args.max_tokens  # stub_sweep: the tiny length
                runs[name].append(run_case(
                    folder, args.wide_reqs if wide else args.num_reqs, max_tokens, stub, args.sweep_mb if swept else 0
                ))  # fmt: skip
    cases = {name: median_run(rs) for name, rs in runs.items()}
    splits = {
        narrow: split_costs(cases[narrow], cases[f"{narrow}_wide"])
        for narrow in ("tiny", "stub")
        if narrow in cases and f"{narrow}_wide" in cases
    }
    for name, case in cases.items():
        print(
            f"{name}: bookkeeping {case['bookkeeping_us_per_req_step']:.1f} us per request per step "
            f"(first tenth {case['bookkeeping_us_per_req_step_first_tenth']:.1f} at "
            f"{case['blocks_per_request_first_tenth']:.1f} blocks/request, last tenth "
            f"{case['bookkeeping_us_per_req_step_last_tenth']:.1f} at {case['blocks_per_request_last_tenth']:.1f}); "
            f"model + sampling {case['model_and_sampling_us_per_req_step']:.1f} us; "
            f"runs {', '.join(f'{x:.1f}' for x in case['runs_bookkeeping_us_per_req_step'])}"
        )
        print("   " + ", ".join(f"{k} {v:.1f}" for k, v in case["parts_us_per_req_step"].items()))
    for name, split in splits.items():
        print(f"{name}, {split['reqs'][0]} and {split['reqs'][1]} requests: "
              f"{split['marginal_us_per_request']:.1f} us per running request per step "
              f"+ {split['per_step_us']:.0f} us per step")  # fmt: skip
        print("   " + ", ".join(f"{k} {v['marginal_us_per_request']:.1f} + {v['per_step_us']:.0f}"
                                for k, v in split["parts"].items()))  # fmt: skip
    record = {
        "benchmark": "bookkeeping",
        "quick": args.quick,
        "threads": args.threads,
        "repeats": args.repeats,
        "block_size": BLOCK_SIZE,
        "sweep_mb": args.sweep_mb,
        "goal": "bookkeeping_us_per_req_step <= 10, flat from the first to the last tenth",
        "cases": cases,
        "split_per_request_and_per_step": splits.get("tiny"),
        "split_per_request_and_per_step_stub": splits.get("stub"),
        "machine": machine_info(),
        "versions": versions(),
    }
    write_json(args.out, record)


if __name__ == "__main__":
    main()
