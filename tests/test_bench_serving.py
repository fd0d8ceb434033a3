"""bench/serving.py --dry-run: a real server in a subprocess, streamed requests, every code
path, and the JSON the README describes (its timings mean nothing and are not checked)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_fixtures import require_serve_extra

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_serving_bench_dry_run_counts_every_token(tmp_path):
    out = tmp_path / "serving.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(ROOT / "bench" / "serving.py"), "--dry-run", "--rates", "inf,40", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["mode"] == "dry" and record["workload"]["num_requests"] == 12
    assert set(record["serving"]) == {"inf", "40.0"}
    assert record["offline"]["output_tokens"] == record["workload"]["output_tokens"]
    for by_rate in record["serving"].values():
        assert by_rate["completed"] == 12
        assert set(by_rate["ttft_ms"]) == {"mean", "median", "p50", "p90", "p99"}
        assert by_rate["ttft_ms"]["p99"] >= by_rate["ttft_ms"]["median"] > 0
    assert set(record["ratios"]["serving_over_offline_output_throughput"]) == {"inf", "40.0"}
    assert record["engine"]["device"] == "cpu" and record["machine"]["device"] == "cpu"
