"""Benchmark: ``tinyvllm serve`` under load, after vLLM's ``benchmark_serving.py``.

The server runs as ``tinyvllm serve`` in a subprocess (its own Python, as a user runs
it); this process is the client. ``--num-requests`` requests (prompts of random token ids,
``randint`` lengths, ``ignore_eos`` outputs of ``randint`` lengths, greedy; Python's
``random`` seeded with ``--seed``) are sent to ``POST /v1/completions`` with
``"stream": true``, at each request rate of ``--rates``: arrivals are a Poisson process
(exponential gaps, seeded), and ``inf`` sends them all at once. Per request the client
records:

- TTFT, time to first token: from sending the request to the first streamed chunk that
  carries text;
- TPOT, time per output token after the first: (latency - TTFT) / (output tokens - 1);
- the end-to-end latency, and the output token count from the stream's ``usage``.

Per rate: mean, median (also as p50), p90 and p99 of each, the request throughput and the output
tokens per second (output tokens / seconds from the first send to the last answer).

The baseline is the offline engine in the same run: after the server stops, ``LLM.generate``
runs the same requests, all at once, on an engine built with the same flags. The ratio
``serving_over_offline_output_throughput[rate]`` is output tokens/s through HTTP over
offline output tokens/s: what the HTTP layer, the streaming and the arrival pattern cost.
Timings alone, on a shared machine, mean little; the ratio is measured in one run.

Shapes: on the CPU, the tiny test Qwen3 (``tinyvllm.models.tiny``: 2 layers, hidden size
64), whose forward is so cheap that the figures show the serving overhead itself;
``--gpu`` builds the Qwen3-0.6B shape of ``throughput.py`` in bf16 with random weights.

Usage::

    python bench/serving.py              # CPU: bench/results/serving.json
    python bench/serving.py --gpu        # CUDA: bench/results/serving-gpu.json
    python bench/serving.py --dry-run    # 12 requests, one rate, seconds (serving-dry.json)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, engine_config, machine_info, median, set_threads, versions, write_json  # noqa: E402

PERCENTILES = (50, 90, 99)


def make_workload(n: int, seed: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab: int):
    """``n`` requests: ``(prompt token ids, max_tokens)``, seeded."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(n)
    ]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals at ``rate`` per second."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summary(values: list[float]) -> dict:
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]

    return {"mean": sum(values) / len(values), "median": median(values), **{f"p{p}": pct(p) for p in PERCENTILES}}


async def one_request(http, model: str, prompt: list[int], max_tokens: int, start_at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + start_at - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    first = None
    output_tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
            if first is None and chunk["choices"] and chunk["choices"][0].get("text"):
                first = time.perf_counter()
    done = time.perf_counter()
    first = done if first is None else first
    return {"ttft": first - sent, "latency": done - sent, "output_tokens": output_tokens, "done": done}


async def run_rate(url: str, model: str, workload, rate: float, seed: int) -> dict:
    import httpx

    offsets = arrival_offsets(len(workload), rate, seed)
    limits = httpx.Limits(max_connections=len(workload))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(http, model, p, m, at, t0) for (p, m), at in zip(workload, offsets))
        )
    seconds = max(r["done"] for r in results) - t0
    expected = sum(m for _, m in workload)
    produced = sum(r["output_tokens"] for r in results)
    if produced != expected:
        raise RuntimeError(f"the server produced {produced} output tokens, expected {expected}")
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in results if r["output_tokens"] > 1]
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": len(results),
        "duration_s": seconds,
        "request_throughput": len(results) / seconds,
        "output_throughput": produced / seconds,
        "ttft_ms": {k: v * 1e3 for k, v in summary([r["ttft"] for r in results]).items()},
        "tpot_ms": {k: v * 1e3 for k, v in summary(tpot).items()},
        "e2el_ms": {k: v * 1e3 for k, v in summary([r["latency"] for r in results]).items()},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, engine_flags: list[str], threads: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads))  # fmt: skip
    cmd = [sys.executable, "-m", "tinyvllm", "serve", "--model", str(folder), "--port", str(port),
           "--served-model-name", "bench", *engine_flags]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"tinyvllm serve exited with {proc.returncode}:\n{proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("tinyvllm serve did not start in 600 s")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_offline(folder: Path, llm_kwargs: dict, workload) -> tuple[dict, dict]:
    from tinyvllm import LLM, SamplingParams

    llm = LLM(str(folder), **llm_kwargs)
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": produced, "output_throughput": produced / seconds}, engine_config(
        llm, llm_kwargs.get("attention_backend", "auto")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the Qwen3-0.6B shape on CUDA")
    parser.add_argument("--dry-run", action="store_true", help="12 requests at one rate: every code path, seconds")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--rates", default=None, help="comma-separated requests/s; 'inf' = all at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in the server (CPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    mode = "dry" if args.dry_run else ("gpu" if args.gpu else "cpu")
    defaults = {"dry": (12, "inf"), "cpu": (200, "inf,50,25"), "gpu": (500, "inf,32,16")}[mode]
    n = args.num_requests or defaults[0]
    rates = [float(r) for r in (args.rates or defaults[1]).split(",")]
    threads = set_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        if args.gpu:
            from throughput import QWEN3_0_6B, build_model_folder

            folder = build_model_folder(Path(tmp) / "qwen3-0.6b", dry_run=False)
            vocab, prompt_lens, output_lens, max_len = QWEN3_0_6B["vocab_size"], (100, 1024), (100, 1024), 4096
            llm_kwargs = dict(device="cuda", max_model_len=max_len)
            flags = ["--device", "cuda", "--max-model-len", str(max_len)]
        else:
            from tinyvllm.models.tiny import build_tiny_model

            folder = build_tiny_model(Path(tmp) / "tiny-qwen3", "qwen3")
            vocab, prompt_lens, output_lens, max_len = 512, (8, 128), (4, 64), 256
            llm_kwargs = dict(device="cpu", max_model_len=max_len)
            flags = ["--device", "cpu", "--max-model-len", str(max_len)]
        workload = make_workload(n, args.seed, prompt_lens, output_lens, vocab)

        proc, url = start_server(folder, flags, threads)
        try:
            asyncio.run(run_rate(url, "bench", workload[:4], math.inf, args.seed))  # warm-up
            by_rate = {}
            for rate in rates:
                result = asyncio.run(run_rate(url, "bench", workload, rate, args.seed))
                by_rate[str(result["request_rate"])] = result
                print(f"rate {result['request_rate']}: {result['output_throughput']:.0f} output tok/s, "
                      f"TTFT p50 {result['ttft_ms']['median']:.1f} ms, TPOT p50 {result['tpot_ms']['median']:.2f} ms")  # fmt: skip
        finally:
            stop_server(proc)
        offline, engine = run_offline(folder, llm_kwargs, workload)
        print(f"offline LLM.generate: {offline['output_throughput']:.0f} output tok/s")

    record = {
        "benchmark": "serving",
        "mode": mode,
        "date": datetime.date.today().isoformat(),
        "machine": machine_info("cuda" if args.gpu else "cpu"),
        "versions": versions(),
        "threads": threads,
        "model": "Qwen3-0.6B shape, bf16, random weights" if args.gpu else "tiny Qwen3 (tinyvllm.models.tiny)",
        "engine": engine,
        "workload": {"num_requests": n, "seed": args.seed, "prompt_lens": prompt_lens, "output_lens": output_lens,
                     "output_tokens": sum(m for _, m in workload), "stream": True, "greedy": True},  # fmt: skip
        "offline": offline,
        "serving": by_rate,
        "ratios": {
            "serving_over_offline_output_throughput": {
                rate: r["output_throughput"] / offline["output_throughput"] for rate, r in by_rate.items()
            }
        },
    }
    out = args.out or ROOT / "bench" / "results" / ("serving.json" if mode == "cpu" else f"serving-{mode}.json")
    write_json(out, record)
    for rate, ratio in record["ratios"]["serving_over_offline_output_throughput"].items():
        print(f"serving / offline output tok/s at rate {rate}: {ratio:.2f}")


if __name__ == "__main__":
    main()
