"""Profile: where one run of ``cpu_throughput.py``'s workload spends its time, on the CPU.

What it measures: tinyvllm alone on the throughput workload of ``cpu_throughput.py`` (the
33.6M-parameter Qwen3 of ``harness.py``, 32 requests, prompts of 16-256 tokens, 16-128
outputs, temperature 0.6), split into the parts that limit its tokens/s:

- ``attention``: the backend's ``paged_attention`` in every layer;
- ``kv_write``: the backend's write of each layer's new keys and values into the cache;
- ``attention_plan``: the backend's per-step plan (``plan_step``, once per forward);
- ``forward_other``: the rest of the model's forward (embedding, projections, MLP, norms,
  rotary);
- ``lm_head``: ``compute_logits`` on each request's last row;
- ``sampler``: the sampler call;
- ``bookkeeping``: everything else in the run (scheduling, the runner's state and inputs,
  ``update_from_output``, the engine's outputs, detokenising at the end).

How: hooks wrap each part and add up its wall time over one ``LLM.generate`` of the
workload, after a warm-up run of the same workload on other prompts; the parts are
reported in seconds and as shares of the run. A hook on the engine's step also times the
bookkeeping of each step that only decodes and reports it per running request
(``decode_steps``): the median over those steps, and over the ones in which all the
workload's requests still run (``bookkeeping.py``'s measure, on this workload's model).
One run per thread count (``--threads``, default 1 and 2): a profile, not a ratio, so one
run is what it is; the ratios against transformers are ``cpu_throughput.py``'s.

Run: ``python3 bench/cpu_profile.py`` (about a minute) writes
``bench/results/cpu_profile.json``; ``--dry-run`` uses the tiny test model and workload
(seconds; the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bookkeeping import StepClock  # noqa: E402
from cpu_throughput import BLOCK_SIZE, MAX_MODEL_LEN, NUM_KV_BLOCKS, SIZES, TEMPERATURE, make_workload  # noqa: E402
from harness import ROOT, build_cpu_model, engine_config, run_header, set_threads, write_json  # noqa: E402

PARTS = ("attention", "kv_write", "attention_plan", "forward_other", "lm_head", "sampler", "bookkeeping")


def instrument(llm, clock: StepClock, decode_steps: list[tuple[int, float]]) -> None:
    """Wrap the forward, the attention backend's three calls, the LM head and the sampler;
    and the engine's step, which appends ``(requests, bookkeeping seconds)`` of every step
    that only decodes (one token per scheduled request) to ``decode_steps``."""
    from tinyvllm.models.llama import AttentionBackend

    runner = llm.engine.model_runner
    model = runner.model
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if isinstance(backend, AttentionBackend):
            module.backend = dataclasses.replace(
                backend,
                write_kv_cache=clock.wrap("kv_write", backend.write_kv_cache),
                paged_attention=clock.wrap("attention", backend.paged_attention),
                plan_step=clock.wrap("attention_plan", backend.plan_step) if backend.plan_step else None,
            )
    model.forward = clock.wrap("forward", model.forward)
    model.compute_logits = clock.wrap("lm_head", model.compute_logits)
    runner.sampler = clock.wrap("sampler", runner.sampler)

    engine, schedule, step = llm.engine, llm.engine.scheduler.schedule, llm.engine.step
    scheduled = []

    def keep_output():
        scheduled.append(schedule())
        return scheduled[-1]

    def model_seconds() -> float:
        return clock.parts["forward"] + clock.parts["lm_head"] + clock.parts["sampler"]

    def timed_step():
        before, t0 = model_seconds(), time.perf_counter()
        outputs = step()
        total = time.perf_counter() - t0
        out = scheduled.pop()
        if out.num_scheduled_reqs and out.total_num_scheduled_tokens == out.num_scheduled_reqs:
            decode_steps.append((out.num_scheduled_reqs, total - (model_seconds() - before)))
        return outputs

    engine.scheduler.schedule = keep_output
    engine.step = timed_step


def split(seconds: dict[str, float], total: float) -> dict[str, float]:
    """The run's seconds per part (``PARTS``): the forward's own parts out of the forward,
    bookkeeping the rest of the run. A part that never ran (no plan) counts 0."""
    t = {name: seconds.get(name, 0.0) for name in ("attention", "kv_write", "attention_plan", "forward", "lm_head", "sampler")}
    return {
        "attention": t["attention"],
        "kv_write": t["kv_write"],
        "attention_plan": t["attention_plan"],
        "forward_other": t["forward"] - t["attention"] - t["kv_write"] - t["attention_plan"],
        "lm_head": t["lm_head"],
        "sampler": t["sampler"],
        "bookkeeping": total - t["forward"] - t["lm_head"] - t["sampler"],
    }


def decode_figures(decode_steps: list[tuple[int, float]], num_seqs: int) -> dict:
    """Bookkeeping per running request in the steps that only decode: the median over all
    of them, and over those where all ``num_seqs`` requests still run (``bookkeeping.py``'s
    measure, on this workload)."""
    full = [seconds / reqs for reqs, seconds in decode_steps if reqs == num_seqs]
    return {
        "steps": len(decode_steps),
        "request_steps": sum(reqs for reqs, _ in decode_steps),
        "steps_all_running": len(full),
        "bookkeeping_us_per_req_step": statistics.median(s / r for r, s in decode_steps) * 1e6 if decode_steps else 0.0,
        "bookkeeping_us_per_req_step_all_running": statistics.median(full) * 1e6 if full else 0.0,
    }


def profile_run(
    llm, clock: StepClock, decode_steps: list[tuple[int, float]], prompts: list[list[int]], max_tokens: list[int]
) -> dict:
    from tinyvllm import SamplingParams

    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=m) for m in max_tokens]
    clock.take()  # drop what the hooks saw before this run
    decode_steps.clear()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    total = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outs]
    if produced != list(max_tokens):
        raise RuntimeError(f"tinyvllm produced {produced} tokens, expected {list(max_tokens)}")
    parts = split(clock.take(), total)
    tokens = sum(len(p) for p in prompts) + sum(produced)
    return {
        "seconds": total,
        "total_tokens": tokens,
        "tok_per_s": tokens / total,
        "output_tokens": sum(produced),
        "parts_s": parts,
        "shares": {name: value / total for name, value in parts.items()},
        "decode_steps": decode_figures(decode_steps, len(prompts)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model and workload, seconds")
    parser.add_argument("--threads", default=None, help="torch thread counts, comma-separated (default 1,2; dry run 1)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/cpu_profile*.json)")
    args = parser.parse_args(argv)
    size = SIZES["dry" if args.dry_run else "full"]
    threads = [int(t) for t in (args.threads or ("1" if args.dry_run else "1,2")).split(",")]

    from tinyvllm import LLM

    per_threads = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_cpu_model(Path(tmp) / "model", dry_run=args.dry_run)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        llm = LLM(str(folder), device="cpu", block_size=BLOCK_SIZE, max_model_len=512 if args.dry_run else MAX_MODEL_LEN,
                  num_gpu_blocks_override=NUM_KV_BLOCKS, enable_prefix_caching=False, seed=0)  # fmt: skip
        clock = StepClock()  # here it adds up a whole run, not one step
        decode_steps: list[tuple[int, float]] = []
        instrument(llm, clock, decode_steps)
        workload = (size["num_seqs"], size["prompt_len"], size["output_len"], vocab)
        for i, n in enumerate(threads):
            actual = set_threads(n)
            profile_run(llm, clock, decode_steps, *make_workload(*workload, seed=1000 + i))  # warm-up, other prompts
            per_threads[str(n)] = {
                "torch_threads": actual, **profile_run(llm, clock, decode_steps, *make_workload(*workload))
            }
        engine = engine_config(llm, "auto")

    record = {
        "benchmark": "cpu_profile",
        "dry_run": args.dry_run,
        **run_header("cpu_profile.py", argv),
        "engine": engine,
        "workload": {"num_seqs": size["num_seqs"], "prompt_len": size["prompt_len"], "output_len": size["output_len"],
                     "temperature": TEMPERATURE},  # fmt: skip
        "parts": list(PARTS),
        "threads": per_threads,
    }
    for n, run in per_threads.items():
        shares = ", ".join(f"{name} {run['shares'][name]:.1%}" for name in PARTS)
        decode = run["decode_steps"]
        print(f"threads={n}: {run['seconds']:.2f} s, {run['tok_per_s']:.0f} tok/s; {shares}")
        print(f"   bookkeeping in decode steps: {decode['bookkeeping_us_per_req_step']:.1f} us per running request "
              f"(median of {decode['steps']} steps), {decode['bookkeeping_us_per_req_step_all_running']:.1f} us "
              f"while all {size['num_seqs']} run ({decode['steps_all_running']} steps)")
    out = args.out or ROOT / "bench" / "results" / ("cpu_profile-dry.json" if args.dry_run else "cpu_profile.json")
    write_json(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
