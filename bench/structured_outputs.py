"""Benchmark: what structured outputs cost a step, and what a schema costs to compile (CPU).

What it measures, on the shipped model (``stdlib_tiny``, ``LLM(torch_threads=N)``, N recorded):

- **the step**: a batch of ``--batch`` (32) requests decoding together, with 0%, 50% and 100%
  of them constrained by a small JSON schema (``SCHEMA``: an object with a string and an
  array of strings, so the grammars stay open for the whole window), the others
  unconstrained. Every request samples (temperature 1, its own seed: the unconstrained rows
  draw the same tokens in every case) with ``ignore_eos`` and the same ``max_tokens``, so the
  batch stays whole for ``--steps`` decode steps. The figure of a run is the median time of
  its decode steps (``engine.step()`` end to end: the schedule, the manager's bitmask, the
  forward, the mask applied, the sampler, the matchers advanced); the first step, the
  prefill of the 32 prompts, is left out. The schema is compiled before the timed runs, so no
  request waits for its grammar. Goal (issue 40): 100% / 0% <= 1.25.
- **where the grammar's time goes**: one more run per case with the manager's
  ``grammar_bitmask`` and ``advance`` and the worker's ``apply_grammar_bitmask`` wrapped in
  timers (ms per step; not part of the timed runs, the wrappers cost a little), and from
  them ``ratios_from_parts``: 1 + (those pieces' CPU time per step, less the unconstrained
  case's) / the unconstrained step's CPU time. On a busy shared machine the step's own ratio
  moves by more than the grammar costs; this one does not depend on the forward's noise.
- **the compile**: a cold schema (one never compiled: ``SCHEMA`` with a property renamed each
  time) through the engine's manager, ``engine.structured_output_manager.compile(params)``
  until ``.result()``; the same params again (the manager's cache: the goal is <= 1 ms); and
  xgrammar's own ``GrammarCompiler.compile_json_schema`` on the same tokenizer, cold (its
  cache off) and cached (its cache on, the second compile of one schema).

How: ``--repeats`` rounds; each round runs the three cases once, in an order that alternates
between rounds (0, 50, 100, then 100, 50, 0), so a slow spell of the machine hits every case.
A case's figure is the median of its runs' medians; the ratios are taken between those
medians, and each round's own ratio is kept (``per_round``) to show the spread. A warm-up
run of every case comes first.

Run: ``python bench/structured_outputs.py`` (about two minutes) writes
``bench/results/structured_outputs.json``; ``--dry-run`` runs batch 4 for 3 steps, one round
(the test suite runs it; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, run_header, set_threads, write_json  # noqa: E402  (it puts src/ on the path)
from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.sampling_params import StructuredOutputsParams  # noqa: E402
from tinyvllm.worker import model_runner  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "tags"],
}
FRACTIONS = (0.0, 0.5, 1.0)
RATIO_100 = "constrained_100_over_constrained_0"


def case_name(fraction: float) -> str:
    return f"constrained_{round(fraction * 100)}"


def requests(tokenizer, batch: int, fraction: float, steps: int) -> list[tuple[list[int], SamplingParams]]:
    """The batch: the first ``fraction`` of it constrained by ``SCHEMA``, every request seeded by its place."""
    constrained = round(fraction * batch)
    out = []
    for i in range(batch):
        so = StructuredOutputsParams(json=SCHEMA) if i < constrained else None
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 1, ignore_eos=True, structured_outputs=so)
        out.append((tokenizer(f"record_{i} = ").input_ids, params))
    return out


def run_case(llm: LLM, batch: int, fraction: float, steps: int, tag: str) -> dict:
    """One run of a case: every step timed; the decode steps' median, and what the grammars did."""
    engine = llm.engine
    for i, (ids, params) in enumerate(requests(llm.get_tokenizer(), batch, fraction, steps)):
        engine.add_request(f"{tag}-{i}", ids, params)
    manager = engine.structured_output_manager
    live_rows = 0  # constrained rows whose grammar was still open (filled by the matcher)
    times, cpu_times, outputs = [], [], []
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.requests
        live_rows += sum(
            1 for r in scheduled.values()
            if r.use_structured_output and r.structured_output_request.grammar is not None
            and not r.structured_output_request.grammar.is_terminated()
        )  # fmt: skip
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs += engine.step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    assert len(outputs) == batch and all(len(o.outputs[0].token_ids) == steps + 1 for o in outputs)
    decode, cpu_decode = times[1:], cpu_times[1:]  # the first step prefills every prompt
    eos = llm.get_tokenizer().eos_token_id
    constrained = [o for o in outputs if o.request_id.rsplit("-", 1)[1].isdigit()
                   and int(o.request_id.rsplit("-", 1)[1]) < round(fraction * batch)]  # fmt: skip
    manager.check_invariants()
    return {
        "median_step_ms": statistics.median(decode) * 1e3,
        "median_step_cpu_ms": statistics.median(cpu_decode) * 1e3,
        "decode_steps": len(decode),
        "live_grammar_rows": live_rows,
        "grammars_finished": sum(eos in o.outputs[0].token_ids for o in constrained),
        "tokens": [list(o.outputs[0].token_ids) for o in sorted(outputs, key=lambda o: int(o.request_id.rsplit("-", 1)[1]))],
    }


def grammar_parts(llm: LLM, batch: int, fraction: float, steps: int, tag: str) -> dict:
    """One run with the grammar's three pieces timed: ms per step of each (wall, and CPU as ``_cpu``)."""
    manager = llm.engine.structured_output_manager
    names = ("grammar_bitmask", "advance", "apply_grammar_bitmask")
    spent = {f"{name}{suffix}": 0.0 for name in names for suffix in ("", "_cpu")}

    def timer(name, fn):
        def wrapped(*args, **kwargs):
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                spent[f"{name}_cpu"] += time.process_time() - cpu_start

        return wrapped

    with (
        mock.patch.object(manager, "grammar_bitmask", timer("grammar_bitmask", manager.grammar_bitmask)),
        mock.patch.object(manager, "advance", timer("advance", manager.advance)),
        mock.patch.object(model_runner, "apply_grammar_bitmask",
                          timer("apply_grammar_bitmask", model_runner.apply_grammar_bitmask)),
    ):  # fmt: skip
        run = run_case(llm, batch, fraction, steps, tag)
    steps_run = run["decode_steps"] + 1
    return {name: seconds * 1e3 / steps_run for name, seconds in spent.items()} | {
        "median_step": run["median_step_ms"], "median_step_cpu": run["median_step_cpu_ms"],
    }  # fmt: skip  (every figure in ms)


def compile_times(llm: LLM, count: int) -> dict:
    """Cold and cached compiles of ``SCHEMA``-like schemas, through the manager and in xgrammar alone (ms)."""
    import xgrammar as xgr

    manager = llm.engine.structured_output_manager

    def schema(k: int) -> dict:  # a new key (and a new grammar) per k
        return SCHEMA | {"properties": {f"name_{k}": SCHEMA["properties"]["name"], "tags": SCHEMA["properties"]["tags"]},
                         "required": [f"name_{k}", "tags"]}  # fmt: skip

    def ms(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    stamp = time.time_ns()  # keys no earlier run of this process used
    cold, cached = [], []
    for k in range(count):
        params = StructuredOutputsParams(json=schema(stamp + k))
        cold.append(ms(lambda: manager.compile(params).result()))
        cached.append(ms(lambda: manager.compile(StructuredOutputsParams(json=schema(stamp + k))).result()))
    info = xgr.TokenizerInfo.from_huggingface(
        llm.get_tokenizer(), vocab_size=manager.vocab_size, stop_token_ids=list(manager.eos_token_ids)
    )
    plain = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    caching = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    xg_cold, xg_cached = [], []
    for k in range(count):
        text = json.dumps(schema(stamp + count + k))
        xg_cold.append(ms(lambda: plain.compile_json_schema(text)))
        caching.compile_json_schema(text)
        xg_cached.append(ms(lambda: caching.compile_json_schema(text)))
    med = statistics.median
    return {
        "count": count,
        "manager_cold_ms": med(cold), "manager_cached_ms": med(cached),
        "xgrammar_cold_ms": med(xg_cold), "xgrammar_cached_ms": med(xg_cached),
        "runs_ms": {"manager_cold": cold, "manager_cached": cached, "xgrammar_cold": xg_cold, "xgrammar_cached": xg_cached},
    }  # fmt: skip


def summarise(runs: dict[str, list[dict]], key: str) -> dict:
    """Each case's median of its runs' ``key``, the ratios of the medians to the unconstrained
    case's, and each round's own ratio."""
    base = runs[case_name(0.0)]
    medians = {name: statistics.median(run[key] for run in case_runs) for name, case_runs in runs.items()}
    names = [case_name(f) for f in FRACTIONS[1:]]
    return {
        "median_step_ms": medians,
        "ratios": {f"{name}_over_{case_name(0.0)}": medians[name] / medians[case_name(0.0)] for name in names},
        "per_round_ratios": {
            f"{name}_over_{case_name(0.0)}": [run[key] / run0[key] for run, run0 in zip(runs[name], base)] for name in names
        },
        "runs_ms": {name: [run[key] for run in case_runs] for name, case_runs in runs.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per run")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compiles", type=int, default=20, help="cold (and cached) compiles timed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dry-run", action="store_true", help="batch 4, 3 steps, one round: checks the script runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "structured_outputs.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.batch, args.steps, args.repeats, args.compiles = 4, 3, 1, 2
    started, header = time.perf_counter(), run_header("structured_outputs.py", argv)  # the load average before the run
    llm = LLM(torch_threads=args.threads, max_num_seqs=max(args.batch, 1))
    threads = set_threads(args.threads)
    llm.engine.structured_output_manager.compile(StructuredOutputsParams(json=SCHEMA)).result()  # no run waits for it
    for fraction in FRACTIONS:  # warm-up: the first run of each case is not timed
        run_case(llm, args.batch, fraction, args.steps, f"warmup-{case_name(fraction)}")
    runs: dict[str, list[dict]] = {case_name(f): [] for f in FRACTIONS}
    for r in range(args.repeats):
        for fraction in FRACTIONS if r % 2 == 0 else reversed(FRACTIONS):
            runs[case_name(fraction)].append(run_case(llm, args.batch, fraction, args.steps, f"r{r}-{case_name(fraction)}"))
    base = runs[case_name(0.0)]
    for name, case_runs in runs.items():  # an unconstrained row draws the same tokens whatever its neighbours
        for run, run0 in zip(case_runs, base):
            first = round(float(name.rsplit("_", 1)[1]) / 100 * args.batch)
            assert run["tokens"][first:] == run0["tokens"][first:], f"{name}: the unconstrained rows changed"
    figures = {clock: summarise(runs, f"median_step{suffix}_ms") for clock, suffix in (("wall", ""), ("cpu", "_cpu"))}
    parts = {case_name(f): grammar_parts(llm, args.batch, f, args.steps, f"parts-{case_name(f)}") for f in FRACTIONS}
    compiles = compile_times(llm, args.compiles)
    base_cpu = figures["cpu"]["median_step_ms"][case_name(0.0)]
    from_parts = {  # the grammar's own CPU time per step, over the unconstrained step's CPU time
        f"{case_name(f)}_over_{case_name(0.0)}": 1 + sum(
            parts[case_name(f)][f"{k}_cpu"] - parts[case_name(0.0)][f"{k}_cpu"]
            for k in ("grammar_bitmask", "advance", "apply_grammar_bitmask")
        ) / base_cpu
        for f in FRACTIONS[1:]
    }
    for clock, fig in figures.items():
        for name, value in fig["median_step_ms"].items():
            each = ", ".join(f"{v:.2f}" for v in fig["runs_ms"][name])
            print(f"{clock:4s} {name:16s} median step {value:7.2f} ms  (runs: {each})")
        for key, value in fig["ratios"].items():
            rounds = fig["per_round_ratios"][key]
            print(f"{clock:4s} {key:36s} {value:5.3f}x  (per round {min(rounds):.3f}-{max(rounds):.3f})")
    for name, spent in parts.items():
        print(f"{name:16s} ms per step (wall / cpu): "
              + ", ".join(f"{k} {spent[k]:.3f} / {spent[k + '_cpu']:.3f}" for k in spent if not k.endswith("_cpu")))
    for key, value in from_parts.items():
        print(f"from the parts: {key:36s} {value:5.3f}x")
    print(f"compile (ms, median of {compiles['count']}): manager cold {compiles['manager_cold_ms']:.2f}, "
          f"cached {compiles['manager_cached_ms']:.4f}; xgrammar cold {compiles['xgrammar_cold_ms']:.2f}, "
          f"cached {compiles['xgrammar_cached_ms']:.4f}")  # fmt: skip
    record = {
        "benchmark": "structured_outputs",
        "dry_run": args.dry_run,
        **header,
        "threads": threads,
        "model": "stdlib_tiny",
        "workload": {
            "batch": args.batch, "decode_steps": args.steps, "repeats": args.repeats, "schema": SCHEMA,
            "sampling": "temperature 1, seed = place in the batch, ignore_eos, max_tokens = decode steps + 1",
        },  # fmt: skip
        "wall": figures["wall"],
        "cpu": figures["cpu"],
        "runs": {name: [{k: v for k, v in run.items() if k != "tokens"} for run in case_runs]
                 for name, case_runs in runs.items()},  # fmt: skip
        "grammar_parts_ms_per_step": parts,
        "ratios_from_parts": from_parts,
        "compile": compiles,
        "goals": {
            "step_ratio_100_max": 1.25, "cached_compile_ms_max": 1.0,
            "step_ratio_100_met": figures["wall"]["ratios"][RATIO_100] <= 1.25,
            "cached_compile_met": compiles["manager_cached_ms"] <= 1.0,
        },  # fmt: skip
        "seconds": time.perf_counter() - started,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    write_json(args.out, record)
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
