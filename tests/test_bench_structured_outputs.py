"""bench/structured_outputs.py: its --dry-run goes through every code path (the three cases,
the grammar's parts, the compiles) and writes the JSON its header describes (timings mean nothing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("xgrammar")


def test_structured_outputs_dry_run_writes_every_case_ratio_and_compile(tmp_path):
    out = tmp_path / "structured_outputs.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "structured_outputs.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["threads"] == 1 and record["machine"]["cpu_count"] >= 1
    cases = {"constrained_0", "constrained_50", "constrained_100"}
    for clock in ("wall", "cpu"):
        assert set(record[clock]["median_step_ms"]) == cases
        assert set(record[clock]["ratios"]) == {"constrained_50_over_constrained_0", "constrained_100_over_constrained_0"}
    batch, steps = record["workload"]["batch"], record["workload"]["decode_steps"]
    for name, runs in record["runs"].items():
        constrained = {"constrained_0": 0, "constrained_50": batch // 2, "constrained_100": batch}[name]
        assert [run["decode_steps"] for run in runs] == [steps]  # the batch stayed whole: steps + 1 tokens each
        for run in runs:  # rows filled by an open grammar: only constrained requests', at most one per step each
            assert (run["live_grammar_rows"] > 0) == (constrained > 0)
            assert run["live_grammar_rows"] <= constrained * (steps + 1) and run["grammars_finished"] <= constrained
    parts = record["grammar_parts_ms_per_step"]
    assert parts["constrained_0"]["advance"] == 0  # no constrained request: no matcher to advance
    assert parts["constrained_100"]["grammar_bitmask"] > 0 and parts["constrained_100"]["apply_grammar_bitmask"] > 0
    assert set(record["ratios_from_parts"]) == set(record["cpu"]["ratios"])
    compiles = record["compile"]
    assert compiles["count"] == 2 and all(len(v) == 2 for v in compiles["runs_ms"].values())
    assert set(record["goals"]) >= {"step_ratio_100_met", "cached_compile_met"}
