"""Benchmark: tensor parallelism (issue 38).

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
nothing, in processes forked for the bench (no torch needed there). Later parts (per-rank
weight bytes and KV capacity at N = 1 / 2 for the Qwen3-0.6B shape; decode step time N = 1
against N = 2 on the CPU) go beside this one.

Usage: ``python bench/tensor_parallel.py [--part message] [--ranks 2] [--repeats 2000]
[--quick] [--out bench/results/tensor_parallel.json]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import platform
import statistics
import time
from pathlib import Path

from tinyvllm.core.sched_output import CachedRequestData, SchedulerOutput
from tinyvllm.executor.multiproc_executor import worker_loop

RESULTS = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"


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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["message"], action="append", help="the parts to run (default: all)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="a few repeats: checks the code paths, not the speed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    parts = args.part or ["message"]
    repeats = 50 if args.quick else args.repeats
    record: dict = {"quick": args.quick, "machine": platform.processor() or platform.machine(), "parts": {}}
    if "message" in parts:
        record["parts"]["message"] = measure_message(args.ranks, [1, 32, 256], repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(record["parts"], indent=2))
    return record


if __name__ == "__main__":
    main()
