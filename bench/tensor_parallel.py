"""Benchmark: tensor parallelism (issue 38), four parts, one JSON.

Part ``message``: what it costs the engine's process to hand one step's ``SchedulerOutput``
to its worker processes (``executor/multiproc_executor.py`` NOTE 2: one ``pickle.dumps``,
the bytes written to each rank's pipe). The step is a decode step of R running requests
(R = 1, 32, 256: each schedules 1 token and appends no block, the common case; one request
in 16 appends a block, as a request crosses a block boundary every 16 tokens). Two figures
per R, each the median over ``--repeats`` steps after a warm-up:

- ``send_ms``: ``pickle.dumps`` plus one ``send_bytes`` per rank: the engine's cost before
  the workers can start (the goal: <= 0.3 ms at R = 256);
- ``round_trip_ms``: ``send_ms`` plus each rank unpickling it, calling a method that does
  nothing and sending back ``None`` (the non-output ranks' reply), read in rank order: the
  channel's whole latency per step, model excluded.

The ranks run the executor's own ``worker_loop`` over a worker whose ``execute_model`` does
nothing, in processes forked for the bench (no torch needed there).

Part ``memory``: one rank's weight bytes and KV capacity at N = 1, 2 and 4 for the Qwen3-0.6B
shape (hidden 1024, 28 layers, 16 query and 8 KV heads, head_dim 128, intermediate 3072,
vocabulary 151,936, tied embeddings) in bfloat16, with no download and no weights: each rank's
``DecoderForCausalLM`` is built on the meta device with the real sharded layers, the process
seeing itself as that rank (``rank_view``, ``parallel_layers.py`` NOTE 4), and its parameters
counted (the tied embedding once). The goal: N = 2's bytes <= 0.55 of N = 1's. The KV side:
``kv_cache.bytes_per_block`` with the rank's ``kv_heads_per_rank``, and the tokens that fit in
what an 80 GiB GPU at ``gpu_memory_utilization`` 0.9 leaves after the rank's weights, with no
activation term (the worker's profile would take a little more; the figure is an upper bound).

Part ``decode``: ms per decode step on the CPU, N = 1 against N = 2 in the same run, on the
tiny test Qwen3 (``tinyvllm.models.tiny.build_tiny_model``) and the shipped model
(``STDLIB_TINY``), at batch 1 and 8. Three engines: N = 1 with 1 torch thread, N = 1 with 2
threads (one process using both cores), N = 2 with 1 thread per rank. For each repeat, each
batch and each engine in turn (interleaved): B requests of 16 distinct prompt ids, greedy,
``ignore_eos``; one step prefills them all, one more decodes (untimed), then ``--steps``
``llm.engine.step()`` calls are timed and divided; the rest of the requests run out. The
figures are medians over ``--decode-repeats`` (the fastest repeat and every repeat beside
them), after one untimed round. Reported, no goal: the machine has two cores, and three
processes (the engine and two ranks) share them at N = 2.

Part ``async``: async decode steps on two ranks (``async_scheduling=True``, gloo, 1 torch
thread per rank and in the engine's process), and what each costs in messages: for each batch
B, B requests of 16 prompt ids, two untimed steps (prefill, first decode), then ``--steps``
``llm.engine.step()`` calls timed, every one of them launching a decode step and reading the
one before back. Counted over those steps, per step: the messages written to each rank and the
replies read from each, the engine thread's blocking waits (calls of ``multiprocessing``'s
``wait``) and the ms spent in them. The counting wraps the executor's pipes, so it runs on any
version of the executor: ``--baseline-src PATH`` (another checkout's ``src``) runs the same
rounds on that version too. Each round is a child process (one engine, a warm-up round of
every batch, then one timed round); the versions take turns, repeat by repeat (the first of
the two alternating), and the figures are medians over ``--async-repeats``, with every repeat
in the JSON. Reported, no goal: on the CPU a round trip is a small share of a step.

Usage: ``python bench/tensor_parallel.py [--part message|memory|decode|async|all ...] [--quick]
[--out bench/results/tensor_parallel.json]``; a part run alone replaces only its own entry of
the JSON. ``--quick`` runs 50 message repeats, half the decode repeats and one async repeat.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from tinyvllm.core.sched_output import CachedRequestData, SchedulerOutput
from tinyvllm.executor.multiproc_executor import worker_loop

RESULTS = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"
PARTS = ("message", "memory", "decode", "async")


def decode_step(num_reqs: int) -> SchedulerOutput:
    """A decode step of ``num_reqs`` running requests, one token each (module header)."""
    cached = tuple(
        CachedRequestData(f"cmpl-{i:08d}-0", False, (4096 + i,) if i % 16 == 0 else (), 1000 + i) for i in range(num_reqs)
    )
    tokens = {req.req_id: 1 for req in cached}
    return SchedulerOutput((), cached, tokens, num_reqs, frozenset(), frozenset())


class IdleWorker:
    """A worker whose step does nothing: the bench times the channel alone."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        return None


def _rank_main(rank: int, calls, replies) -> None:
    worker_loop(IdleWorker(), rank, calls, replies)


def measure_message(num_ranks: int, sizes: list[int], repeats: int) -> dict:
    context = multiprocessing.get_context("fork")
    procs, calls, replies = [], [], []
    for rank in range(num_ranks):
        call_out, call_in = context.Pipe(duplex=False)
        reply_out, reply_in = context.Pipe(duplex=False)
        proc = context.Process(target=_rank_main, args=(rank, call_out, reply_in), daemon=True)
        proc.start()
        call_out.close()
        reply_in.close()
        procs.append(proc)
        calls.append(call_in)
        replies.append(reply_out)
    by_size = {}
    try:
        for num_reqs in sizes:
            step = decode_step(num_reqs)
            send, round_trip, size = [], [], 0
            for i in range(repeats + repeats // 10):  # the first tenth warms up
                started = time.perf_counter()
                message = pickle.dumps(("execute_model", (step,), {}, 0), protocol=pickle.HIGHEST_PROTOCOL)
                for conn in calls:
                    conn.send_bytes(message)
                sent = time.perf_counter()
                results = [conn.recv() for conn in replies]
                done = time.perf_counter()
                assert all(ok for ok, *_ in results), results
                if i >= repeats // 10:
                    send.append((sent - started) * 1e3)
                    round_trip.append((done - started) * 1e3)
                    size = len(message)
            by_size[str(num_reqs)] = {
                "message_bytes": size,
                "send_ms": round(statistics.median(send), 4),
                "round_trip_ms": round(statistics.median(round_trip), 4),
                "send_ms_p90": round(statistics.quantiles(send, n=10)[-1], 4),
            }
    finally:
        for conn in calls:
            conn.send_bytes(b"")
        for proc in procs:
            proc.join(5)
    return {"num_ranks": num_ranks, "repeats": repeats, "goal_send_ms_at_256": 0.3, "by_num_reqs": by_size}


# -- part memory: one rank's weights and KV capacity, Qwen3-0.6B shape ------------------------

GPU_BYTES = 80 * 1024**3  # an 80 GiB GPU
GPU_MEMORY_UTILIZATION = 0.9
BLOCK_SIZE = 16


def qwen3_0_6b_spec():
    """Qwen3-0.6B's ``config.json`` values as a ``ModelSpec`` (no download)."""
    from tinyvllm.models.loader import ModelSpec

    return ModelSpec(
        architecture="Qwen3ForCausalLM", family="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=40960,
        tie_word_embeddings=True, qk_norm=True, qkv_bias=False, torch_dtype="bfloat16",
    )  # fmt: skip


@contextmanager
def rank_view(world_size: int, rank: int):
    """This process sees itself as ``rank`` of ``world_size`` with no process group behind it:
    enough to build that rank's sharded layers (they ask ``parallel_state`` for the size and
    rank when built, ``parallel_layers.py`` NOTE 4), never to run a collective."""
    from tinyvllm.distributed import parallel_state

    saved = parallel_state._TP
    parallel_state._TP = parallel_state.GroupCoordinator(world_size, rank)
    try:
        yield
    finally:
        parallel_state._TP = saved


def rank_weight_bytes(spec, world_size: int, rank: int, itemsize: int) -> tuple[int, int]:
    """(parameters, bytes) of one rank's model, built on the meta device (nothing allocated)."""
    import torch

    from tinyvllm.models.llama import DecoderForCausalLM

    with rank_view(world_size, rank), torch.device("meta"):
        model = DecoderForCausalLM(spec)
    numel = sum(p.numel() for p in model.parameters())  # a tied embedding is one Parameter, counted once
    return numel, numel * itemsize


def measure_memory(sizes: tuple[int, ...] = (1, 2, 4)) -> dict:
    import torch

    from tinyvllm.distributed.utils import check_tensor_parallel_size, kv_heads_per_rank
    from tinyvllm.worker.kv_cache import bytes_per_block

    spec, dtype = qwen3_0_6b_spec(), torch.bfloat16
    itemsize = torch.empty((), dtype=dtype).element_size()
    budget = int(GPU_BYTES * GPU_MEMORY_UTILIZATION)
    by_size: dict[str, dict] = {}
    for size in sizes:
        check_tensor_parallel_size(size, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size)
        ranks = [rank_weight_bytes(spec, size, rank, itemsize) for rank in range(size)]
        numel, weights = ranks[0]
        assert all(r == ranks[0] for r in ranks), ranks  # every rank holds the same amount
        kv_heads = kv_heads_per_rank(spec.num_key_value_heads, size)
        per_block = bytes_per_block(spec.num_hidden_layers, BLOCK_SIZE, kv_heads, spec.head_dim, dtype)
        blocks = (budget - weights) // per_block
        by_size[str(size)] = {
            "parameters_per_rank": numel, "weight_bytes_per_rank": weights, "kv_heads_per_rank": kv_heads,
            "kv_bytes_per_block_per_rank": per_block, "kv_bytes_per_token_per_rank": per_block // BLOCK_SIZE,
            "kv_blocks_per_rank": blocks, "kv_tokens_per_rank": blocks * BLOCK_SIZE,
        }  # fmt: skip
    one = by_size["1"]
    for entry in by_size.values():
        entry["weight_ratio_to_1"] = round(entry["weight_bytes_per_rank"] / one["weight_bytes_per_rank"], 5)
        entry["kv_tokens_ratio_to_1"] = round(entry["kv_tokens_per_rank"] / one["kv_tokens_per_rank"], 3)
    return {
        "model": "Qwen3-0.6B shape, random weights never made (meta device)", "dtype": "bfloat16",
        "block_size": BLOCK_SIZE, "kv_budget": f"{GPU_MEMORY_UTILIZATION} x 80 GiB less the rank's weights",
        "kv_budget_note": "no activation term: a worker's profile takes some more, so the tokens are an upper bound",
        "goal_weight_ratio_at_2": 0.55, "by_tensor_parallel_size": by_size,
    }  # fmt: skip


# -- part decode: ms per decode step, N = 1 against N = 2 on the CPU ---------------------------

SETUPS = (("tp1_threads1", 1, 1), ("tp1_threads2", 1, 2), ("tp2_threads1_per_rank", 2, 1))
PROMPT_LEN = 16


def _decode_round(llm, tag: str, batch: int, steps: int, torch_threads: int | None) -> float:
    """B requests prefilled and decoded once untimed, then ``steps`` decode steps timed: ms per step."""
    import torch

    from tinyvllm import SamplingParams

    if torch_threads is not None:  # one-rank engines run in this process: their thread count is ours
        torch.set_num_threads(torch_threads)
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 200 + 3 for j in range(PROMPT_LEN)]  # distinct prompts, ids valid in both vocabularies
        llm.engine.add_request(f"{tag}-{i}", prompt, params)
    llm.engine.step()  # every prompt prefilled (the token budget holds them all) and its first token
    llm.engine.step()  # the first decode, untimed
    scheduler = llm.engine.scheduler
    assert len(scheduler.running) == batch and not scheduler.waiting, "the timed steps must decode all B requests"
    started = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    elapsed = time.perf_counter() - started
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return elapsed * 1e3 / steps


def measure_decode(folders: dict[str, str], batches: list[int], steps: int, repeats: int) -> dict:
    import torch

    from tinyvllm import LLM

    models = {}
    for name, folder in folders.items():
        engines = {
            tag: LLM(
                folder, device="cpu", torch_threads=threads, tensor_parallel_size=size, max_model_len=128,
                max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * PROMPT_LEN,
                enable_prefix_caching=False, attention_backend="torch",
            )  # fmt: skip
            for tag, size, threads in SETUPS
        }
        times: dict[str, dict[int, list[float]]] = {tag: {b: [] for b in batches} for tag, _, _ in SETUPS}
        try:
            for rep in range(-1, repeats):  # round -1 warms every engine up, untimed
                for batch in batches:
                    for tag, size, threads in SETUPS:
                        threads_here = threads if size == 1 else None
                        ms = _decode_round(engines[tag], f"{tag}-{rep}-{batch}", batch, steps, threads_here)
                        if rep >= 0:
                            times[tag][batch].append(ms)
        finally:
            for llm in engines.values():
                llm.shutdown()
        spec = engines["tp1_threads1"].spec
        models[name] = {
            "spec": {k: getattr(spec, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "intermediate_size", "vocab_size")},
            "ms_per_step": {
                tag: {str(b): round(statistics.median(v), 3) for b, v in by_batch.items()}
                for tag, by_batch in times.items()
            },
            "ms_per_step_fastest": {  # the repeat the other tenants of a shared machine disturbed least
                tag: {str(b): round(min(v), 3) for b, v in by_batch.items()} for tag, by_batch in times.items()
            },
            "ms_per_step_all_repeats": {
                tag: {str(b): [round(x, 3) for x in v] for b, v in by_batch.items()} for tag, by_batch in times.items()
            },
        }  # fmt: skip
        ms = models[name]["ms_per_step"]
        models[name]["tp2_over_tp1"] = {
            one: {str(b): round(ms["tp2_threads1_per_rank"][str(b)] / ms[one][str(b)], 3) for b in batches}
            for one in ("tp1_threads1", "tp1_threads2")
        }  # > 1: N = 2 is slower
    return {
        "goal": None,
        "goal_note": "reported, no goal: two CPU cores, shared at N = 2 by the engine process and two ranks",
        "setups": {tag: {"tensor_parallel_size": n, "torch_threads_per_rank": t} for tag, n, t in SETUPS},
        "engine_torch_threads_at_end": torch.get_num_threads(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],  # the start's is in "run"
        "batches": batches, "steps_timed": steps, "repeats": repeats, "prompt_len": PROMPT_LEN,
        "attention_backend": "torch", "dtype": "float32", "models": models,
    }  # fmt: skip


# -- part async: async steps on two ranks, their messages and waits --------------------------


def count_traffic(executor) -> dict:
    """Wrap ``executor``'s pipes and its module's ``wait`` so that every message written to a
    rank, every reply read and every blocking wait of the engine's thread (and its time) is
    counted; works on any version that keeps ``_calls``, ``_replies`` and ``wait``."""
    import tinyvllm.executor.multiproc_executor as mp

    counts = {"messages": 0, "replies": 0, "waits": 0, "wait_s": 0.0}

    def counted(method, key: str):
        def call(*args, **kwargs):
            counts[key] += 1
            return method(*args, **kwargs)

        return call

    for conn in executor._calls:
        conn.send_bytes = counted(conn.send_bytes, "messages")
    for conn in executor._replies:
        conn.recv = counted(conn.recv, "replies")
    wait = mp.wait

    def timed_wait(*args, **kwargs):
        started = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            counts["waits"] += 1
            counts["wait_s"] += time.perf_counter() - started

    mp.wait = timed_wait  # the monitor thread is already inside its own wait: not counted
    return counts


def async_child(folder: str, batches: list[int], steps: int) -> dict:
    """One engine (two ranks, async scheduling), a warm-up round of every batch, then one timed
    round: per batch, ms per step and the traffic per step (module header)."""
    import torch

    from tinyvllm import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(
        folder, device="cpu", torch_threads=1, tensor_parallel_size=2, async_scheduling=True, max_model_len=128,
        max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * PROMPT_LEN, enable_prefix_caching=False,
        attention_backend="torch",
    )  # fmt: skip
    counts, ranks = count_traffic(llm.engine.model_executor), 2
    engine, result = llm.engine, {}
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    try:
        for timed_round in (False, True):
            for batch in batches:
                for i in range(batch):
                    engine.add_request(f"{timed_round}-{batch}-{i}", [(7 * i + j) % 200 + 3 for j in range(PROMPT_LEN)], params)
                engine.step()  # the prefill, launched
                engine.step()  # the first decode launched, the prefill read back
                assert len(engine.scheduler.running) == batch, "the timed steps must decode all B requests"
                before = dict(counts)
                started = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                elapsed = time.perf_counter() - started
                per_step = {k: (counts[k] - before[k]) / steps for k in counts}
                while engine.has_unfinished_requests():
                    engine.step()
                if timed_round:
                    result[str(batch)] = {
                        "ms_per_step": elapsed * 1e3 / steps,
                        "messages_per_step_per_rank": per_step["messages"] / ranks,
                        "replies_per_step_per_rank": per_step["replies"] / ranks,
                        "waits_per_step": per_step["waits"], "wait_ms_per_step": per_step["wait_s"] * 1e3,
                    }  # fmt: skip
    finally:
        llm.shutdown()
    return {"engine_torch_threads": torch.get_num_threads(), "by_batch": result}


def _tree(src: Path) -> dict:
    """Which code a version ran: its checkout's commit and whether it had changes."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else "?"

    return {"src": str(src), "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "."))}


def measure_async(folder: str, batches: list[int], steps: int, repeats: int, baseline_src: Path | None) -> dict:
    here = Path(__file__).resolve().parents[1] / "src"
    versions = {"this": here, **({"baseline": baseline_src.resolve()} if baseline_src else {})}
    rounds: dict[str, list[dict]] = {label: [] for label in versions}
    for rep in range(repeats):
        order = list(versions) if rep % 2 == 0 else list(reversed(versions))  # each goes first half the time
        for label in order:
            env = {**os.environ, "PYTHONPATH": str(versions[label]), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, __file__, "--async-child", json.dumps([folder, batches, steps])]
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"the {label} round failed:\n{done.stderr[-3000:]}")
            rounds[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
    by_version = {}
    for label, runs in rounds.items():
        by_batch = {}
        for b in map(str, batches):
            figures = [run["by_batch"][b] for run in runs]
            by_batch[b] = {key: round(statistics.median(f[key] for f in figures), 3) for key in figures[0]}
            by_batch[b]["ms_per_step_all_repeats"] = [round(f["ms_per_step"], 3) for f in figures]
        by_version[label] = {**_tree(versions[label]), "engine_torch_threads": runs[0]["engine_torch_threads"], "by_batch": by_batch}
    record = {
        "goal": None, "goal_note": "reported, no goal: on the CPU a round trip is a small share of a step",
        "tensor_parallel_size": 2, "torch_threads_per_rank": 1, "backend": "gloo", "batches": batches,
        "steps_timed": steps, "repeats": repeats, "prompt_len": PROMPT_LEN, "versions": by_version,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    if "baseline" in by_version:
        record["baseline_ms_over_this"] = {
            b: round(by_version["baseline"]["by_batch"][b]["ms_per_step"] / by_version["this"]["by_batch"][b]["ms_per_step"], 3)
            for b in map(str, batches)
        }  # > 1: this version's steps are faster
    return record


def decode_folders(names: list[str], tiny_model: str | None, tmp: Path) -> dict[str, str]:
    folders = {}
    if "tiny_qwen3" in names:
        from tinyvllm.models.tiny import build_tiny_model

        folders["tiny_qwen3"] = tiny_model or str(build_tiny_model(tmp / "qwen3", "qwen3"))
    if "stdlib_tiny" in names:
        from tinyvllm.stdlib_tiny import STDLIB_TINY

        folders["stdlib_tiny"] = STDLIB_TINY
    return folders


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], action="append", help="the parts to run (default: all)")
    parser.add_argument("--ranks", type=int, default=2, help="message: the worker processes")
    parser.add_argument("--repeats", type=int, default=2000, help="message: steps per size")
    parser.add_argument("--decode-repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=32, help="decode: steps timed per round")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    models = ["tiny_qwen3", "stdlib_tiny"]
    parser.add_argument("--models", nargs="+", choices=models, default=models, help="decode: the models")
    parser.add_argument("--tiny-model", help="decode: a tiny qwen3 folder already built (default: build one)")
    parser.add_argument("--async-repeats", type=int, default=8, help="async: rounds per version")
    parser.add_argument("--async-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--baseline-src", type=Path, help="async: another checkout's src/, run in turns with this one")
    parser.add_argument("--async-child", help=argparse.SUPPRESS)  # one async round, in a child process
    parser.add_argument("--quick", action="store_true", help="fewer repeats: checks the code paths, not the speed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.async_child:
        print(json.dumps(async_child(*json.loads(args.async_child))))
        return {}
    parts = [p for p in PARTS if not args.part or "all" in args.part or p in args.part]
    record: dict = {"parts": {}}
    if args.out.exists():  # a part run alone keeps the others' figures
        record["parts"] = json.loads(args.out.read_text(encoding="utf-8")).get("parts", {})
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    if "message" in parts:  # first: its ranks are forked before this process starts torch's threads
        record["parts"]["message"] = measure_message(args.ranks, [1, 32, 256], 50 if args.quick else args.repeats)
    from harness import run_header  # imports torch

    header = {**run_header("tensor_parallel.py", argv), "quick": args.quick}
    header["machine"]["load_average_at_start"] = load_at_start  # before the first part, not after it
    if "message" in parts:
        record["parts"]["message"]["run"] = header
    if "memory" in parts:
        record["parts"]["memory"] = {**measure_memory(), "run": header}
    if "decode" in parts:
        repeats = max(1, args.decode_repeats // 2) if args.quick else args.decode_repeats
        with tempfile.TemporaryDirectory() as tmp:
            folders = decode_folders(args.models, args.tiny_model, Path(tmp))
            record["parts"]["decode"] = {**measure_decode(folders, args.batches, args.steps, repeats), "run": header}
    if "async" in parts:
        repeats = 1 if args.quick else args.async_repeats
        with tempfile.TemporaryDirectory() as tmp:
            folder = decode_folders(["tiny_qwen3"], args.tiny_model, Path(tmp))["tiny_qwen3"]
            measured = measure_async(folder, args.async_batches, args.steps, repeats, args.baseline_src)
            record["parts"]["async"] = {**measured, "model": "tiny_qwen3", "run": header}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({p: {k: v for k, v in record["parts"][p].items() if k != "run"} for p in parts}, indent=2))
    return record


if __name__ == "__main__":
    main()
