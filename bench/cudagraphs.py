"""Benchmark: decode latency and throughput under each CUDA-graph mode, against eager (NONE).

What it measures (seed 000, vLLM's "CUDA Graphs" design doc): for each of the five
``cudagraph_mode`` settings (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE)
one ``LLM`` is built (Triton attention backend, which supports full graphs of any batch,
so no mode is downgraded) and measured twice:

- **Per-step decode latency** at batch 1, 8, 32 and 128. B requests with 32-token random
  prompts are added with ``llm.engine.add_request``; the engine is stepped until every one
  of them is in decode (the last step was a uniform decode of B requests), then 3 more
  untimed warm-up steps run, then 5 repeats of 20 ``llm.engine.step()`` calls each are
  timed with the wall clock, ``torch.cuda.synchronize()`` before and after each timed
  repeat. Reported: the median seconds per step over the repeats, B / that (tokens/s),
  and the speed-up against NONE at the same B (NONE's median / the mode's median). The
  remaining requests are then aborted (``llm.engine.abort_request``) before the next B.
- **Where a decode step's time goes** (NONE and FULL_AND_PIECEWISE, the baseline and the
  default, at every batch): ``profile_steps`` more steps under ``torch.profiler``; the
  device's busy time per step (kernels and copies, overlaps counted once), its share of
  the median step (``device_busy_share``: below 1, the device waits for the host for the
  rest), the idle gaps between its ops binned by length (``device_idle_gaps``: a FULL
  graph's kernels back to back leave µs-long gaps, a host-bound step one long gap), and
  the eight operations that take most of it. The profiler slows the host, so
  the share is read against the unprofiled median. Measured on a GPU only: on the CPU the
  same code runs with nothing on a device to count. Then as many steps again with the
  host's clock on each phase (``host_phases``: scheduling, the runner's state, the
  inputs and the graph's launch, the LM head, the sampler, the rest of ``execute_model``
  where the host waits for the device, ``update_from_output``, the engine's rest), and
  the forward's own parts (``forward_parts_ms``: the step's index lists, the input
  buffers' fill and their one copy up, block table rows included, and the rest, the
  model's or the graph's launch), and the decode step's FULL graph replayed alone
  (``replay_probe``: the host's time of one replay with the device idle and with replays
  queued, beside the device's time a replay: whether the graph's launch itself costs the host
  what the step's device time is). With async scheduling (``--async-ab``) the host waits for the device
  inside the next step, which that clock cannot split; those steps run under ``cProfile``
  instead (``host_profile``): the 25 functions with the most host time of their own, per
  step (``host_top_functions_async``), the profile to read when the device idles. With
  ``--pdl-ab`` too, the async run once more with the step's Triton kernels launched
  dependent (``TINYVLLM_PDL=1``, ``dependent_launch.py``; sm_90 or later): its step time,
  busy share and idle gaps beside the async run's (``pdl_ab``). With ``--greedy-ab``, the async
  run once more with the greedy draw as torch ops (``TINYVLLM_GREEDY=torch``): the one-kernel
  draw's speed-up (``greedy_ab``).
- **The mixed-step A/B** (FULL_AND_PIECEWISE, which replays a mixed batch PIECEWISE, and
  FULL, which replays it in a FULL graph; the Triton backend allows both): at each batch B
  where B + 32 tokens fit the largest capture size, with the B requests still in decode,
  ``mixed_steps`` times pairs of single steps (synchronised): a uniform decode of the B,
  then the same B decodes with one new request's 32-token random prompt (aborted after
  that step), after 2 untimed pairs (new kernel specializations compile), 30 pairs in all.
  ``mixed_ab`` puts the two modes' medians side by side (``piecewise_over_full``) and each
  against the decode step of the same batch: one run decides whether mixed batches should
  replay FULL graphs by default. In FULL_AND_PIECEWISE each pair gets a third step, a
  mixed one with ``TINYVLLM_TRITON_LAUNCH=prebound`` (``piecewise_jit_over_prebound``:
  what launching the compiled attention kernel directly saves, ``triton_attention.py``
  NOTE 5); if it raises, the error is recorded and the A/B ends there.
- **Throughput**: a smaller version of nano-vllm's workload (``make_workload`` from
  ``bench/throughput.py``: 64 requests, prompts of 100-512 random ids, 100-256 output
  tokens, ``ignore_eos``, greedy) through ``llm.generate``; output tokens/s and the ratio
  against NONE.

Every figure is also reported as a ratio against NONE measured in the same run (the
README's rule); absolute times are only meaningful on a GPU, and the JSON names the
device. The **stats check**: ``model_runner.cudagraph_stats`` is read before and after
each timed region, and every timed step must have run in the runtime mode the setting
implies at decode: NONE for NONE, PIECEWISE for PIECEWISE, FULL for FULL,
FULL_DECODE_ONLY and FULL_AND_PIECEWISE (a graph that silently fell back to eager would
otherwise look like "no speed-up"); every timed mixed step ran PIECEWISE, or FULL. The script exits 1 when a check fails.

Set-up: the Qwen3-0.6B-shaped random-weight folder of ``bench/throughput.py``
(``build_model_folder``, bf16), ``max_num_seqs=128``, capture sizes 1, 2, 4, ..., 128,
``max_model_len=1024``, block size 16, and a fixed KV pool (``num_gpu_blocks_override``),
so that start-up does no memory profiling and no trial capture. ``startup_s`` is the
``LLM(...)`` construction: weight loading, warm-up and graph capture; NONE captures
nothing, so a mode's ``startup_s`` minus NONE's is its capture cost (plus any Triton
compilation the earlier modes did not already do).

Time budget: ``gpu.sh``'s run (batches 1 and 32, no throughput) took 32 s on an H100,
model reuse included, before the profile was added, 34 s on an H200 with it; it allows
60 s. Hence 5 repeats of 20 steps per point and a 64-request workload; the mixed-step A/B
adds, at 2 batches, 32 pairs of steps (FULL) and 32 triplets (FULL_AND_PIECEWISE): 320
steps, about 4 s at PIECEWISE's 10 ms a mixed step. The JSON is rewritten after
every mode (``"complete": false`` until the end), so a run cut short keeps what it measured.

Run on a GPU: ``python3 bench/cudagraphs.py`` (writes
``bench/results/cudagraphs-<device>.json``). ``--dry-run`` runs every code path on the
CPU with the tiny Qwen3 model, the Triton kernels under the interpreter
(``TRITON_INTERPRET=1``), batches 1 and 2, no warm-up step and one repeat of 2 timed
steps (one repeat and no warm-up since the mixed-step A/B came, so that the run takes no
longer than before it), one timed mixed pair (triplet) of a 3-token prompt (at batch 1
only: 2 + 3 tokens pass capture size 4), capture sizes 1, 2, 4; CUDA graphs are then emulated (correct, never faster), so the stats check still
means something but its timings mean nothing. The test suite runs it (about 35 s on two
cores). Without CUDA and without ``--dry-run`` it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from harness import shared_model_folder  # noqa: E402
from throughput import build_model_folder, make_workload, sync  # noqa: E402  (sibling script)

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]  # NONE first: the baseline
EXPECTED_DECODE_MODE = {"NONE": "NONE", "PIECEWISE": "PIECEWISE", "FULL": "FULL",
                        "FULL_DECODE_ONLY": "FULL", "FULL_AND_PIECEWISE": "FULL"}  # fmt: skip
PROFILED_MODES = ("NONE", "FULL_AND_PIECEWISE")  # the baseline and the default: where a step's time goes
# The mixed-step A/B: the default replays a mixed batch PIECEWISE, FULL replays it in a FULL graph.
EXPECTED_MIXED_MODE = {"FULL_AND_PIECEWISE": "PIECEWISE", "FULL": "FULL"}
FULL = dict(
    batch_sizes=[1, 8, 32, 128], prompt_len=32, warmup_steps=3, timed_steps=20, repeats=5, profile_steps=10,
    capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128], max_num_seqs=128, max_model_len=1024, block_size=16,
    num_gpu_blocks=4096, dtype="bfloat16", mixed=dict(prompt_len=32, warmup=2, steps=30),
    throughput=dict(num_seqs=64, max_input_len=512, max_output_len=256, min_len=100, max_id=10000),
)  # fmt: skip
DRY = dict(
    batch_sizes=[1, 2], prompt_len=8, warmup_steps=0, timed_steps=2, repeats=1, profile_steps=2,
    capture_sizes=[1, 2, 4], max_num_seqs=4, max_model_len=64, block_size=16,
    num_gpu_blocks=64, dtype="auto", mixed=dict(prompt_len=3, warmup=0, steps=1),
    throughput=dict(num_seqs=4, max_input_len=24, max_output_len=12, min_len=4, max_id=500),
)  # fmt: skip


def stats_delta(runner, before) -> dict[str, int]:
    """Steps executed since ``before`` (a copy of ``cudagraph_stats``), by runtime-mode name."""
    return {mode.name: n for mode, n in (runner.cudagraph_stats - before).items()}


def num_graphs(runner) -> dict[str, int]:
    """Graphs the runner's wrappers hold: FULL entries, and PIECEWISE entries over all pieces."""
    full = len(runner.full_graph.entries) if runner.full_graph is not None else 0
    piecewise = sum(len(p.entries) for p in runner.model.pieces if hasattr(p, "entries"))
    return {"FULL": full, "PIECEWISE": piecewise}


# --8<-- [start:profile]
def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length the ``(start, end)`` intervals cover together: the device's busy time,
    where overlapping kernels count once."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


# The idle gaps between the device's ops, binned by length (µs): a graph's kernels back to back
# leave gaps of a few µs each, the host's launches one by one ~5-20 µs, a host-bound step
# one long gap. Binned, the histogram says which of these the idle share of a step is.
GAP_BINS_US = (2.0, 5.0, 20.0, 100.0)


def _gap_labels() -> list[str]:
    edges = ["0", *(f"{b:g}" for b in GAP_BINS_US)]
    return [f"<{edges[1]}us", *(f"{a}-{b}us" for a, b in zip(edges[1:], edges[2:])), f">={edges[-1]}us"]


def idle_gaps(intervals: list[tuple[float, float]], steps: int) -> dict[str, dict[str, float]]:
    """The gaps between the device's busy intervals (µs; overlaps merged first, as in
    ``union_length``), binned by ``GAP_BINS_US``: per step, how many gaps and their µs."""
    labels = _gap_labels()
    bins = {label: {"count": 0.0, "us": 0.0} for label in labels}
    reached = None
    for start, end in sorted(intervals):
        if reached is not None and start > reached:
            gap = start - reached
            label = labels[sum(gap >= edge for edge in GAP_BINS_US)]
            bins[label]["count"] += 1 / steps
            bins[label]["us"] += gap / steps
        reached = end if reached is None else max(reached, end)
    return bins


def profile_steps(engine, steps: int, median_step_s: float) -> dict:
    """Where a decode step's time goes: ``steps`` more ``engine.step()`` calls under
    ``torch.profiler``. On a GPU: the device's busy time per step (its kernels and copies,
    overlaps counted once), that time's share of the unprofiled median step (the rest of
    the step the device waits for the host), the idle gaps between its ops by length
    (``idle_gaps``: a graph's own gaps or the host's), and the operations that take most of it."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in device]  # µs
    busy = union_length(intervals) / 1e6 / steps
    by_name: dict[str, float] = {}
    for e in device:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return dict(
        steps=steps, device_ops_per_step=len(device) / steps,
        device_busy_s_per_step=busy if on_gpu else None,
        device_busy_share=busy / median_step_s if on_gpu else None,
        device_idle_gaps=idle_gaps(intervals, steps) if on_gpu else None,
        top_device_ops=[dict(name=name[:160], us_per_step=us / steps) for name, us in top],
    )  # fmt: skip


def host_phases(llm, steps: int) -> dict:
    """The step's wall time by phase, over ``steps`` more steps, with the host's clock and
    no synchronisation added (``bookkeeping.py``'s ``StepClock`` hooks). ``forward`` is
    the inputs' upload and the graph's launch, not the device's work; the host first waits
    for the device in ``execute_model_rest``, which reads the sampled ids."""
    from bookkeeping import StepClock  # here: it imports tinyvllm, after main() set the interpreter

    from tinyvllm.worker import model_runner as runner_module

    engine, runner = llm.engine, llm.engine.model_runner
    hooks = {"schedule": (engine.scheduler, "schedule"), "execute_model": (runner, "execute_model"),
             "update_states": (runner, "_update_states"), "forward": (runner, "_forward"),
             "logits": (runner.model, "compute_logits"), "sample": (runner, "sampler"),
             "update_from_output": (engine.scheduler, "update_from_output"),
             # inside forward: the inputs, in two parts; the rest of it is the model or graph's launch
             "step_inputs": (runner_module, "build_step_inputs"),
             "buffers_fill": (runner.buffers, "fill")}  # fmt: skip
    forward_parts = ("step_inputs", "buffers_fill")
    clock = StepClock()
    own = {name: vars(owner).get(attr) for name, (owner, attr) in hooks.items()}  # None: a method of the class
    for name, (owner, attr) in hooks.items():
        setattr(owner, attr, clock.wrap(name, getattr(owner, attr)))
    try:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    finally:
        for name, (owner, attr) in hooks.items():
            if own[name] is None:
                delattr(owner, attr)  # the class's method again
            else:
                setattr(owner, attr, own[name])
    ms = {name: seconds / steps * 1e3 for name, seconds in clock.take().items()}
    parts = {name: ms.pop(name, 0.0) for name in forward_parts}
    parts["launch"] = ms.get("forward", 0.0) - sum(parts.values())
    inside = ("update_states", "forward", "logits", "sample")
    ms["execute_model_rest"] = ms.pop("execute_model") - sum(ms.get(k, 0.0) for k in inside)
    ms["engine_rest"] = wall / steps * 1e3 - ms["execute_model_rest"] - sum(
        ms.get(k, 0.0) for k in (*inside, "schedule", "update_from_output"))
    return {"step_ms": wall / steps * 1e3, "phases_ms": ms, "forward_parts_ms": parts}
# --8<-- [end:profile]


def host_profile(engine, steps: int, top: int = 25) -> dict:
    """``steps`` more steps under ``cProfile``: the host's functions that take most of its own
    time (``tottime``), per step, with their cumulative time and calls. For async scheduling,
    whose steps ``host_phases`` cannot clock (the device is waited for inside the next step):
    when the device idles part of a step, this is where the host spends it. cProfile slows
    the host (every Python call is timed), so the figures are shares, not the step's time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, tottime, cumtime, callers)}
    total = sum(entry[2] for entry in stats.values())
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return dict(
        host_profile_steps=steps, host_profile_us_per_step=total / steps * 1e6,
        host_top_functions=[
            dict(function=f"{Path(file).name}:{line}({name})" if line else name, calls_per_step=calls / steps,
                 tottime_us_per_step=tottime / steps * 1e6, cumtime_us_per_step=cumtime / steps * 1e6)
            for (file, line, name), (_, calls, tottime, cumtime, _) in rows
        ],
    )  # fmt: skip


def replay_probe(runner, repeats: int = 20) -> dict | None:
    """The last step's FULL graph replayed alone, ``repeats`` times each way: the host's time of
    one ``replay()`` with the device idle (synchronised before each), and with the replays
    queued back to back, then the device's time a replay over that queue. A launch that costs
    the host as much as the device's whole replay, or that blocks while one is queued, shows
    here. The replay redoes the last step's work on the same inputs (the same KV writes).
    None when the last step ran no FULL graph; on the CPU the emulated replay runs the model."""
    from tinyvllm.config import CUDAGraphMode

    last, wrapper = runner.last_dispatch, runner.full_graph
    if wrapper is None or last is None or last.runtime_mode != CUDAGraphMode.FULL:
        return None
    entry = wrapper.entries[last.batch_descriptor]
    replay = entry.graph.replay if entry.graph is not None else (lambda: wrapper._replay(entry))
    idle = []
    with torch.inference_mode():  # as the runner replays (the emulated replay writes inference tensors)
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            replay()
            idle.append(time.perf_counter() - start)
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            replay()
        queued = time.perf_counter() - start
        sync()
        device = time.perf_counter() - start
    return {"host_us_idle": statistics.median(idle) * 1e6, "host_us_queued": queued / repeats * 1e6,
            "wall_us_per_replay_queued": device / repeats * 1e6, "emulated": entry.graph is None}  # fmt: skip


def timed_step(engine) -> float:
    """Seconds one ``engine.step()`` took, the device synchronised on both sides."""
    sync()
    start = time.perf_counter()
    engine.step()
    sync()
    return time.perf_counter() - start


def mixed_steps(llm, batch: int, cfg: dict, expected_mixed: str) -> dict:
    """The mixed-step A/B (module header): with ``batch`` requests in decode, a uniform decode
    of the batch, then one more request's ``prompt_len``-token prompt with the batch's decodes
    (the new request aborted after it), each step timed alone; where the mixed step runs
    PIECEWISE, a third step like the second with ``TINYVLLM_TRITON_LAUNCH=prebound``
    (``triton_attention.py`` NOTE 5: read at each step's plan)."""
    from tinyvllm import SamplingParams
    from tinyvllm.attention.triton_attention import LAUNCH_ENV

    engine, runner, m = llm.engine, llm.engine.model_runner, cfg["mixed"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    rng = random.Random(1000 + batch)
    vocab = min(llm.spec.vocab_size, 10000)
    kinds = ("decode", "mixed", "mixed_prebound") if expected_mixed == "PIECEWISE" else ("decode", "mixed")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    modes: dict[str, dict[str, int]] = {kind: {} for kind in kinds}
    mixed_key, prebound_error = None, None

    def step(kind: str, i: int) -> tuple[float, object]:
        if kind == "decode":
            return timed_step(engine), runner.last_dispatch
        rid = f"{kind}-{batch}-{i}"  # a fresh random prompt: no prefix-cache hit
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(m["prompt_len"])], params)
        if kind == "mixed_prebound":
            os.environ[LAUNCH_ENV] = "prebound"
        try:
            seconds = timed_step(engine)
        finally:
            os.environ.pop(LAUNCH_ENV, None)
        engine.abort_request([rid])
        return seconds, runner.last_dispatch

    for i in range(m["warmup"] + m["steps"]):
        for kind in kinds:
            try:
                seconds, dispatch = step(kind, i)
            except Exception as error:  # a failed step aborts the batch too: the A/B ends here
                if kind != "mixed_prebound":
                    raise
                prebound_error = repr(error)
                break
            if kind == "decode":
                assert dispatch.uniform_decode and dispatch.num_reqs == batch, f"batch {batch}: not a decode: {dispatch}"
            else:
                assert dispatch.num_tokens == batch + m["prompt_len"] and not dispatch.uniform_decode, dispatch
                mixed_key = dispatch.batch_descriptor._asdict()
            if i >= m["warmup"]:  # the first calls compile new kernel specializations
                times[kind].append(seconds)
                modes[kind][dispatch.runtime_mode.name] = modes[kind].get(dispatch.runtime_mode.name, 0) + 1
        if prebound_error:
            break
    median = {kind: statistics.median(t) if t else None for kind, t in times.items()}
    found = dict(
        prompt_len=m["prompt_len"], steps=m["steps"], mixed_step_s=median["mixed"], decode_step_s=median["decode"],
        mixed_over_decode=median["mixed"] / median["decode"], runtime_modes=modes, mixed_batch_descriptor=mixed_key,
        stats_ok=modes["mixed"] == {expected_mixed: m["steps"]},
    )  # fmt: skip
    if "mixed_prebound" in kinds:
        prebound = median["mixed_prebound"]
        found |= dict(mixed_prebound_step_s=prebound, prebound_error=prebound_error,
                      jit_over_prebound=median["mixed"] / prebound if prebound else None)  # fmt: skip
        found["stats_ok"] &= modes["mixed_prebound"] == {expected_mixed: m["steps"]}
    return found


def decode_latency(
    llm, batch: int, cfg: dict, expected: str, profiled: bool = False, mixed: str | None = None, host_clock: bool = True
) -> dict:
    """Median seconds per decode step with ``batch`` requests in decode (module header);
    with ``profiled``, also ``profile_steps``' record of the device's share."""
    from tinyvllm import SamplingParams

    engine, runner = llm.engine, llm.engine.model_runner
    steps = cfg["warmup_steps"] + cfg["repeats"] * cfg["timed_steps"] + 2 * cfg["profile_steps"]
    steps += 3 * (cfg["mixed"]["warmup"] + cfg["mixed"]["steps"]) if mixed else 0
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 8)  # never finishes while timed
    rng = random.Random(batch)
    vocab = min(llm.spec.vocab_size, 10000)
    ids = [f"latency-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(cfg["prompt_len"])], params)
    steps_to_decode = 0
    while True:  # until the last step was one uniform decode of every request (prefill done)
        engine.step()
        steps_to_decode += 1
        last = runner.last_dispatch
        if last.uniform_decode and last.num_reqs == batch:
            break
        if steps_to_decode > 64:
            raise RuntimeError(f"batch {batch}: not all requests reached decode after {steps_to_decode} steps")
    for _ in range(cfg["warmup_steps"]):
        engine.step()
    gc.collect()
    before = runner.cudagraph_stats.copy()
    times = []
    for _ in range(cfg["repeats"]):
        sync()
        start = time.perf_counter()
        for _ in range(cfg["timed_steps"]):
            engine.step()
        sync()
        times.append((time.perf_counter() - start) / cfg["timed_steps"])
    used = stats_delta(runner, before)
    last = runner.last_dispatch
    assert last.num_reqs == batch and last.uniform_decode, f"batch {batch}: the batch changed while timed: {last}"
    median = statistics.median(times)
    profile = None
    if profiled:
        profile = profile_steps(engine, cfg["profile_steps"], median)
        if host_clock:  # the step's host phases (bookkeeping.py's clock follows the synchronous step)
            profile |= host_phases(llm, cfg["profile_steps"])
            profile["replay_probe"] = replay_probe(runner)  # the graph's launch alone, idle and queued
        else:  # async scheduling: the host is the step's critical path when the device waits; where it goes
            profile |= host_profile(engine, cfg["profile_steps"])
    # the mixed-step A/B, on the same requests, where a mixed batch of this size has a graph
    mixed_ab = mixed_steps(llm, batch, cfg, mixed) if mixed and has_mixed_graph(batch, cfg) else None
    engine.abort_request(ids)
    timed = cfg["repeats"] * cfg["timed_steps"]
    return dict(
        batch=batch, median_step_s=median, step_s_per_repeat=times, tok_per_s=batch / median,
        steps_to_decode=steps_to_decode, timed_steps=timed, runtime_modes_timed=used,
        batch_descriptor=last.batch_descriptor._asdict(),
        stats_ok=used == {expected: timed} and (mixed_ab is None or mixed_ab["stats_ok"]), profile=profile,
        mixed=mixed_ab,
    )  # fmt: skip


def has_mixed_graph(batch: int, cfg: dict) -> bool:
    """Whether the mixed step of ``batch`` decodes and one prompt fits the largest capture size."""
    return batch + cfg["mixed"]["prompt_len"] <= max(cfg["capture_sizes"])


def throughput(llm, cfg: dict, expected: str) -> dict:
    """Output tokens/s of ``llm.generate`` on the smaller nano-vllm workload."""
    from tinyvllm import SamplingParams

    w = cfg["throughput"]
    prompts, max_tokens = make_workload(w["num_seqs"], w["max_input_len"], w["max_output_len"],
                                        min_len=w["min_len"], max_id=w["max_id"])  # fmt: skip
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in max_tokens]
    runner = llm.engine.model_runner
    before = runner.cudagraph_stats.copy()
    gc.collect()
    sync()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(max_tokens), f"{tokens} tokens generated, {sum(max_tokens)} asked for"
    used = stats_delta(runner, before)
    # Mixed (prefill) steps may run in other modes; the decode mode must have been used, and
    # NONE must not have run a single graph.
    ok = set(used) == {"NONE"} if expected == "NONE" else used.get(expected, 0) > 0
    return dict(requests=len(prompts), output_tokens=tokens, seconds=seconds, tok_per_s=tokens / seconds,
                runtime_modes=used, stats_ok=ok)  # fmt: skip


def measure_mode(
    folder: Path, mode: str, cfg: dict, device: str, profile: bool = True, async_scheduling: bool = False
) -> dict:
    from tinyvllm import LLM

    sync()
    start = time.perf_counter()
    llm = LLM(
        str(folder), dtype=cfg["dtype"], device=device, max_model_len=cfg["max_model_len"],
        block_size=cfg["block_size"], num_gpu_blocks_override=cfg["num_gpu_blocks"],
        max_num_seqs=cfg["max_num_seqs"], attention_backend="triton",
        compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": cfg["capture_sizes"]},
        async_scheduling=async_scheduling,
    )  # fmt: skip
    sync()
    startup = time.perf_counter() - start
    runner = llm.engine.model_runner
    resolved = runner.cudagraph_mode.name
    expected = EXPECTED_DECODE_MODE[mode]
    graphs = num_graphs(runner)
    profiled = profile and mode in PROFILED_MODES
    # the mixed-step A/B times single steps: not in kernel_ab's runs (profile=False) nor under async scheduling
    mixed = EXPECTED_MIXED_MODE.get(mode) if profile and not async_scheduling else None
    latency = [decode_latency(llm, b, cfg, expected, profiled=profiled, mixed=mixed, host_clock=not async_scheduling)
               for b in cfg["batch_sizes"]]  # fmt: skip
    tput = throughput(llm, cfg, expected) if cfg["throughput"] else None
    del llm, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(
        mode=mode, resolved_mode=resolved, expected_decode_runtime_mode=expected, startup_s=startup,
        graphs_captured=graphs, latency=latency, throughput=tput,
        stats_ok=resolved == mode and all(r["stats_ok"] for r in latency) and (tput is None or tput["stats_ok"]),
    )  # fmt: skip


# The one-kernel forms an A/B can switch back: record key -> (environment variable, the value
# that turns the kernel off: torch ops, or the KV write apart from Qwen3's norms and rotary).
KERNEL_AB = {"rms_norm_ab": ("TINYVLLM_RMS_NORM", "torch"), "rotary_ab": ("TINYVLLM_ROTARY", "torch"),
             "silu_and_mul_ab": ("TINYVLLM_SILU_AND_MUL", "torch"),
             "fused_kv_write_ab": ("TINYVLLM_FUSED_KV_WRITE", "0")}  # fmt: skip
KERNEL_AB_WHAT = {"rms_norm_ab": "norms as torch ops", "rotary_ab": "rotary as torch ops",
                  "silu_and_mul_ab": "the MLP's silu and multiply as torch ops",
                  "fused_kv_write_ab": "the KV write as its own kernel"}  # fmt: skip


def kernel_ab(folder: Path, cfg: dict, device: str, with_kernel: dict, env: str, value: str = "torch") -> dict:
    """FULL_AND_PIECEWISE once more with ``env=value`` (every RMSNorm as torch ops,
    ``models/rms_norm.py``, or every rotary, ``models/rotary.py``, ...), against the same mode's
    run with the default: the step time the one kernel saves, in the same run. (On the CPU
    the torch ops run both ways, but for the fused KV write, which needs the kernels.)"""
    os.environ[env] = value
    try:
        torch_ops = measure_mode(folder, "FULL_AND_PIECEWISE", cfg, device, profile=False)
    finally:
        del os.environ[env]
    kernel_ms = {r["batch"]: r["median_step_s"] for r in with_kernel["latency"]}
    return dict(
        step_ms_torch_ops={str(r["batch"]): r["median_step_s"] * 1e3 for r in torch_ops["latency"]},
        speedup_of_the_kernel={str(r["batch"]): r["median_step_s"] / kernel_ms[r["batch"]] for r in torch_ops["latency"]},
        stats_ok=torch_ops["stats_ok"],
    )


def async_ab(folder: Path, cfg: dict, device: str, sync_run: dict) -> dict:
    """FULL_AND_PIECEWISE once more with ``async_scheduling=True``, against the same mode's
    synchronous run: the step time and the device's busy share both ways, same run."""
    run = measure_mode(folder, "FULL_AND_PIECEWISE", cfg, device, profile=True, async_scheduling=True)
    sync_ms = {r["batch"]: r["median_step_s"] for r in sync_run["latency"]}
    busy_share = {str(r["batch"]): (r["profile"] or {}).get("device_busy_share") for r in run["latency"]}
    return dict(
        step_ms_async={str(r["batch"]): r["median_step_s"] * 1e3 for r in run["latency"]},
        speedup_of_async={str(r["batch"]): sync_ms[r["batch"]] / r["median_step_s"] for r in run["latency"]},
        device_busy_share_async=busy_share,
        device_busy_share_sync={str(r["batch"]): (r["profile"] or {}).get("device_busy_share") for r in sync_run["latency"]},
        device_ops_per_step_async={str(r["batch"]): (r["profile"] or {}).get("device_ops_per_step") for r in run["latency"]},
        device_idle_gaps_async={str(r["batch"]): (r["profile"] or {}).get("device_idle_gaps") for r in run["latency"]},
        host_top_functions_async={str(r["batch"]): (r["profile"] or {}).get("host_top_functions") for r in run["latency"]},
        stats_ok=run["stats_ok"],
    )


def async_run_with(folder: Path, cfg: dict, device: str, env: str, value: str) -> dict:
    """FULL_AND_PIECEWISE with async scheduling, profiled, once more with ``env=value``."""
    os.environ[env] = value
    try:
        return measure_mode(folder, "FULL_AND_PIECEWISE", cfg, device, profile=True, async_scheduling=True)
    finally:
        del os.environ[env]


def pdl_ab(folder: Path, cfg: dict, device: str, async_run: dict) -> dict:
    """The async run once more with the step's Triton kernels launched dependent
    (``TINYVLLM_PDL=1``, ``dependent_launch.py``; on sm_90 or later, else it stays off and the
    two runs are the same), against ``async_ab``'s run: the step time and the device's busy
    share and idle gaps both ways, same run."""
    from tinyvllm.dependent_launch import PDL_ENV, pdl_supported

    run = async_run_with(folder, cfg, device, PDL_ENV, "1")
    async_ms = async_run["step_ms_async"]
    return dict(
        pdl_on=pdl_supported(torch.device(device)),
        step_ms_async_pdl={str(r["batch"]): r["median_step_s"] * 1e3 for r in run["latency"]},
        speedup_of_pdl={str(r["batch"]): async_ms[str(r["batch"])] / (r["median_step_s"] * 1e3) for r in run["latency"]},
        device_busy_share_async_pdl={str(r["batch"]): (r["profile"] or {}).get("device_busy_share") for r in run["latency"]},
        device_idle_gaps_async_pdl={str(r["batch"]): (r["profile"] or {}).get("device_idle_gaps") for r in run["latency"]},
        stats_ok=run["stats_ok"],
    )  # fmt: skip


def greedy_ab(folder: Path, cfg: dict, device: str, async_run: dict) -> dict:
    """The async run once more with the greedy draw as torch ops (``TINYVLLM_GREEDY=torch``),
    against ``async_ab``'s run, which takes the kernel on CUDA (``sample/ops/greedy.py``): the
    step time, the device's busy share and idle gaps both ways, same run. On the CPU both runs
    take the torch ops."""
    from tinyvllm.sample.ops.greedy import IMPL_ENV

    run = async_run_with(folder, cfg, device, IMPL_ENV, "torch")
    async_ms = async_run["step_ms_async"]
    return dict(
        step_ms_async_torch_ops={str(r["batch"]): r["median_step_s"] * 1e3 for r in run["latency"]},
        speedup_of_the_kernel={str(r["batch"]): r["median_step_s"] * 1e3 / async_ms[str(r["batch"])] for r in run["latency"]},
        device_busy_share_async_torch_ops={str(r["batch"]): (r["profile"] or {}).get("device_busy_share") for r in run["latency"]},
        stats_ok=run["stats_ok"],
    )  # fmt: skip


def ratios(modes: dict) -> dict:
    """Every mode against NONE of the same run: latency speed-up per batch, throughput ratio."""
    base = modes["NONE"]
    base_step = {r["batch"]: r["median_step_s"] for r in base["latency"]}
    return {
        name: dict(
            latency_speedup_vs_none={str(r["batch"]): base_step[r["batch"]] / r["median_step_s"]
                                     for r in m["latency"]},  # fmt: skip
            throughput_ratio_vs_none=(m["throughput"]["tok_per_s"] / base["throughput"]["tok_per_s"]
                                      if m["throughput"] else None),  # fmt: skip
            startup_minus_none_s=m["startup_s"] - base["startup_s"],
        )
        for name, m in modes.items()
    }


def mixed_ab(modes: dict) -> dict:
    """Per batch: the mixed step replayed PIECEWISE (the default) against FULL, and each
    against a decode step of the same batch, all measured in this run."""
    found = {}
    for name, mode in (("piecewise", "FULL_AND_PIECEWISE"), ("full", "FULL")):
        for r in modes.get(mode, {}).get("latency", []):
            if r.get("mixed"):
                found.setdefault(str(r["batch"]), {})[name] = r["mixed"]
    return {
        batch: dict(
            mixed_ms_piecewise=ab["piecewise"]["mixed_step_s"] * 1e3, mixed_ms_full=ab["full"]["mixed_step_s"] * 1e3,
            decode_ms=ab["piecewise"]["decode_step_s"] * 1e3,
            piecewise_over_full=ab["piecewise"]["mixed_step_s"] / ab["full"]["mixed_step_s"],
            mixed_over_decode_piecewise=ab["piecewise"]["mixed_over_decode"],
            mixed_over_decode_full=ab["full"]["mixed_over_decode"],
            mixed_ms_piecewise_prebound=(ab["piecewise"]["mixed_prebound_step_s"] or 0.0) * 1e3,
            piecewise_jit_over_prebound=ab["piecewise"]["jit_over_prebound"] or 0.0,  # 0: the pre-bound run failed
        )
        for batch, ab in found.items()
        if len(ab) == 2
    }


def environment(device: str) -> dict:
    import tinyvllm
    import transformers
    import triton

    cpu = platform.processor() or platform.machine()
    return dict(
        device=torch.cuda.get_device_name() if device == "cuda" else f"cpu ({cpu})",
        torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
        tinyvllm=tinyvllm.__version__, cuda=torch.version.cuda, python=platform.python_version(),
        torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
        triton_interpret=os.environ.get("TRITON_INTERPRET"), time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )  # fmt: skip


def busy(point: dict) -> str:
    """`` (device 41%)``: the profiled share of the step the device worked, where measured."""
    share = (point.get("profile") or {}).get("device_busy_share")
    return "" if share is None else f" (device {100 * share:.0f}%)"


def print_table(record: dict) -> None:
    print(f"device: {record['environment']['device']}  (speed-up = NONE's median step time / the mode's)")
    for name, m in record["modes"].items():
        r = record["ratios"][name]
        speedup = r["latency_speedup_vs_none"]
        lat = "  ".join(f"B={x['batch']}: {x['median_step_s'] * 1e3:7.2f} ms x{speedup[str(x['batch'])]:.2f}"
                        + busy(x) for x in m["latency"])  # fmt: skip
        tput = (f"{m['throughput']['tok_per_s']:8.0f} tok/s x{r['throughput_ratio_vs_none']:.2f} | "
                if m["throughput"] else "")  # fmt: skip
        print(f"{name:18s} startup {m['startup_s']:6.1f} s | {lat} | {tput}stats {'ok' if m['stats_ok'] else 'WRONG'}")
        for x in m["latency"]:
            if x.get("profile"):
                phases = " ".join(f"{k} {v:.2f}" for k, v in x["profile"]["phases_ms"].items())
                print(f"{'':18s} B={x['batch']} host phases, ms a step: {phases}")
                parts = " ".join(f"{k} {v:.2f}" for k, v in x["profile"]["forward_parts_ms"].items())
                print(f"{'':18s} B={x['batch']} forward's parts, ms a step: {parts}")
                probe = x["profile"].get("replay_probe")
                if probe:
                    print(f"{'':18s} B={x['batch']} the FULL graph alone, µs: one replay's launch {probe['host_us_idle']:.0f} "
                          f"idle, {probe['host_us_queued']:.0f} queued; a replay {probe['wall_us_per_replay_queued']:.0f} back to back")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, Triton under the interpreter")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default bench/results/cudagraphs-<device>.json)")  # fmt: skip
    parser.add_argument("--batches", default=None, help="decode batch sizes, comma-separated (default 1,8,32,128)")
    parser.add_argument("--no-throughput", action="store_true", help="decode latency only, no throughput workload")
    parser.add_argument("--rms-norm-ab", action="store_true",
                        help="then FULL_AND_PIECEWISE again with the norms as torch ops (TINYVLLM_RMS_NORM=torch)")
    parser.add_argument("--rotary-ab", action="store_true",
                        help="then FULL_AND_PIECEWISE again with rotary as torch ops (TINYVLLM_ROTARY=torch)")  # fmt: skip
    parser.add_argument("--silu-and-mul-ab", action="store_true",
                        help="then FULL_AND_PIECEWISE again with silu and mul as torch ops (TINYVLLM_SILU_AND_MUL=torch)")
    parser.add_argument("--fused-kv-write-ab", action="store_true",
                        help="then FULL_AND_PIECEWISE again with Qwen3's KV write apart (TINYVLLM_FUSED_KV_WRITE=0)")
    parser.add_argument("--async-ab", action="store_true",
                        help="FULL_AND_PIECEWISE once more with async_scheduling=True (step time, device busy share)")
    parser.add_argument("--pdl-ab", action="store_true",
                        help="with --async-ab: the async run again with dependent launches (TINYVLLM_PDL=1)")
    parser.add_argument("--greedy-ab", action="store_true",
                        help="with --async-ab: the async run again with the greedy draw as torch ops (TINYVLLM_GREEDY=torch)")
    parser.add_argument("--quick", action="store_true", help="half the timed repeats")
    parser.add_argument("--model-folder", type=Path, default=None,
                        help="reuse the model built there, or build it there (default: a temporary folder)")  # fmt: skip
    args = parser.parse_args(argv)
    for flag, given in (("--pdl-ab", args.pdl_ab), ("--greedy-ab", args.greedy_ab)):
        if given and not args.async_ab:
            parser.error(f"{flag} compares with --async-ab's run: give both")
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.dry_run:
        print("bench/cudagraphs.py: no CUDA device; nothing to time (use --dry-run to exercise the code on the CPU)")
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before tinyvllm imports the kernels

    device = "cpu" if args.dry_run else "cuda"
    cfg = dict(DRY if args.dry_run else FULL)
    if args.batches:
        cfg["batch_sizes"] = [int(b) for b in args.batches.split(",")]
        cfg["capture_sizes"] = sorted(set(cfg["capture_sizes"]) | set(cfg["batch_sizes"]))
        cfg["max_num_seqs"] = max(cfg["max_num_seqs"], *cfg["batch_sizes"])
    if args.no_throughput:
        cfg["throughput"] = None
    if args.quick:
        cfg["repeats"] = max(1, cfg["repeats"] // 2)
    env = environment(device)
    slug = re.sub(r"[^a-z0-9]+", "-", env["device"].lower()).strip("-")
    out = args.out or ROOT / "bench" / "results" / f"cudagraphs-{'dry-' if args.dry_run else ''}{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(benchmark="cudagraphs", dry_run=args.dry_run, complete=False, config=cfg, environment=env,
                  modes={}, ratios={}, mixed_ab={}, stats_check=False)  # fmt: skip
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = shared_model_folder(args.model_folder, Path(tmp), lambda f: build_model_folder(f, args.dry_run))
        record["model_build_s"] = time.perf_counter() - wall
        for mode in MODES:
            record["modes"][mode] = measure_mode(folder, mode, cfg, device)
            record["ratios"] = ratios(record["modes"])
            record["mixed_ab"] = mixed_ab(record["modes"])
            record["stats_check"] = all(m["stats_ok"] for m in record["modes"].values())
            record["total_s"] = time.perf_counter() - wall
            out.write_text(json.dumps(record, indent=2))  # partial results survive a timeout
        for key in KERNEL_AB:  # each --<kernel>-ab flag: the same mode with that kernel's torch ops
            if getattr(args, key):
                record[key] = kernel_ab(folder, cfg, device, record["modes"]["FULL_AND_PIECEWISE"], *KERNEL_AB[key])
                record["total_s"] = time.perf_counter() - wall
                out.write_text(json.dumps(record, indent=2))
        if args.async_ab:
            record["async_ab"] = async_ab(folder, cfg, device, record["modes"]["FULL_AND_PIECEWISE"])
            record["total_s"] = time.perf_counter() - wall
            out.write_text(json.dumps(record, indent=2))
        for key, wanted, ab in (("pdl_ab", args.pdl_ab, pdl_ab), ("greedy_ab", args.greedy_ab, greedy_ab)):
            if wanted:
                record[key] = ab(folder, cfg, device, record["async_ab"])
                record["total_s"] = time.perf_counter() - wall
                out.write_text(json.dumps(record, indent=2))
    record["complete"] = True
    record["total_s"] = time.perf_counter() - wall
    out.write_text(json.dumps(record, indent=2))
    print_table(record)
    for key, what in KERNEL_AB_WHAT.items():
        if key in record:
            ab = record[key]
            print(f"FULL_AND_PIECEWISE, {what}: " + "  ".join(
                f"B={b}: {ms:.2f} ms (the kernel x{ab['speedup_of_the_kernel'][b]:.2f})"
                for b, ms in ab["step_ms_torch_ops"].items()))  # fmt: skip
    for batch, ab in record["mixed_ab"].items():
        print(f"mixed step, B={batch} decodes + {cfg['mixed']['prompt_len']} prompt tokens: PIECEWISE "
              f"{ab['mixed_ms_piecewise']:.2f} ms, FULL {ab['mixed_ms_full']:.2f} ms (PIECEWISE / FULL "
              f"x{ab['piecewise_over_full']:.2f}); decode step {ab['decode_ms']:.2f} ms, mixed / decode "
              f"x{ab['mixed_over_decode_piecewise']:.2f} PIECEWISE, x{ab['mixed_over_decode_full']:.2f} FULL; "
              f"PIECEWISE with the pre-bound launch {ab['mixed_ms_piecewise_prebound']:.2f} ms "
              f"(JIT / pre-bound x{ab['piecewise_jit_over_prebound']:.2f})")  # fmt: skip
    print(f"total {record['total_s']:.1f} s; wrote {out}")
    if "async_ab" in record:
        ab = record["async_ab"]
        print("FULL_AND_PIECEWISE, async scheduling: " + "  ".join(
            f"B={b}: {ms:.2f} ms (x{ab['speedup_of_async'][b]:.2f}, busy {ab['device_busy_share_async'][b]})"
            for b, ms in ab["step_ms_async"].items()))  # fmt: skip
    if "pdl_ab" in record:
        ab = record["pdl_ab"]
        print(f"FULL_AND_PIECEWISE, async, dependent launches {'on' if ab['pdl_on'] else 'OFF (before sm_90)'}: " + "  ".join(
            f"B={b}: {ms:.2f} ms (x{ab['speedup_of_pdl'][b]:.2f}, busy {ab['device_busy_share_async_pdl'][b]})"
            for b, ms in ab["step_ms_async_pdl"].items()))  # fmt: skip
    if "greedy_ab" in record:
        ab = record["greedy_ab"]
        print("FULL_AND_PIECEWISE, async, the greedy draw as torch ops: " + "  ".join(
            f"B={b}: {ms:.2f} ms (the kernel x{ab['speedup_of_the_kernel'][b]:.2f}, busy {ab['device_busy_share_async_torch_ops'][b]})"
            for b, ms in ab["step_ms_async_torch_ops"].items()))  # fmt: skip
    if not record["stats_check"] or not all(record.get(k, {}).get("stats_ok", True) for k in ("async_ab", "pdl_ab", "greedy_ab")):
        print("bench/cudagraphs.py: some timed steps did not run in the expected runtime mode", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
