"""Issue 39's goals, read from one ``bash bench/gpu.sh`` run's ``gpu_summary.json``.

Concept: the issue "The GPU kept busy" ends on five figures measured on one H100 or H200.
``goal_rows(summary)`` finds each in the summary ``bench/gpu_check.py`` writes and says
whether it is met, not met, or not measured (a step that failed or did not run, a summary
older than the A/B that measures it, or a dry run on the CPU, whose timings mean nothing).
``python3 bench/gpu_goals.py SUMMARY`` prints them as a Markdown table, for the results
folder's README and the docs' GPU page; ``gpu_check.py`` prints the same table at the end
of every run.

Invariants: only reads the summary; a goal is "met" only from a figure measured on a CUDA
device in that run, and every row names the figure it was read from.

NOTE 1 (which configuration): the throughput goal is the async figure (the issue asks for it
with async scheduling on) and shows the synchronous one beside it. The decode goals take
FULL_AND_PIECEWISE, the default, with and without async scheduling: a goal is met when one
of the two meets it, and the row says which. The mixed-step goal takes, at each batch the
A/B measured, the better of replaying the mixed step PIECEWISE (today's default) or FULL;
prefill attention takes the best tile and launch config the sweep found, and says whether
it is the default. Met by a configuration that is not the default: make it the default.
NOTE 2 (a step that failed late): a step's record is rewritten as it measures, so one that
times out in its last A/B (the H200 run of 2026-11-30: the throughput step, in its FULL-mode
A/B) has measured the rest; its figures count, and the row says which step failed and why.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MET, NOT_MET, NOT_MEASURED = "met", "not met", "not measured"
# --8<-- [start:goals]
THROUGHPUT = "nano-vllm's workload >= 15,000 output tok/s, async scheduling on"
BUSY = "decode: the device busy >= 90% of a step at batch 32"
STEP = "decode: a batch-1 step <= 2.0 ms"
MIXED = "a mixed step within 1.5x of a decode step of the same batch"
PREFILL = "prefill attention at 4,096 tokens >= 0.6x SDPA"
# --8<-- [end:goals]


@dataclass(frozen=True)
class GoalRow:
    """One goal: what it asks, what the run measured, and the verdict."""

    goal: str
    measured: str  # the figure and where it came from, or why there is none
    status: str  # MET, NOT_MET or NOT_MEASURED


def _figures(summary: dict, step: str) -> dict | None:
    """The figures of ``step``: when it passed, or when it failed after its record held some
    (a step timed out in its last A/B has measured the rest; NOTE 2); None otherwise."""
    for s in summary.get("steps", []):
        if s.get("name") == step and s.get("status") in ("passed", "failed"):
            figures = s.get("figures") or {}
            return figures if figures and "error" not in figures else None
    return None


def _cut_short(summary: dict, step: str) -> str | None:
    """Why ``step`` failed when a row still read figures from its record; None when it passed."""
    for s in summary.get("steps", []):
        if s.get("name") == step and s.get("status") == "failed":
            return s.get("reason") or "failed"
    return None


def _why_missing(summary: dict, step: str) -> str:
    for s in summary.get("steps", []):
        if s.get("name") == step:
            return f"the {step} step {s.get('status')}" + (f" ({s['reason']})" if s.get("reason") else "")
    return f"no {step} step in this run"


def _best(candidates: dict[str, float | None], better: Callable[[float, float], bool]) -> tuple[str, float] | None:
    """The best measured value among named candidates (None: not measured)."""
    found = [(name, v) for name, v in candidates.items() if v is not None]
    if not found:
        return None
    best = found[0]
    for name, v in found[1:]:
        if better(v, best[1]):
            best = (name, v)
    return best


def throughput_row(summary: dict) -> GoalRow:
    goal = THROUGHPUT
    f = _figures(summary, "throughput")
    if f is None:
        return GoalRow(goal, _why_missing(summary, "throughput"), NOT_MEASURED)
    sync = f.get("tinyvllm_tok_per_s")
    if f.get("tinyvllm_async_tok_per_s") is None:
        return GoalRow(goal, f"no async figure in this run (sync {sync:,.0f} tok/s)", NOT_MEASURED)
    value = f["tinyvllm_async_tok_per_s"]
    text = f"{value:,.0f} tok/s async, {sync:,.0f} sync (throughput step)"
    if f.get("mode_ab_speedup") is not None:  # said, not judged: the goal is the default mode's
        text += f"; async under {f['mode_ab_cudagraph_mode']} x{f['mode_ab_speedup']:.2f}"
    return GoalRow(goal, text, MET if value >= 15_000 else NOT_MET)


def _decode_row(summary: dict, goal: str, sync_key: str, async_key: str, batch: str, meets, fmt, missing: str) -> GoalRow:
    """A decode goal: FULL_AND_PIECEWISE's figure at ``batch``, sync and async; met when
    either meets it (NOTE 1)."""
    f = _figures(summary, "cudagraph_latency")
    if f is None or "FULL_AND_PIECEWISE" not in f.get("modes", {}):
        return GoalRow(goal, _why_missing(summary, "cudagraph_latency"), NOT_MEASURED)
    sync, ab = f["modes"]["FULL_AND_PIECEWISE"], f.get("async_ab") or {}
    values = {"sync": (sync.get(sync_key) or {}).get(batch), "async": (ab.get(async_key) or {}).get(batch)}
    measured = {name: v for name, v in values.items() if v is not None}
    if not measured:
        return GoalRow(goal, missing, NOT_MEASURED)
    text = ", ".join(f"{name} {fmt(v)}" for name, v in measured.items())
    return GoalRow(goal, f"{text} (FULL_AND_PIECEWISE)", MET if any(map(meets, measured.values())) else NOT_MET)


# cudagraphs.py's idle_gaps bins: the graph's own gaps between kernels, and the host's waits.
SHORT_GAPS, LONG_GAPS = ("<2us", "2-5us"), (">=100us",)


def busy_row(summary: dict) -> GoalRow:
    """The batch-32 busy share; with the async A/B's idle gaps, whose the idle time is; with the
    dependent-launch A/B, the async step's share and speed-up with it (said, not judged: the
    launch is off by default, and the goal is the default's); with the greedy A/B, the share
    with the torch ops and the kernel's speed-up (said: the default takes the kernel)."""
    row = _decode_row(summary, BUSY, "device_busy_share", "device_busy_share_async", "32", lambda v: v >= 0.90,
                      lambda v: f"{v:.0%}", "no profiled batch-32 step in this run")  # fmt: skip
    f = _figures(summary, "cudagraph_latency") or {}
    pdl = f.get("pdl_ab") or {}
    share, speedup = (pdl.get("device_busy_share_async_pdl") or {}).get("32"), (pdl.get("speedup_of_pdl") or {}).get("32")
    if pdl.get("pdl_on") and share is not None and speedup is not None:
        row = GoalRow(row.goal, f"{row.measured}; async with dependent launches {share:.0%}, the step x{speedup:.2f}", row.status)
    greedy = f.get("greedy_ab") or {}  # the default takes the one-kernel greedy draw; this run took the torch ops
    share, speedup = (greedy.get("device_busy_share_async_torch_ops") or {}).get("32"), (greedy.get("speedup_of_the_kernel") or {}).get("32")
    if share is not None and speedup is not None:
        row = GoalRow(row.goal, f"{row.measured}; async with the greedy draw as torch ops {share:.0%}, the kernel x{speedup:.2f}",
                      row.status)  # fmt: skip
    gaps = ((f.get("async_ab") or {}).get("device_idle_gaps_async") or {}).get("32")
    if not gaps:
        return row
    us = {label: bin_["us"] for label, bin_ in gaps.items()}
    short, long = sum(us[label] for label in SHORT_GAPS), sum(us[label] for label in LONG_GAPS)
    middle = sum(us.values()) - short - long
    text = (f"{row.measured}; async idle a step: {short:.0f} µs in gaps under 5 µs, {middle:.0f} µs in 5-100 µs, "
            f"{long:.0f} µs in gaps of 100 µs or more")  # fmt: skip
    return GoalRow(row.goal, text, row.status)


def step_row(summary: dict) -> GoalRow:
    return _decode_row(summary, STEP, "step_ms", "step_ms_async", "1", lambda v: v <= 2.0,
                       lambda v: f"{v:.2f} ms", "no batch-1 step in this run")  # fmt: skip


def mixed_row(summary: dict) -> GoalRow:
    goal = MIXED
    f = _figures(summary, "cudagraph_latency")
    if f is None:
        return GoalRow(goal, _why_missing(summary, "cudagraph_latency"), NOT_MEASURED)
    ab = f.get("mixed_ab") or {}
    if not ab:
        return GoalRow(goal, "no mixed-step A/B in this run", NOT_MEASURED)
    parts, worst = [], 0.0
    for batch, row in sorted(ab.items(), key=lambda kv: int(kv[0])):
        name, ratio = _best({"PIECEWISE": row["mixed_over_decode_piecewise"], "FULL": row["mixed_over_decode_full"]},
                            lambda a, b: a < b)  # fmt: skip
        parts.append(f"B={batch}: x{ratio:.2f} {name}")
        worst = max(worst, ratio)
    return GoalRow(goal, "; ".join(parts), MET if worst <= 1.5 else NOT_MET)


def prefill_row(summary: dict) -> GoalRow:
    goal = PREFILL
    f = _figures(summary, "attention_prefill")
    if f is None:
        return GoalRow(goal, _why_missing(summary, "attention_prefill"), NOT_MEASURED)
    rows = {key: r for key, r in f.get("rows", {}).items() if key.endswith("/4096") and r.get("best_x_sdpa") is not None}
    if not rows:
        return GoalRow(goal, "no 4,096-token row in this run", NOT_MEASURED)
    parts = []
    for key, r in sorted(rows.items()):
        default = "" if r["best"] == r["default"] else f", default x{r['default_x_sdpa']:.2f}"
        plain = f"; plain flash x{r['plain_flash_x_sdpa']:.2f}" if r.get("plain_flash_x_sdpa") is not None else ""
        parts.append(f"{key.split('/')[0]}: best x{r['best_x_sdpa']:.2f} ({r['best']}{default}{plain})")
    worst = min(r["best_x_sdpa"] for r in rows.values())
    return GoalRow(goal, "; ".join(parts), MET if worst >= 0.6 else NOT_MET)


ROWS = (
    (THROUGHPUT, "throughput", throughput_row), (BUSY, "cudagraph_latency", busy_row), (STEP, "cudagraph_latency", step_row),
    (MIXED, "cudagraph_latency", mixed_row), (PREFILL, "attention_prefill", prefill_row),
)  # fmt: skip


def _said_where(row: GoalRow, summary: dict, step: str) -> GoalRow:
    """``row``, its text saying so when its figures came from a step that then failed (NOTE 2)."""
    reason = _cut_short(summary, step)
    if reason is None or row.measured.startswith(f"the {step} step"):
        return row
    return GoalRow(row.goal, f"{row.measured} (from the {step} step's record; the step then failed: {reason})", row.status)


def goal_rows(summary: dict) -> list[GoalRow]:
    """Every goal of issue 39 against ``summary`` (NOTE 1); all "not measured" without a CUDA device."""
    env = summary.get("environment") or {}
    if summary.get("dry_run") or not env.get("cuda_available"):
        why = "a dry run on the CPU: its timings mean nothing" if summary.get("dry_run") else "no CUDA device in this run"
        return [GoalRow(goal, why, NOT_MEASURED) for goal, _, _ in ROWS]
    return [_said_where(row(summary), summary, step) for _, step, row in ROWS]


def markdown(summary: dict) -> str:
    """The goals as a Markdown table, headed by the device and the run's date."""
    env = summary.get("environment") or {}
    lines = [f"Issue 39's goals, {env.get('device', 'unknown device')}, {summary.get('date', 'undated')}:", "",
             "| goal | measured | status |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {r.goal} | {r.measured} | **{r.status}** |" for r in goal_rows(summary)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="a gpu_summary.json written by bench/gpu.sh")
    args = parser.parse_args(argv)
    try:
        summary = json.loads(args.summary.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"bench/gpu_goals.py: cannot read {args.summary}: {error}") from None
    if not isinstance(summary, dict) or "steps" not in summary:
        raise SystemExit(f"bench/gpu_goals.py: {args.summary} is not a gpu_summary.json (no 'steps')")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
