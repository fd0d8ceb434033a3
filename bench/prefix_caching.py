"""Benchmark: prefix caching on against off, input throughput and mean TTFT, at ~49%, ~37% and 0% hits.

Mirrors the benchmark table of seed 004, vLLM PR #9668 "[V1] Prefix caching": there,
caching at a 49% hit rate raised input throughput from about 17.8k to 32.1k tok/s, and
at a 37% hit rate cut the mean time to first token (TTFT) from 193 to 125 ms
(Llama-3-8B FP8 on an L40S). Here the same two figures are measured on tinyvllm, caching
on against caching off, in the same run, as ratios. A third case answers the review's
question, "how much do we lose if we enable prefix caching but get 0% cache hits?": no
prompt shares a prefix, so caching only costs (every full block hashed, looked up and
entered in the map); the PR's answer was a mean TTFT of 199.69 ms against 195.53 ms.

Workload of each case: N prompts made of one shared prefix of random token ids followed
by a unique tail of random ids. With caching on, every request after the first finds the
prefix's full blocks in the cache (requests admitted in the same step included), so the
hit rate is about ``(N - 1) / N * shared / (shared + unique)``; the lengths are chosen for
49% and 37% (and no shared prefix for 0%), and the script reports the hit rate it measured (the prefix cache's tokens
found / tokens looked up). The 37% case on the GPU uses the PR's own lengths: a
330-token prefix and 550 unique tokens.

Each run adds every request to an ``LLMEngine`` (``add_request``) and steps it until all
finish. Input throughput = prompt tokens / seconds of the whole run; a request's TTFT =
the time of the step that returned its first output token (``RequestMetrics``) - its
arrival. By default all requests arrive at once, before the first step, so TTFT includes
the wait behind other prefills; ``--request-rate R`` makes them arrive as a Poisson process
of R requests/s instead, as the PR's serving benchmark did, and TTFT counts from each
scheduled arrival (the run then lasts at least until the last arrival, so read TTFT, not
throughput). The token budget is 2048 per step, so the prefills spread over several steps.

Two engines, caching off and on, each warmed up on a full-size run of the first case (on
prompts of its own: a warm-up of two short requests left the first timed run of a full
batch up to 1.8x slower than the next, one-time costs of new shapes); the repeats
alternate off, on, off, on, ... and the medians count. Every run draws new prompts (the same for off and on in a
repeat), so a run never hits the blocks of an earlier one. The headline ratios are ratios of
the medians; beside them the JSON keeps each repeat's own ratio (``*_per_repeat``: off and on
ran the same prompts back to back) and the table prints their range, the spread a single
figure hides on a shared machine.

Usage::

    python bench/prefix_caching.py            # CPU, the 33.6M-parameter Qwen3 (harness.py), 1 and 2 threads
    python bench/prefix_caching.py --gpu      # CUDA, the Qwen3-0.6B shape of throughput.py, bf16
    python bench/prefix_caching.py --dry-run  # tiny model, seconds; the test suite runs it
    python bench/prefix_caching.py --cases hit_49,hit_37   # some of the cases (gpu.sh: these two)

Writes ``bench/results/prefix_caching.json`` (``prefix_caching-gpu.json`` with ``--gpu``,
``prefix_caching-dry.json`` for a dry run; ``--out`` to change).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    CPU_MODEL,
    ROOT,
    build_cpu_model,
    engine_config,
    median,
    num_params,
    prefix_counters,
    run_header,
    set_threads,
    shared_model_folder,
    write_json,
)

# Per mode: the cases (prompts, shared prefix, unique tail, output tokens each).
CASES = {
    "cpu": {
        "hit_49": dict(num_seqs=32, shared=256, unique=248, output=8),  # 31/32 * 256/504 = 49.2%
        "hit_37": dict(num_seqs=32, shared=208, unique=336, output=8),  # 31/32 * 208/544 = 37.0%
        "hit_0": dict(num_seqs=32, shared=0, unique=544, output=8),  # hit_37's lengths, nothing shared
    },
    "gpu": {
        "hit_49": dict(num_seqs=200, shared=256, unique=264, output=8),  # 199/200 * 256/520 = 49.0%
        "hit_37": dict(num_seqs=200, shared=330, unique=550, output=150),  # the PR's lengths: 320 of 330 in full blocks
        "hit_0": dict(num_seqs=200, shared=0, unique=880, output=150),  # the same lengths, nothing shared
    },
    "dry": {
        "hit_49": dict(num_seqs=4, shared=32, unique=16, output=2),
        "hit_37": dict(num_seqs=4, shared=16, unique=16, output=2),
        "hit_0": dict(num_seqs=4, shared=0, unique=32, output=2),
    },
}
SEED_004 = {  # the PR's figures, for the side-by-side table
    "hit_49": {"hit_rate": 0.49, "input_tok_per_s_off": 17777.03, "input_tok_per_s_on": 32149.17},
    "hit_37": {"hit_rate": 0.37, "mean_ttft_ms_off": 193.03, "mean_ttft_ms_on": 125.42},
    # The review's table, the author's later version: the same PR without and with caching.
    "hit_0": {"hit_rate": 0.0, "mean_ttft_ms_off": 195.53, "mean_ttft_ms_on": 199.69},
}
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048
TEMPERATURE = 0.6


def make_prompts(num_seqs: int, shared: int, unique: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(vocab) for _ in range(unique)] for _ in range(num_seqs)]


def run_engine(llm, prompts, max_tokens: int, request_rate: float, seed: int, ids) -> dict:
    """Add the requests (all at once, or Poisson arrivals at ``request_rate``), step to the end.

    Returns the run's seconds, each request's TTFT, its output token count, and the prefix
    cache's counters over the run.
    """
    from tinyvllm import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=max_tokens)
    rng = random.Random(seed)
    if request_rate > 0:
        offsets = list(itertools.accumulate(rng.expovariate(request_rate) for _ in prompts))
    else:
        offsets = [0.0] * len(prompts)
    req_ids = [f"r{next(ids)}" for _ in prompts]
    arrival: dict[str, float] = {}
    outputs = []
    before = prefix_counters(llm)
    start = time.perf_counter()
    pending = 0
    while pending < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending < len(prompts) and start + offsets[pending] <= now:
            engine.add_request(req_ids[pending], prompts[pending], params)
            arrival[req_ids[pending]] = start + offsets[pending]
            pending += 1
        if engine.has_unfinished_requests():
            outputs.extend(engine.step())
        elif pending < len(prompts):
            time.sleep(max(0.0, start + offsets[pending] - time.perf_counter()))
    seconds = time.perf_counter() - start
    after = prefix_counters(llm)
    by_id = {o.request_id: o for o in outputs}
    outs = [by_id[r] for r in req_ids]
    produced = [len(o.outputs[0].token_ids) for o in outs]
    if produced != [max_tokens] * len(prompts):
        raise RuntimeError(f"the engine produced {produced} tokens, expected {max_tokens} each")
    return {
        "seconds": seconds,
        "ttft_s": [o.metrics.first_token_time - arrival[o.request_id] for o in outs],
        "looked_up_tokens": after[0] - before[0],
        "hit_tokens": after[1] - before[1],
        "cached_tokens_in_outputs": sum(o.num_cached_tokens for o in outs),
        "output_tokens": sum(produced),
    }


def bench_case(engines: dict, case: dict, vocab: int, repeats: int, request_rate: float, seed: int, ids) -> dict:
    n, shared, unique, out_len = case["num_seqs"], case["shared"], case["unique"], case["output"]
    prompt_tokens = n * (shared + unique)
    runs = {name: [] for name in engines}
    for r in range(repeats):
        prompts = make_prompts(n, shared, unique, vocab, seed=seed + r)  # new prompts every repeat
        for name, llm in engines.items():
            torch.manual_seed(r)
            runs[name].append(run_engine(llm, prompts, out_len, request_rate, seed + r, ids))
    result = {**case, "prompt_tokens": prompt_tokens, "expected_hit_rate_upper_bound":
              (n - 1) * (shared // BLOCK_SIZE * BLOCK_SIZE) / prompt_tokens}  # fmt: skip
    for name, rs in runs.items():
        seconds = [x["seconds"] for x in rs]
        mean_ttft = [sum(x["ttft_s"]) / len(x["ttft_s"]) for x in rs]
        hits, looked_up = sum(x["hit_tokens"] for x in rs), sum(x["looked_up_tokens"] for x in rs)
        result[name] = {
            "seconds": seconds, "mean_ttft_s": mean_ttft,
            "median_s": median(seconds), "input_tok_per_s": prompt_tokens / median(seconds),
            "median_mean_ttft_s": median(mean_ttft),
            "hit_tokens": [x["hit_tokens"] for x in rs], "looked_up_tokens": [x["looked_up_tokens"] for x in rs],
            "cached_tokens_in_outputs": [x["cached_tokens_in_outputs"] for x in rs],
            "output_tokens": [x["output_tokens"] for x in rs],
            "hit_rate": hits / looked_up if looked_up else 0.0,  # the prefix cache's own counters
            "ttft_s_last_repeat": rs[-1]["ttft_s"],
        }  # fmt: skip
    off, on = result["caching_off"], result["caching_on"]
    result["ratios"] = {  # the headline: ratios of the medians
        "input_throughput_on_over_off": on["input_tok_per_s"] / off["input_tok_per_s"],
        "mean_ttft_off_over_on": off["median_mean_ttft_s"] / on["median_mean_ttft_s"],
        # The spread: each repeat's own ratio, off and on having run its prompts back to back.
        "input_throughput_on_over_off_per_repeat": [a / b for a, b in zip(off["seconds"], on["seconds"])],
        "mean_ttft_off_over_on_per_repeat": [a / b for a, b in zip(off["mean_ttft_s"], on["mean_ttft_s"])],
    }
    return result


def build_folder(folder: Path, mode: str) -> Path:
    if mode == "gpu":
        from throughput import build_model_folder  # the Qwen3-0.6B shape, bf16, random weights

        return build_model_folder(folder, dry_run=False)
    return build_cpu_model(folder, dry_run=mode == "dry")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--gpu", action="store_true", help="CUDA, the Qwen3-0.6B shape in bf16")
    group.add_argument("--dry-run", action="store_true", help="tiny model and workload on the CPU, seconds")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per setting (default 5 on the CPU, 3 on a GPU, 1 dry)")
    parser.add_argument("--threads", default=None, help="torch thread counts, comma-separated (default 1,2; dry run 1)")
    parser.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    parser.add_argument("--attention-backend", default="auto", help="tinyvllm's attention_backend (default auto)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default bench/results/prefix_caching*.json)")
    parser.add_argument("--quick", action="store_true", help="half the requests of each case")
    parser.add_argument("--cases", default=None, help="the cases to run, comma-separated (default all: hit_49,hit_37,hit_0)")
    parser.add_argument("--model-folder", type=Path, default=None,
                        help="reuse the model built there, or build it there (default: a temporary folder)")  # fmt: skip
    args = parser.parse_args(argv)
    mode = "gpu" if args.gpu else "dry" if args.dry_run else "cpu"
    if mode == "gpu" and not torch.cuda.is_available():
        print("bench/prefix_caching.py --gpu: no CUDA device; run it without --gpu for the CPU benchmark")
        return 0
    device = "cuda" if mode == "gpu" else "cpu"
    default_threads = {"gpu": str(torch.get_num_threads()), "cpu": "1,2", "dry": "1"}[mode]
    threads = [int(t) for t in (args.threads or default_threads).split(",")]
    repeats = args.repeats or {"dry": 1, "gpu": 3, "cpu": 5}[mode]  # the CPU's ratios drift between minutes
    cases = CASES[mode]
    if args.cases:
        unknown = sorted(set(args.cases.split(",")) - set(cases))
        if unknown:
            parser.error(f"unknown case(s) {unknown}; the cases are {sorted(cases)}")
        cases = {name: case for name, case in cases.items() if name in args.cases.split(",")}
    if args.quick:
        cases = {name: {**case, "num_seqs": max(2, case["num_seqs"] // 2)} for name, case in cases.items()}

    from tinyvllm import LLM

    ids = itertools.count()
    with tempfile.TemporaryDirectory() as tmp:
        folder = shared_model_folder(args.model_folder, Path(tmp), lambda f: build_folder(f, mode))
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        longest = max(c["shared"] + c["unique"] + c["output"] for c in cases.values())
        common = dict(device=device, block_size=BLOCK_SIZE, max_model_len=-(-longest // 256) * 256, seed=0,
                      max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, attention_backend=args.attention_backend)  # fmt: skip
        # A fixed pool that holds every request of the largest case at once (about 1,100 blocks,
        # 280 MiB for the CPU model; 13,000 blocks, 24 GiB per engine for the GPU shape), so both
        # engines fit on one device and nothing is ever preempted.
        common["num_gpu_blocks_override"] = max(c["num_seqs"] * -(-(c["shared"] + c["unique"] + c["output"]) // BLOCK_SIZE)
                                                for c in cases.values()) + 64  # fmt: skip
        engines = {"caching_off": LLM(str(folder), enable_prefix_caching=False, **common),
                   "caching_on": LLM(str(folder), enable_prefix_caching=True, **common)}  # fmt: skip
        params = num_params(folder)
        config = {name: engine_config(llm, args.attention_backend) for name, llm in engines.items()}
        out = args.out or ROOT / "bench" / "results" / {"cpu": "prefix_caching.json", "gpu": "prefix_caching-gpu.json",
                                                        "dry": "prefix_caching-dry.json"}[mode]  # fmt: skip
        per_threads: dict[str, dict] = {}

        def record(complete: bool) -> dict:
            """What is measured so far; written after every case, so a run cut short keeps it."""
            result = {
                "benchmark": "prefix_caching",
                "mode": mode,
                "dry_run": args.dry_run,
                "complete": complete,
                **run_header("prefix_caching.py", argv, device),
                "model": {"family": "qwen3", "config": {"dry": "tiny test model (tinyvllm.models.tiny)", "cpu": CPU_MODEL,
                          "gpu": "Qwen3-0.6B shape (bench/throughput.py QWEN3_0_6B)"}[mode],
                          "dtype": "bfloat16" if mode == "gpu" else "float32", "params": params},  # fmt: skip
                "engine": config,
                "workload": {"temperature": TEMPERATURE, "ignore_eos": True,
                             "request_rate": args.request_rate or "all at once",
                             "token_ids": f"uniform in [0, {vocab})", "cases": cases},  # fmt: skip
                "repeats": repeats,
                "seed_004_reference": SEED_004,
                "threads": per_threads,
                "ratios": {t: {c: r["ratios"] for c, r in per["cases"].items()} for t, per in per_threads.items()},
            }
            write_json(out, result)
            return result

        for i, n in enumerate(threads):
            actual = set_threads(n)
            for name, llm in engines.items():  # warm-up: the first case at full size, on prompts of its own
                warm = next(iter(cases.values()))
                warm_prompts = make_prompts(warm["num_seqs"], warm["shared"], warm["unique"], vocab, seed=10_000 + i)
                run_engine(llm, warm_prompts, warm["output"], 0.0, 0, ids)
            per_threads[str(n)] = {"torch_threads": actual, "cases": {}}
            for j, (name, case) in enumerate(cases.items()):
                seed = 1000 * (i + 1) + 100 * j
                per_threads[str(n)]["cases"][name] = bench_case(engines, case, vocab, repeats, args.request_rate, seed, ids)
                record(complete=False)
    result = record(complete=True)
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    backend = result["engine"]["caching_on"]["attention_backend"]
    print(f"\nprefix_caching ({result['mode']}, {result['repeats']} repeat(s), attention backend {backend!r})")
    print(f"{'threads':>7} {'case':<7} {'hit rate':>8} {'input tok/s off -> on':>24} {'ratio':>6} "
          f"{'mean TTFT ms off -> on':>24} {'ratio':>6}")  # fmt: skip
    for t, per in result["threads"].items():
        for name, c in per["cases"].items():
            off, on, ratios = c["caching_off"], c["caching_on"], c["ratios"]
            throughput = f"{off['input_tok_per_s']:>11.0f} -> {on['input_tok_per_s']:<9.0f}"
            ttft = f"{off['median_mean_ttft_s'] * 1e3:>11.1f} -> {on['median_mean_ttft_s'] * 1e3:<9.1f}"
            print(f"{t:>7} {name:<7} {on['hit_rate']:>8.1%} {throughput} {ratios['input_throughput_on_over_off']:>6.2f} "
                  f"{ttft} {ratios['mean_ttft_off_over_on']:>6.2f}")  # fmt: skip
            spread = {key: ratios[f"{key}_per_repeat"] for key in ("input_throughput_on_over_off", "mean_ttft_off_over_on")}
            print(f"{'':>16} per repeat: input {min(spread['input_throughput_on_over_off']):.2f}-"
                  f"{max(spread['input_throughput_on_over_off']):.2f}, TTFT {min(spread['mean_ttft_off_over_on']):.2f}-"
                  f"{max(spread['mean_ttft_off_over_on']):.2f}")  # fmt: skip
    s49, s37, s0 = (result["seed_004_reference"][k] for k in ("hit_49", "hit_37", "hit_0"))
    off49, on49, off37, on37 = (s49["input_tok_per_s_off"], s49["input_tok_per_s_on"],
                                s37["mean_ttft_ms_off"], s37["mean_ttft_ms_on"])  # fmt: skip
    print(f"seed 004 (vLLM PR #9668, L40S): 49% hits, input {off49:.0f} -> {on49:.0f} tok/s ({on49 / off49:.2f}x); "
          f"37% hits, mean TTFT {off37:.0f} -> {on37:.0f} ms ({off37 / on37:.2f}x); "
          f"0% hits, mean TTFT {s0['mean_ttft_ms_off']:.0f} -> {s0['mean_ttft_ms_on']:.0f} ms "
          f"({s0['mean_ttft_ms_off'] / s0['mean_ttft_ms_on']:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
