"""``bench/gpu_goals.py``: issue 39's five goals read from a ``gpu_summary.json``.

The committed H200 run of 2026-11-28 (before the async A/B, the mixed-step A/B and the
prefill sweep existed) gives its real figures: two goals not met, three not measured. A copy
of it given the figures a newer run writes checks each rule at its edge: the async
throughput, the better of sync and async for the decode goals, the better mode per batch
and the worst batch for mixed steps, the best config at 4,096 tokens for prefill. A dry run
measures nothing; a failed step says so.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_goals  # noqa: E402
from gpu_goals import MET, NOT_MEASURED, NOT_MET  # noqa: E402

H200 = ROOT / "bench" / "results" / "gpu-h200-2026-11-28" / "gpu_summary.json"


@pytest.fixture
def h200() -> dict:
    return json.loads(H200.read_text())


def step(summary: dict, name: str) -> dict:
    return next(s for s in summary["steps"] if s["name"] == name)


def newer(summary: dict, *, async_tok: float, busy: dict, steps_ms: dict, mixed: dict, prefill: dict) -> dict:
    """``summary`` with the figures a run with every A/B writes, at the values given."""
    s = copy.deepcopy(summary)
    step(s, "throughput")["figures"]["tinyvllm_async_tok_per_s"] = async_tok
    latency = step(s, "cudagraph_latency")["figures"]
    latency["async_ab"] = {"step_ms_async": steps_ms, "device_busy_share_async": busy}
    latency["mixed_ab"] = {b: {"mixed_over_decode_piecewise": pw, "mixed_over_decode_full": full} for b, (pw, full) in mixed.items()}
    rows = {f"qwen3/{n}": {"best": best, "default": "default", "best_x_sdpa": x, "default_x_sdpa": d}
            for n, (best, x, d) in prefill.items()}  # fmt: skip
    s["steps"].append({"name": "attention_prefill", "status": "passed", "figures": {"rows": rows}})
    return s


def by_goal(summary: dict) -> dict[str, gpu_goals.GoalRow]:
    return {row.goal: row for row in gpu_goals.goal_rows(summary)}


def test_the_h200_run_of_2026_11_28_meets_none_and_measures_two(h200):
    rows = by_goal(h200)
    assert [r.status for r in rows.values()] == [NOT_MEASURED, NOT_MET, NOT_MET, NOT_MEASURED, NOT_MEASURED]
    assert rows[gpu_goals.THROUGHPUT].measured == "no async figure in this run (sync 13,312 tok/s)"
    assert rows[gpu_goals.BUSY].measured == "sync 64% (FULL_AND_PIECEWISE)"
    assert rows[gpu_goals.STEP].measured == "sync 2.11 ms (FULL_AND_PIECEWISE)"
    assert rows[gpu_goals.MIXED].measured == "no mixed-step A/B in this run"
    assert rows[gpu_goals.PREFILL].measured == "no attention_prefill step in this run"
    table = gpu_goals.markdown(h200)
    assert table.splitlines()[0] == "Issue 39's goals, NVIDIA H200, 2026-11-28T20:27:45+00:00:"
    assert "| decode: a batch-1 step <= 2.0 ms | sync 2.11 ms (FULL_AND_PIECEWISE) | **not met** |" in table


def test_each_goal_is_met_at_its_edge_and_not_just_past_it(h200):
    met = newer(h200, async_tok=15_000.0, busy={"1": 0.95, "32": 0.90}, steps_ms={"1": 2.0, "32": 2.2},
                mixed={"1": (1.9, 1.2), "32": (1.5, 2.5)}, prefill={"4096": ("m64-w4", 0.6, 0.35), "512": ("d", 0.1, 0.1)})  # fmt: skip
    rows = by_goal(met)
    assert [r.status for r in rows.values()] == [MET] * 5
    assert rows[gpu_goals.THROUGHPUT].measured == "15,000 tok/s async, 13,312 sync (throughput step)"
    with_mode_ab = copy.deepcopy(met)  # the FULL-mode A/B is said beside the figure, the status stays the default's
    step(with_mode_ab, "throughput")["figures"] |= {"mode_ab_cudagraph_mode": "FULL", "mode_ab_speedup": 1.07}
    row = by_goal(with_mode_ab)[gpu_goals.THROUGHPUT]
    assert row.status == MET and row.measured == "15,000 tok/s async, 13,312 sync (throughput step); async under FULL x1.07"
    assert rows[gpu_goals.BUSY].measured == "sync 64%, async 90% (FULL_AND_PIECEWISE)"  # async meets it, sync not
    assert rows[gpu_goals.STEP].measured == "sync 2.11 ms, async 2.00 ms (FULL_AND_PIECEWISE)"
    assert rows[gpu_goals.MIXED].measured == "B=1: x1.20 FULL; B=32: x1.50 PIECEWISE"  # the better mode per batch
    assert rows[gpu_goals.PREFILL].measured == "qwen3: best x0.60 (m64-w4, default x0.35)"  # 512 tokens do not count
    short = newer(h200, async_tok=14_999.0, busy={"32": 0.899}, steps_ms={"1": 2.01},
                  mixed={"1": (1.2, 1.1), "32": (1.51, 1.6)}, prefill={"4096": ("default", 0.59, 0.59)})  # fmt: skip
    assert [r.status for r in by_goal(short).values()] == [NOT_MET] * 5
    assert by_goal(short)[gpu_goals.PREFILL].measured == "qwen3: best x0.59 (default)"


def test_the_prefill_row_says_how_far_plain_flash_attention_gets(h200):
    """With the sweep's baseline (``bench/plain_flash.py``) in the row, the goal's line says how
    close to SDPA Triton's plainest causal kernel got at the same length: the goal's status
    is still the paged kernel's."""
    s = newer(h200, async_tok=15_000.0, busy={"32": 0.80}, steps_ms={"1": 2.0}, mixed={}, prefill={"4096": ("m64-w4", 0.41, 0.35)})
    step(s, "attention_prefill")["figures"]["rows"]["qwen3/4096"]["plain_flash_x_sdpa"] = 0.44
    row = by_goal(s)[gpu_goals.PREFILL]
    assert row.status == NOT_MET and row.measured == "qwen3: best x0.41 (m64-w4, default x0.35; plain flash x0.44)"


def test_the_busy_row_says_whose_the_async_steps_idle_time_is(h200):
    """With the async A/B's idle gaps (``cudagraphs.py`` ``idle_gaps``), the batch-32 row says
    how much of the idle step is short gaps between kernels (under 5 µs: the graph's own)
    and how much long waits (100 µs or more: the host's); the goal's status is unchanged."""
    s = newer(h200, async_tok=15_000.0, busy={"32": 0.80}, steps_ms={"1": 2.0}, mixed={}, prefill={})
    gaps = {"<2us": {"count": 180.0, "us": 150.0}, "2-5us": {"count": 20.0, "us": 60.5},
            "5-20us": {"count": 3.0, "us": 30.0}, "20-100us": {"count": 1.0, "us": 40.0},
            ">=100us": {"count": 1.0, "us": 120.4}}  # fmt: skip
    step(s, "cudagraph_latency")["figures"]["async_ab"]["device_idle_gaps_async"] = {"1": None, "32": gaps}
    row = by_goal(s)[gpu_goals.BUSY]
    assert row.status == NOT_MET
    sys.path.insert(0, str(ROOT / "bench"))
    from cudagraphs import _gap_labels

    assert set(gpu_goals.SHORT_GAPS + gpu_goals.LONG_GAPS) <= set(_gap_labels()) == set(gaps)  # the bench's bins
    assert row.measured == (
        "sync 64%, async 80% (FULL_AND_PIECEWISE); async idle a step: 210 µs in gaps under 5 µs, "
        "70 µs in 5-100 µs, 120 µs in gaps of 100 µs or more"
    )


def test_the_busy_row_says_what_dependent_launches_did_without_judging_them(h200):
    """With the dependent-launch A/B (``cudagraphs.py --pdl-ab``) on a GPU that has it, the row
    gives the async step's busy share and speed-up with it; the status stays the default's.
    On a GPU without it (``pdl_on`` false) the row says nothing of it."""
    s = newer(h200, async_tok=15_000.0, busy={"32": 0.80}, steps_ms={"1": 2.0}, mixed={}, prefill={})
    latency = step(s, "cudagraph_latency")["figures"]
    latency["pdl_ab"] = {"pdl_on": True, "device_busy_share_async_pdl": {"1": 0.9, "32": 0.93}, "speedup_of_pdl": {"1": 1.1, "32": 1.04}}
    row = by_goal(s)[gpu_goals.BUSY]
    assert row.status == NOT_MET
    assert row.measured == "sync 64%, async 80% (FULL_AND_PIECEWISE); async with dependent launches 93%, the step x1.04"
    latency["pdl_ab"]["pdl_on"] = False
    assert by_goal(s)[gpu_goals.BUSY].measured == "sync 64%, async 80% (FULL_AND_PIECEWISE)"


def test_the_busy_row_says_what_the_greedy_kernel_did(h200):
    """With the greedy A/B (``cudagraphs.py --greedy-ab``: the async run with the torch ops) the
    row gives that run's busy share and the kernel's speed-up; the status stays the default's."""
    s = newer(h200, async_tok=15_000.0, busy={"32": 0.80}, steps_ms={"1": 2.0}, mixed={}, prefill={})
    step(s, "cudagraph_latency")["figures"]["greedy_ab"] = {
        "device_busy_share_async_torch_ops": {"1": 0.85, "32": 0.74}, "speedup_of_the_kernel": {"1": 1.02, "32": 1.08}}  # fmt: skip
    row = by_goal(s)[gpu_goals.BUSY]
    assert row.status == NOT_MET
    assert row.measured == "sync 64%, async 80% (FULL_AND_PIECEWISE); async with the greedy draw as torch ops 74%, the kernel x1.08"


def test_a_dry_run_or_a_run_without_cuda_measures_nothing(h200):
    dry = {**h200, "dry_run": True}
    assert {(r.status, r.measured) for r in gpu_goals.goal_rows(dry)} == {(NOT_MEASURED, "a dry run on the CPU: its timings mean nothing")}
    cpu = {**h200, "environment": {**h200["environment"], "cuda_available": False}}
    assert {(r.status, r.measured) for r in gpu_goals.goal_rows(cpu)} == {(NOT_MEASURED, "no CUDA device in this run")}


def test_a_failed_step_is_named_with_its_reason(h200):
    failed = copy.deepcopy(h200)
    latency = step(failed, "cudagraph_latency")
    latency.update(status="failed", reason="timed out after 66 s", figures={})  # failed before its record held a figure
    rows = by_goal(failed)
    for goal in (gpu_goals.BUSY, gpu_goals.STEP, gpu_goals.MIXED):
        assert rows[goal].status == NOT_MEASURED
        assert rows[goal].measured == "the cudagraph_latency step failed (timed out after 66 s)"
    assert rows[gpu_goals.THROUGHPUT].status == NOT_MEASURED  # still read from its own step


def test_a_step_that_failed_after_measuring_keeps_its_figures_and_says_it_failed():
    """NOTE 2: the H200 run of 2026-11-30 (the second) timed its throughput step out in the
    FULL-mode A/B, after the sync and async runs had written their figures; a step whose record
    is malformed, or empty, still gives none."""
    run = json.loads((ROOT / "bench" / "results" / "gpu-h200-2026-11-30-run2" / "gpu_summary.json").read_text())
    row = by_goal(run)[gpu_goals.THROUGHPUT]
    assert row.status == MET
    assert row.measured == ("20,700 tok/s async, 12,723 sync (throughput step) (from the throughput step's record; "
                            "the step then failed: timed out after 196 s)")  # fmt: skip
    assert by_goal(run)[gpu_goals.PREFILL].measured == "the attention_prefill step failed (exit status 1)"
    assert "then failed" not in by_goal(run)[gpu_goals.STEP].measured  # its step passed
    for figures in ({}, {"error": "KeyError: 'engine'"}):
        step(run, "throughput")["figures"] = figures
        row = by_goal(run)[gpu_goals.THROUGHPUT]
        assert (row.status, row.measured) == (NOT_MEASURED, "the throughput step failed (timed out after 196 s)")


def test_the_command_prints_the_table_and_refuses_what_is_not_a_summary(tmp_path, capsys):
    assert gpu_goals.main([str(H200)]) == 0
    assert capsys.readouterr().out.startswith("Issue 39's goals, NVIDIA H200")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": 1}))
    with pytest.raises(SystemExit, match=r"other.json is not a gpu_summary.json \(no 'steps'\)"):
        gpu_goals.main([str(other)])
    with pytest.raises(SystemExit, match="cannot read .*missing.json"):
        gpu_goals.main([str(tmp_path / "missing.json")])


def test_the_gpu_page_shows_the_table_the_script_makes_from_the_latest_committed_run():
    latest = json.loads((ROOT / "bench" / "results" / "gpu-h200-2026-11-30-run3" / "gpu_summary.json").read_text())
    page = (ROOT / "docs" / "running_on_a_gpu.md").read_text()
    assert gpu_goals.markdown(latest) in page
