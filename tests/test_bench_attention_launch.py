"""bench/attention_launch.py: its --dry-run times every way on a few layers (timings mean
nothing), with the kernels replaced by a no-op in the script only, and writes the JSON the
module header describes."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_launch_dry_run_times_per_layer_planned_and_a_baseline(tmp_path):
    out = tmp_path / "attention_launch.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    has_git = (ROOT / ".git").exists()  # the baseline is the launcher at a git revision
    cmd = [sys.executable, str(ROOT / "bench" / "attention_launch.py"), "--dry-run", "--out", str(out)]
    cmd += ["--baseline", "HEAD"] if has_git else []
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["config"]["layers"] == 3
    assert record["machine"]["cpu_count"] > 0 and list(record["results_by_threads"]) == ["1"]
    cases = record["results_by_threads"]["1"]
    assert set(cases) == {"decode_1", "mixed_2_plus_5"}
    # one launch a layer; the long single decode splits its keys, so its merge kernel launches too
    assert cases["decode_1"]["launches_per_step"] == 2 * 3 and cases["mixed_2_plus_5"]["launches_per_step"] == 3
    for case in cases.values():
        assert set(case["us_per_step"]) == {"per_layer", "planned"} | ({"baseline"} if has_git else set())
        assert all(us > 0 for us in case["us_per_step"].values())
        assert case["per_layer_over_planned"] > 0 and case.get("baseline_over_planned", 1) > 0
