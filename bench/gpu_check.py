"""The GPU check: everything that needs a GPU, in one command that fits eight minutes.

What it runs, in this order, each step in its own process under its own time budget
(``STEPS``; the budgets add up to at most ``TOTAL_BUDGET_S`` = 480 s, model building and
warm-up included):

1. ``environment``: the device and its memory, ``nvidia-smi``'s device line, the versions of
   Python, torch (and its CUDA), triton, transformers and tinyvllm;
2. ``gpu_tests``: ``pytest -m gpu`` (Triton against the reference; the engine against
   transformers in float32 and bfloat16; every ``cudagraph_mode`` against eager with real
   ``torch.cuda.CUDAGraph`` capture; graph memory counted in the KV budget);
3. ``throughput``: nano-vllm's workload (``bench/throughput.py``: the Qwen3-0.6B shape with
   random weights in bfloat16, 256 requests, prompts and outputs of 100-1024 tokens,
   ``ignore_eos``) against transformers ``generate`` in the same run, and against the figure
   nano-vllm publishes (``NANO_VLLM_PUBLISHED``: another GPU, so a reference, not a race);
4. ``cudagraph_latency``: batch-1 and batch-32 decode step latency under each
   ``cudagraph_mode``, against NONE (``bench/cudagraphs.py``);
5. ``prefix_caching``: caching on against off at about 49% hits (input throughput and mean
   TTFT), a row of the table of vLLM PR #9668 (``bench/prefix_caching.py --gpu``);
6. ``attention_prefill``: the Triton kernel's prefill tile and launch configs against SDPA at
   512-4,096 tokens, the best per length (``bench/attention.py --prefill-sweep``).

Each step is ``passed``, ``failed`` (its exit status, or a timeout, with the last lines of
its output) or ``skipped`` with the reason (``time``: the time left was under its budget
floor). The ``gpu_tests`` step gets a deadline inside its budget (``TINYVLLM_TEST_DEADLINE``,
``TEST_DEADLINE_MARGIN_S`` before the budget ends; the root ``conftest.py`` reads it): tests
not started by then are skipped as "out of time", pytest still writes its report, and the
step is ``incomplete``, with the tests it did not run named in its figures. The step runs
``bench/gpu_tests.py``: the kernels' tests in a pytest process of their own, then the rest, so
that a kernel's fault on the device fails no engine test. A failed step never stops the next one. The model is built once, by the first
step that needs it, into a folder every later step reuses (``--model-folder``).

What it leaves in ``--out`` (default ``bench/results/``): ``gpu_summary.json`` (every step:
its status, seconds and figures; the environment; rewritten after every step, so a run
cut short keeps what it measured) and ``gpu.log`` (every step's whole output). The steps'
own JSON records are folded into the summary and not left behind: two files, within the
eight a GPU session brings back.

Carried packages (``install_carried_wheels``): before the first step, the wheels in ``--wheels``
(default ``.whl/``, filled by ``bench/fetch_gpu_wheels.sh`` where there is a network, and carried
to the GPU machine beside the working tree) are unpacked into a folder of the run's temporary
directory, which every step then has on ``PYTHONPATH``; the machine's own site-packages is never
written. They bring xgrammar, which the GPU machine lacks, so that the structured-output tests
run there instead of skipping. The summary's ``carried_packages`` names what was installed, at
which version, and what was skipped or failed and why; a failure is recorded, never fatal. No
``.whl/`` (CI) installs nothing and says so; a dry run with one installs it the same way.

NOTE 1 (unzipped, not pip-installed): a wheel is a zip whose root is a site-packages folder, plus
``<name>.data/purelib`` and ``platlib`` to move there; these wheels need no build step, so
unzipping each one is all ``pip install --target`` would do here, in a fraction of a second
(the environment step's budget is ten) and without depending on pip. Each wheel is checked
whole (its CRC, one ``.dist-info``, no member outside the folder) before a byte is written, so
a wheel found broken leaves nothing behind; a wheel whose tags this interpreter does not accept (a
cp312 binary on Python 3.11) is skipped, not unpacked to fail at import.

NOTE 2 (first on the path): ``PYTHONPATH`` comes before site-packages, so a carried package
shadows the machine's own copy of it (pydantic needs a newer typing_extensions than torch
does). The summary names each such package with the machine's version (``shadows``).

``--quick`` halves every workload (256 -> 128 requests, half the timed repeats, half the
prefix-caching requests). ``--dry-run`` runs the same steps on the CPU with the tiny test
model and tiny workloads (``pytest -m gpu`` only collects there): the test suite and CI
run it, its timings mean nothing, and its steps get ``DRY_RUN_BUDGET_SCALE`` times their budgets.

``--tests-left-in SUMMARY`` runs the environment step and then only the ``gpu`` tests that an
earlier run's summary names as not run for time (``not_run_for_time``, as pytest node ids:
``tests_left_in``), with the rest of the eight minutes: the second call of a GPU session.
``--budget SECONDS`` (default 480) sets the whole run's time, to fit what a session has left.

Run: ``bash bench/gpu.sh --out DIR`` (``gpu.sh`` calls this script); exit status 0 when every
step passed. Last it prints the open issue's goals against this run (``bench/gpu_goals.py``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gpu_goals  # bench/: the script's own folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 480  # eight minutes: a GPU session allows ten per command
SUMMARY, LOG = "gpu_summary.json", "gpu.log"
SCHEMA_VERSION = 1
# nano-vllm's README (https://github.com/GeeeekExplorer/nano-vllm), its Qwen3-0.6B benchmark.
NANO_VLLM_PUBLISHED = {
    "tok_per_s": 1434.13, "output_tokens": 133966, "seconds": 93.41, "requests": 256,
    "hardware": "RTX 4070 Laptop (8GB)", "vllm_tok_per_s": 1361.84,
    "source": "https://github.com/GeeeekExplorer/nano-vllm#benchmark",
}  # fmt: skip


# --8<-- [start:steps]
@dataclass(frozen=True)
class Step:
    """One step of the check: its name, its time budget, and what it shows."""

    name: str
    budget_s: int
    what: str


# Sized from the runs on an H100 (2026-11-27, bench/results/gpu-h100-2026-11-27*/). The first:
# 8.9, 117 (a cold Triton cache), 136 (transformers' 32 requests alone 77 s; cut off at the
# old 145 s budget, model building included), 32 and 46 seconds. The second, the first whole
# pass: 8.2, 133 (74 tests), 157 (transformers 99 s), 44 (with the RMSNorm A/B) and 47 s.
# Since then: 9 more gpu tests (KV tiles, rotary, the fused q/k norm and rotary: about 25 s
# of compiling on a cold Triton cache, and the tests stop 20 s before the budget) and the
# rotary A/B (one more build of FULL_AND_PIECEWISE, about 6 s). The H200 run (2026-11-28): 6.3,
# 97, 127, 34 and 33 s. Then three same-run A/Bs and a sweep: async scheduling (one more engine
# and full workload in ``throughput``, about 25 s at the H200's figures; one more
# FULL_AND_PIECEWISE build in ``cudagraph_latency``, about 8 s), the mixed-step A/B (about 4 s)
# and the prefill sweep (``attention_prefill``, which starts no config after
# ATTENTION_SWEEP_LIMIT_S and reports what it timed). Their time came from the environment's
# slack, the tests' (the H200 ran them in 97 s; under the deadline the last ones are skipped
# and named) and prefix caching, which now measures the 49%-hit case only (the 37% TTFT case
# was measured on the H100 and the H200 runs above). The H200 run of 2026-11-30: 9.7, 151 (to
# the deadline), 169, 51 and 30 s, where prefix caching timed out: its two engines capture
# their graphs before the one case runs. It takes 12 s from cudagraph_latency's slack and the tests'.
# The prefill sweep then took 40 s for its 22 configs (run apart, with a 45 s limit): with the
# descriptor A/B it has 24, so it takes 20 s of the tests' (whose last ones the deadline skips).
# The dependent-launch A/B (one more async FULL_AND_PIECEWISE run, profiled: about 9 s, as the
# async A/B) takes the RMSNorm A/B's place (about 4 s; measured in two runs, 1.78-2.05x) and 6 s
# of the tests'. The plain flash-attention baseline of the prefill sweep (bench/plain_flash.py: two
# configs a shape at 4,096 tokens, about 8 s with their compiles) takes 8 s more of the tests'. The
# FULL-mode A/B of the throughput step (the async engine once more with cudagraph_mode FULL: one
# start-up with its captures and the full workload, about 18 s at the H200's figures) takes 18 s
# more: the tests left run in a second call (--tests-left-in). The greedy kernel's A/B (the async
# run once more with the torch ops, as the PDL A/B was) takes the PDL A/B's place: that one answered
# (x1.01 / x0.97 on the H200). The H200 run of 2026-11-30 (the
# second) timed the throughput step out in that A/B (transformers' subset took 115 s); the A/B,
# run apart, answered its question (FULL x0.99 of FULL_AND_PIECEWISE), so it left the step and
# its 18 s went back to the tests.
STEPS = (
    Step("environment", 10, "device, memory, nvidia-smi's device line, versions"),
    Step("gpu_tests", 122, "pytest -m gpu: Triton, the engine against transformers, CUDA graphs"),
    Step("throughput", 178, "nano-vllm's workload against transformers generate and nano-vllm's figure, sync and async"),
    Step("cudagraph_latency", 64, "decode step latency per cudagraph_mode against NONE at batch 1 and 32; mixed, async and greedy-kernel A/Bs"),
    Step("prefix_caching", 42, "prefix caching on against off: input throughput and TTFT at ~49% hits"),
    Step("attention_prefill", 64, "Triton prefill attention tile/launch configs against SDPA, 512-4096 tokens"),
)
ATTENTION_SWEEP_LIMIT_S = 52  # then the config in flight, the record and the process's exit
MIN_STEP_S = 10  # a step left with less than this (and less than its budget) is skipped for time
TEST_DEADLINE_ENV = "TINYVLLM_TEST_DEADLINE"  # read by the root conftest.py
TEST_DEADLINE_MARGIN_S = 20  # the longest gpu test (an engine built, graphs captured) and pytest's report
# The budgets are a GPU's. A dry run (the CPU, the tiny model) checks that every step runs and
# writes its record, not how long it takes: its steps get this many times their budgets. On an
# idle CPU its slowest step (cudagraph_latency) takes about 41 s of its 66; in CI, at idle
# priority beside the test suite's two workers, it once ran past 66 s (its budget then) and failed the check.
DRY_RUN_BUDGET_SCALE = 4


def step_timeout(step: Step, elapsed_s: float, total_s: float = TOTAL_BUDGET_S, scale: float = 1.0) -> float | None:
    """The seconds ``step`` may run after ``elapsed_s`` of the check: its budget, cut to what
    is left of the total; None when too little is left (the step is skipped for time). ``scale``
    stretches the budgets and the total alike (``DRY_RUN_BUDGET_SCALE``)."""
    budget, left = step.budget_s * scale, total_s * scale - elapsed_s
    timeout = min(budget, left)
    return timeout if timeout >= min(budget, MIN_STEP_S) else None
# --8<-- [end:steps]


def step_command(step: Step, python: str, work: Path, dry_run: bool, quick: bool) -> list[str]:
    """The command line of a step (``environment`` is this script itself)."""
    model = ["--model-folder", str(work / "model")]
    out = ["--out", str(work / f"{step.name}.json")]
    if step.name == "environment":
        return [python, str(Path(__file__)), "--environment-json", str(work / "environment.json")]
    if step.name == "gpu_tests":
        # -v: each test's id is logged as it starts, so even a hang names its test; --durations: the
        # slowest tests, to size this step's budget from a real run; -rs: why each skip (a carried
        # package that failed to import, say), which the log would not otherwise say
        # bench/gpu_tests.py: the kernels' tests in a process of their own, so that a kernel's
        # fault on the device (it poisons the process's CUDA context) fails no engine test
        cmd = [python, "bench/gpu_tests.py", "-m", "gpu", "-v", "-rs", "--durations=15", "-p", "no:cacheprovider",
               f"--junitxml={work / 'junit.xml'}"]  # fmt: skip
        return cmd + (["--collect-only"] if dry_run else [])
    if step.name == "throughput":
        seqs = ["--num-seqs", "128" if quick else "256"]
        cmd = [python, "bench/throughput.py", "--repeats", "1", "--async-ab", *seqs, *model, *out]
        return cmd + (["--dry-run"] if dry_run else [])
    if step.name == "cudagraph_latency":
        batches = ["--batches", "1,2" if dry_run else "1,32", "--no-throughput",
                   "--fused-kv-write-ab", "--async-ab", "--greedy-ab"]  # the greedy A/B takes the answered PDL A/B's place
        flags = ["--dry-run"] if dry_run else []
        return [python, "bench/cudagraphs.py", *batches, *model, *out, *flags] + (["--quick"] if quick else [])
    if step.name == "prefix_caching":
        mode = "--dry-run" if dry_run else "--gpu"
        cases = ["--cases", "hit_49"]  # one row of the PR's table: the budget (STEPS' comment)
        return [python, "bench/prefix_caching.py", mode, "--repeats", "1", *cases, *model, *out] + (["--quick"] if quick else [])
    if step.name == "attention_prefill":
        limit = ATTENTION_SWEEP_LIMIT_S // (2 if quick else 1)
        cmd = [python, "bench/attention.py", "--prefill-sweep", "--time-limit", str(limit), *out]
        return cmd + (["--dry-run"] if dry_run else [])
    raise ValueError(f"unknown step {step.name!r}")


# -- figures: what each step's record says, in a few numbers -------------------------------------


def figures(step: Step, work: Path, output: str) -> dict:
    """The step's headline figures, from the record it wrote (or pytest's report)."""
    if step.name == "gpu_tests":
        return pytest_figures(work / "junit.xml", output)
    path = work / f"{step.name}.json"
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    if step.name == "environment":
        return record
    if step.name == "throughput":
        return throughput_figures(record)
    if step.name == "cudagraph_latency":
        return cudagraph_figures(record)
    if step.name == "attention_prefill":
        return attention_prefill_figures(record)
    return prefix_caching_figures(record)


def pytest_figures(junit: Path, output: str) -> dict:
    """Counts and the failing tests from pytest's JUnit XML; with ``--collect-only``, the count
    collected from its last line."""
    found = re.findall(r"(\d+)(?:/\d+)? tests? collected", output)  # one line a pytest run (bench/gpu_tests.py)
    collected = sum(map(int, found)) if found else None
    if not junit.is_file():
        return {"collected": collected} if found else {}
    root = ET.parse(junit).getroot()
    suites = list(root.iter("testsuite")) if root.tag == "testsuites" else [root]
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    failing, not_run = [], []
    for case in root.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None and "out of time" in (skipped.get("message") or ""):
            not_run.append(f"{case.get('classname')}::{case.get('name')}")
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        if problem is not None:
            message = (problem.get("message") or "").splitlines()[:1]
            failing.append(f"{case.get('classname')}::{case.get('name')}: {message[0] if message else ''}"[:300])
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    if found:
        counts["collected"] = collected
    return {**counts, "failing": failing, "skipped_for_time": len(not_run), "not_run_for_time": not_run}


# --8<-- [start:tests_left]
def node_id(junit_name: str, root: Path = ROOT) -> str:
    """A JUnit ``classname::name`` (``tests.test_x::test_y[p]``, ``tests.test_x.TestZ::test_y``)
    as pytest's node id (``tests/test_x.py::test_y[p]``): the longest dotted prefix that is a
    file of the repository is the module, the rest its classes."""
    classname, _, name = junit_name.partition("::")
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    raise ValueError(f"{junit_name!r}: no file of the repository is its module")


def tests_left_in(summary_path: Path) -> list[str]:
    """The node ids of the ``gpu`` tests an earlier run's summary names as not run for time."""
    summary = json.loads(summary_path.read_text())
    step = next((s for s in summary.get("steps", []) if s["name"] == "gpu_tests"), None)
    if step is None:
        raise ValueError(f"{summary_path}: no gpu_tests step in this summary")
    return [node_id(name) for name in step.get("figures", {}).get("not_run_for_time", [])]
# --8<-- [end:tests_left]


def throughput_figures(record: dict) -> dict:
    """The headline figures; a record cut short (``complete`` false) gives what it has."""
    result = {"device": record["device"], "complete": record.get("complete", True), "engine": record["engine"]}
    full = record.get("tinyvllm_full_workload")
    if full is None:
        return result
    result |= {
        "requests": full["requests"],
        "output_tokens": full["output_tokens"],
        "tinyvllm_tok_per_s": round(full["tok_per_s"], 1),
        "tinyvllm_seconds": round(full["seconds"], 2),
    }
    full_async = record.get("tinyvllm_full_workload_async")
    if full_async is not None:  # the A/B of async scheduling, same workload, same run
        result["tinyvllm_async_tok_per_s"] = round(full_async["tok_per_s"], 1)
        result["async_speedup"] = round(record["async_speedup_full_workload"], 3)
    mode_ab = record.get("tinyvllm_full_workload_async_mode_ab")
    if mode_ab is not None:  # the async engine under another cudagraph_mode, same workload, same run
        result["mode_ab_cudagraph_mode"] = record["mode_ab"]["engine"]["cudagraph_mode"]  # as resolved
        result["tinyvllm_async_mode_ab_tok_per_s"] = round(mode_ab["tok_per_s"], 1)
        result["mode_ab_speedup"] = round(record["mode_ab_speedup"], 3)
    hf = record.get("transformers_on_hf_subset")
    if hf is not None and "speedup_vs_transformers_same_subset" in record:
        result |= {
            "transformers_subset_requests": hf["requests"],
            "transformers_subset_tok_per_s": round(hf["tok_per_s"], 1),
            "speedup_vs_transformers_same_subset": round(record["speedup_vs_transformers_same_subset"], 2),
        }
    if full["output_tokens"] == NANO_VLLM_PUBLISHED["output_tokens"]:  # the same workload, draw for draw
        result["ratio_vs_nano_vllm_published"] = round(full["tok_per_s"] / NANO_VLLM_PUBLISHED["tok_per_s"], 2)
        result["nano_vllm_published"] = NANO_VLLM_PUBLISHED
    return result


def cudagraph_figures(record: dict) -> dict:
    modes = {}
    for name, mode in record["modes"].items():
        speedup = record["ratios"][name]["latency_speedup_vs_none"]
        modes[name] = {
            "resolved_mode": mode["resolved_mode"],
            "startup_s": round(mode["startup_s"], 1),
            "step_ms": {str(r["batch"]): round(r["median_step_s"] * 1e3, 3) for r in mode["latency"]},
            "speedup_vs_none": {b: round(x, 2) for b, x in speedup.items()},
        }
        profiled = {str(r["batch"]): r["profile"] for r in mode["latency"] if r.get("profile")}
        if profiled:  # where the step's time goes (cudagraphs.py's profile_steps)
            modes[name]["device_busy_share"] = {b: p["device_busy_share"] for b, p in profiled.items()}
            modes[name]["device_ops_per_step"] = {b: p.get("device_ops_per_step") for b, p in profiled.items()}
            modes[name]["device_idle_gaps"] = {b: p.get("device_idle_gaps") for b, p in profiled.items()}
            modes[name]["top_device_ops"] = {b: p["top_device_ops"][:4] for b, p in profiled.items()}
            modes[name]["host_phases_ms"] = {b: {k: round(v, 3) for k, v in p["phases_ms"].items()}
                                             for b, p in profiled.items()}  # fmt: skip
            modes[name]["forward_parts_ms"] = {b: {k: round(v, 3) for k, v in p["forward_parts_ms"].items()}
                                               for b, p in profiled.items()}  # fmt: skip
            probes = {b: p.get("replay_probe") for b, p in profiled.items()}  # the graph's launch alone
            if any(probes.values()):
                modes[name]["replay_probe"] = {b: {k: round(v, 1) if isinstance(v, float) else v for k, v in probe.items()}
                                               if probe else None for b, probe in probes.items()}  # fmt: skip
    figures = {"device": record["environment"]["device"], "complete": record["complete"],
               "stats_check": record["stats_check"], "modes": modes}  # fmt: skip
    for key in ("rms_norm_ab", "rotary_ab", "fused_kv_write_ab", "async_ab", "pdl_ab", "greedy_ab"):  # FULL_AND_PIECEWISE once more, changed, same run
        if key in record:
            figures[key] = record[key]
    if record.get("mixed_ab"):  # a mixed step PIECEWISE (the default) against FULL, and against a decode step
        figures["mixed_ab"] = {b: {k: round(v, 3) for k, v in ab.items()} for b, ab in record["mixed_ab"].items()}
    return figures


def attention_prefill_figures(record: dict) -> dict:
    """Per shape and length: SDPA's TFLOP/s, the default config's and the best config's, each
    with its ratio to SDPA (the issue's goal: >= 0.6 at 4,096 tokens); at the longest length,
    the plain flash-attention baseline's best config and ratio to SDPA (``bench/plain_flash.py``)."""
    sweep = record["results"]["prefill_sweep"]
    r2 = lambda x: None if x is None else float(f"{x:.3g}")  # noqa: E731  (3 significant digits: a dry run's ratios are ~1e-3)
    rows = {
        f"{r['shape']}/{r['length']}": {
            "sdpa_TFLOPs": r2(r["sdpa_TFLOPs"]), "default": r["default_config"], "default_TFLOPs": r2(r["default_TFLOPs"]),
            "default_x_sdpa": r2(r["default_ratio_to_sdpa"]), "best": r["best_config"], "best_TFLOPs": r2(r["best_TFLOPs"]),
            "best_x_sdpa": r2(r["best_ratio_to_sdpa"]), "configs_timed": len(r["triton_us_by_config"]),
            "configs_failed": len(r["errors"]),
            **({"plain_flash": r["plain_flash_best_config"], "plain_flash_x_sdpa": r2(r["plain_flash_ratio_to_sdpa"]),
                "best_x_plain_flash": r2(r["best_ratio_to_plain_flash"])} if "plain_flash_best_config" in r else {}),
        }
        for r in sweep["rows"]
    }  # fmt: skip
    return {"device": record["device"], "complete": sweep["complete"], "not_timed": len(sweep["not_timed"]), "rows": rows}


def prefix_caching_figures(record: dict) -> dict:
    """The ratios of the cases measured (all of them unless ``complete`` is false)."""
    ratios = next(iter(record["ratios"].values()), {})
    return {"device": record["machine"]["device"], "repeats": record["repeats"], "complete": record.get("complete", True),
            "ratios": ratios, "seed_004_reference": record["seed_004_reference"]}  # fmt: skip


# -- the environment step (run in its own process: the parent never initialises CUDA) -----------


def environment() -> dict:
    import platform

    import torch

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for module in ("triton", "transformers", "tinyvllm"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    # Found on the path (a carried wheel, NOTE 1), not imported: the import would cost a second of
    # this step's ten; the structured-output tests import it, and their skip reason says why not.
    info["xgrammar"] = _distribution_version("xgrammar")
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["device_count"] = torch.cuda.device_count()
    else:
        info["device"] = "cpu"
    try:
        query = "--query-gpu=name,memory.total,driver_version,pci.bus_id"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as error:
        info["nvidia_smi"] = f"not available ({type(error).__name__})"
    return info


# -- carried packages: wheels unpacked into a folder on every step's path (NOTES 1 and 2) ----------


def _distribution_version(name: str) -> str | None:
    """The installed version of distribution ``name`` on this interpreter's path, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _wheel_tags_accepted(wheel: Path) -> bool | None:
    """Whether this interpreter accepts the wheel's tags (from its file name); None when
    ``packaging`` (which pytest brings) is missing, and the wheel is tried anyway."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:
        return None
    _, _, _, tags = parse_wheel_filename(wheel.name)
    return not tags.isdisjoint(sys_tags())


def _wheel_plan(zf: zipfile.ZipFile, target: Path) -> tuple[dict[str, str], list[tuple[zipfile.ZipInfo, Path]]]:
    """Check a wheel whole before anything is written: its metadata (name, version) and where
    each member goes under ``target``. Raises ValueError naming what is wrong."""
    bad = zf.testzip()
    if bad is not None:
        raise ValueError(f"bad CRC in member {bad!r}")
    infos = {name.split("/", 1)[0] for name in zf.namelist() if name.split("/", 1)[0].endswith(".dist-info")}
    if len(infos) != 1:
        raise ValueError(f"no .dist-info folder, or more than one: {sorted(infos)}")
    (info,) = infos
    fields = {}
    for line in zf.read(f"{info}/METADATA").decode("utf-8", "replace").splitlines():
        if not line.strip():
            break  # the headers end at the first empty line; the long description follows
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if not fields.get("Name") or not fields.get("Version"):
        raise ValueError(f"{info}/METADATA names no Name or no Version")
    data = info[: -len(".dist-info")] + ".data"
    plan = []
    for member in zf.infolist():
        parts = Path(member.filename).parts
        if member.filename.startswith("/") or ".." in parts or not parts:
            raise ValueError(f"member {member.filename!r} lies outside the target folder")
        if parts[0] == data:  # <name>.data/<scheme>/...: purelib and platlib go to the root, the rest is not imported
            if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                continue
            parts = parts[2:]
        if not member.is_dir():
            plan.append((member, target.joinpath(*parts)))
    return {"name": fields["Name"], "version": fields["Version"]}, plan


def carried_record(wheel_dir: Path | None, target: Path | None, status: str = "none", note: str = "") -> dict:
    """The summary's ``carried_packages`` with nothing installed yet (``install_carried_wheels``)."""
    return {"wheel_dir": None if wheel_dir is None else str(wheel_dir), "target": None if target is None else str(target),
            "status": status, "installed": {}, "shadows": {}, "skipped": [], "failed": [], "note": note}  # fmt: skip


def install_carried_wheels(wheel_dir: Path, target: Path) -> dict:
    """Unpack every wheel in ``wheel_dir`` into ``target`` (NOTE 1) and return the record the
    summary keeps: ``status`` (``none``, ``installed``, ``partial``: some skipped or failed,
    ``failed``: none installed), ``installed`` (name to version), ``shadows`` (name to the
    version this interpreter already had, NOTE 2), ``skipped`` and ``failed`` (each wheel with
    its reason) and a ``note``. A broken wheel is recorded and the next one still installs.
    ``wheel_dir`` missing or without wheels installs nothing; a file there is a ValueError."""
    if wheel_dir.exists() and not wheel_dir.is_dir():
        raise ValueError(f"the carried wheels' folder {wheel_dir} is not a folder")
    record = carried_record(wheel_dir, target)
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        record["note"] = f"no wheels in {wheel_dir}"
        return record
    for wheel in wheels:
        try:
            if _wheel_tags_accepted(wheel) is False:
                record["skipped"].append({"wheel": wheel.name, "reason": "not for this interpreter "
                                          f"(Python {sys.version_info.major}.{sys.version_info.minor})"})  # fmt: skip
                continue
            with zipfile.ZipFile(wheel) as zf:
                meta, plan = _wheel_plan(zf, target)
                name = meta["name"]
                if name in record["installed"]:
                    reason = f"another wheel of {name} ({record['installed'][name]}) is installed"
                    record["skipped"].append({"wheel": wheel.name, "reason": reason})
                    continue
                for member, dest in plan:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with zf.open(member) as src, dest.open("wb") as dst:
                        shutil.copyfileobj(src, dst)
                    mode = (member.external_attr >> 16) & 0o777
                    if mode:
                        dest.chmod(mode)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
            record["failed"].append({"wheel": wheel.name, "error": f"{type(error).__name__}: {error}"})
            continue
        record["installed"][name] = meta["version"]
        had = _distribution_version(name)
        if had is not None:
            record["shadows"][name] = had
    if not record["installed"]:
        record["status"] = "failed"
    else:
        record["status"] = "partial" if record["skipped"] or record["failed"] else "installed"
    counts = f"{len(record['installed'])} installed, {len(record['skipped'])} skipped, {len(record['failed'])} failed"
    record["note"] = f"{len(wheels)} wheels in {wheel_dir}: {counts}"
    return record


def carried_log_lines(record: dict) -> list[str]:
    """What ``gpu.log`` says of the carried packages, a line each."""
    lines = [record["note"]]
    lines += [f"installed {name} {version}" + (f" (shadows the machine's {record['shadows'][name]})"
              if name in record["shadows"] else "") for name, version in record["installed"].items()]  # fmt: skip
    lines += [f"skipped {entry['wheel']}: {entry['reason']}" for entry in record["skipped"]]
    lines += [f"failed {entry['wheel']}: {entry['error']}" for entry in record["failed"]]
    return lines


# -- running the steps ----------------------------------------------------------------------------


def run_step(
    cmd: list[str], timeout: float, log, extra_env: dict[str, str] | None = None, extra_path: tuple[Path, ...] = ()
) -> tuple[int | None, str]:
    """Run ``cmd`` from the repository root; its output goes to ``log`` and is returned.
    ``extra_path`` (the carried packages' folder) follows ``src`` on ``PYTHONPATH``.
    Returns ``(exit status, output)``, the status None when it ran out of time (its whole
    process group is killed, so no child outlives it)."""
    path = os.pathsep.join([str(ROOT / "src"), *map(str, extra_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = None
        out.seek(0)
        text = out.read()
    log.write(text)
    log.flush()
    return status, text


def write_summary(out_dir: Path, summary: dict) -> None:
    tmp = out_dir / (SUMMARY + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(out_dir / SUMMARY)


def run_check(
    out_dir: Path,
    dry_run: bool,
    quick: bool,
    python: str = sys.executable,
    steps: tuple[Step, ...] = STEPS,
    total_s: float = TOTAL_BUDGET_S,
    command=step_command,
    budget_scale: float = 1.0,
    wheel_dir: Path | None = None,
) -> dict:
    """Run ``steps`` in order within ``total_s``, each budget and the total stretched by
    ``budget_scale``; returns the summary (also written to ``out_dir``). ``command`` builds each
    step's command line (the tests pass their own). The wheels in ``wheel_dir`` (None: none)
    are unpacked first into a temporary folder every step has on its path (NOTE 1)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary = {
        "schema": SCHEMA_VERSION,
        "check": "bench/gpu_check.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "bash bench/gpu.sh " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "dry_run": dry_run,
        "quick": quick,
        "total_budget_s": total_s,
        "budget_scale": budget_scale,
        "environment": {},
        "steps": [],
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp, (out_dir / LOG).open("w") as log:
        work = Path(tmp)
        carried = work / "carried_site"
        try:
            summary["carried_packages"] = (install_carried_wheels(wheel_dir, carried) if wheel_dir
                                           else carried_record(None, None, note="no wheel folder given"))  # fmt: skip
        except Exception as error:  # noqa: BLE001  (whatever it is, the run goes on without them)
            summary["carried_packages"] = carried_record(wheel_dir, carried, "failed", f"{type(error).__name__}: {error}")
        extra_path = (carried,) if summary["carried_packages"]["installed"] else ()
        lines = carried_log_lines(summary["carried_packages"])
        log.write("== carried packages ==\n" + "".join(line + "\n" for line in lines))
        print(f"carried packages: {summary['carried_packages']['status']} ({lines[0]})", flush=True)
        write_summary(out_dir, summary)
        for step in steps:
            elapsed = time.perf_counter() - start
            record = {"name": step.name, "what": step.what, "budget_s": step.budget_s, "started_at_s": round(elapsed, 1)}
            timeout = step_timeout(step, elapsed, total_s, budget_scale)
            scaled = f" x{budget_scale:g}" if budget_scale != 1 else ""
            header = f"== {step.name} (budget {step.budget_s} s{scaled}, at {elapsed:.0f} s of {total_s}{scaled}) =="
            print(header, flush=True)
            log.write(header + "\n")
            if timeout is None:
                record |= {"status": "skipped", "reason": "time", "seconds": 0.0}
                log.write(f"skipped: {total_s * budget_scale - elapsed:.0f} s left, under its budget\n")
            else:
                cmd = command(step, python, work, dry_run, quick)
                log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
                log.flush()
                began = time.perf_counter()
                extra_env = {}
                if step.name == "gpu_tests":  # tests not started by then are skipped, and said so
                    extra_env[TEST_DEADLINE_ENV] = f"{time.time() + timeout - TEST_DEADLINE_MARGIN_S:.1f}"
                status, output = run_step(cmd, timeout, log, extra_env, extra_path)
                record["seconds"] = round(time.perf_counter() - began, 1)
                record["exit_status"] = status
                try:
                    record["figures"] = figures(step, work, output)
                except (OSError, ValueError, KeyError, TypeError) as error:  # a record cut short or malformed
                    record["figures"] = {"error": f"{type(error).__name__}: {error}"}
                not_run = record.get("figures", {}).get("skipped_for_time", 0)
                if status == 0 and not_run:
                    record["status"] = "incomplete"
                    record["reason"] = f"time: {not_run} tests not run"
                elif status == 0:
                    record["status"] = "passed"
                else:
                    record["status"] = "failed"
                    record["reason"] = f"timed out after {timeout:.0f} s" if status is None else f"exit status {status}"
                    record["output_tail"] = output.splitlines()[-25:]
                if step.name == "environment":
                    summary["environment"] = record.pop("figures", {})
            print(f"   {record['status']}" + (f" ({record['reason']})" if "reason" in record else ""), flush=True)
            summary["steps"].append(record)
            summary["wall_s"] = round(time.perf_counter() - start, 1)
            write_summary(out_dir, summary)
        summary["passed"] = all(s["status"] == "passed" for s in summary["steps"])
        write_summary(out_dir, summary)
        log.write(json.dumps({s["name"]: s["status"] for s in summary["steps"]}) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder for the summary and the log")
    parser.add_argument("--quick", action="store_true", help="half of every workload")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, the tiny model, tiny workloads: checks the check")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                        help="wheels to unpack onto every step's path (default .whl/; none there: nothing)")  # fmt: skip
    parser.add_argument("--budget", type=int, default=TOTAL_BUDGET_S, metavar="SECONDS",
                        help=f"seconds the whole run may take (default {TOTAL_BUDGET_S}): a later call fits what is left")
    parser.add_argument("--tests-left-in", type=Path, default=None, metavar="SUMMARY",
                        help="only the gpu tests that SUMMARY (an earlier run's gpu_summary.json) left for time")  # fmt: skip
    parser.add_argument("--environment-json", type=Path, default=None, help=argparse.SUPPRESS)  # the environment step
    args = parser.parse_args(argv)
    if args.budget < STEPS[0].budget_s + MIN_STEP_S:
        parser.error(f"--budget {args.budget}: at least {STEPS[0].budget_s + MIN_STEP_S} s (the environment and one step)")
    if args.environment_json is not None:
        args.environment_json.write_text(json.dumps(environment(), indent=2))
        return 0
    if not args.dry_run and not _has_cuda():
        print("bench/gpu.sh: no CUDA device visible to torch; use --dry-run to check the check on the CPU", file=sys.stderr)
        return 1
    scale = DRY_RUN_BUDGET_SCALE if args.dry_run else 1
    steps, command = STEPS, step_command
    if args.tests_left_in is not None:  # the environment, then those tests with the rest of the budget
        left = tests_left_in(args.tests_left_in)
        if not left:
            print(f"bench/gpu.sh: {args.tests_left_in} names no gpu test left for time; nothing to run")
            return 0
        steps = (STEPS[0], Step("gpu_tests", args.budget - STEPS[0].budget_s, f"pytest -m gpu: the {len(left)} tests "
                                f"{args.tests_left_in.name} left for time"))  # fmt: skip
        command = lambda step, *rest: step_command(step, *rest) + (left if step.name == "gpu_tests" else [])  # noqa: E731
    summary = run_check(args.out.resolve(), args.dry_run, args.quick, steps=steps, total_s=args.budget, command=command,
                        budget_scale=scale, wheel_dir=args.wheels.resolve())  # fmt: skip
    for step in summary["steps"]:
        print(f"{step['name']:18s} {step['status']:8s} {step.get('seconds', 0):6.1f} s of {step['budget_s']} s")
    print(f"wrote {args.out / SUMMARY} and {args.out / LOG} ({summary['wall_s']:.0f} s)")
    print(gpu_goals.markdown(summary))  # the open issue's goals, met or not, from this run
    return 0 if summary["passed"] else 1


def _has_cuda() -> bool:
    """Whether torch sees a CUDA device, asked in a child process (the parent stays CUDA-free)."""
    probe = subprocess.run([sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"])
    return probe.returncode == 0


if __name__ == "__main__":
    sys.exit(main())
