"""bench/attention.py: its --dry-run runs every code path on tiny CPU shapes, and without
CUDA the plain run exits cleanly with a message."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "attention.py"), *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path; gpu.sh runs the real one")
@pytest.mark.slow
def test_dry_run_writes_json_with_every_section(tmp_path):
    out = tmp_path / "attention.json"
    result = _run("--dry-run", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["torch"] == torch.__version__
    assert {"device", "triton", "config", "results"} <= record.keys()
    decode, prefill = record["results"]["decode"], record["results"]["prefill"]
    assert [(r["batch"], r["context"]) for r in decode] == [(1, 20), (1, 520), (2, 20), (2, 520)]
    assert [r["num_segments"] for r in decode] == [1, 16, 1, 16]  # long decodes take the split path
    assert all(set(r["triton_us_by_segments"]) == {"1", "4"} for r in decode)  # each split forced, timed
    ragged = record["results"]["ragged_decode"]  # a ragged batch, then one at its mean context
    assert [r["shape"] for r in ragged] == ["ragged", "uniform"] and ragged[1]["contexts"][0] == ragged[0]["mean_context"]
    assert all(r["max_abs_diff_vs_reference"] < 1e-4 for r in ragged)  # the kernel against the torch reference
    assert [r["length"] for r in prefill] == [16]
    sweep = record["results"]["prefill_sweep"]  # two configs at the smallest shape, against SDPA
    assert sweep["complete"] is True and [(r["shape"], r["length"]) for r in sweep["rows"]] == [("tiny", 16)]
    row = sweep["rows"][0]
    plain = {"m64-n16-w4-s3", "m64-n32-w4-s3", "m64-n32-w4-s3-desc"}  # the default both ways, the other tile
    assert plain <= set(row["triton_us_by_config"]) <= plain | {"m64-n16-w4-s3-desc"} and not row["errors"]
    assert row["default_config"] == "m64-n32-w4-s3" and row["best_config"] in row["triton_us_by_config"]
    assert row["best_ratio_to_sdpa"] > 0 and all(d < 1e-4 for d in row["max_abs_diff_by_config"].values())
    # the plain flash-attention baseline (bench/plain_flash.py) at the longest length, checked against SDPA first
    assert list(row["plain_flash_us_by_config"]) == ["m16-n16-w4-s1"] and not row["plain_flash_errors"]
    assert row["plain_flash_ratio_to_sdpa"] > 0 and row["best_ratio_to_plain_flash"] > 0
    assert "prefill sweep (staged" in result.stdout
    for row in decode + prefill:
        assert row["max_abs_diff_vs_sdpa"] < 1e-4, row  # every KV tile agrees with SDPA on contiguous K/V
        assert set(row["triton_us_by_kv_tile"]) == {"16", "32"} and row["best_kv_tile"] in (16, 32)
        assert row["triton_us"] > 0 and row["sdpa_us"] > 0 and row["triton_launched_us"] > 0
    assert "copy bandwidth" in result.stdout and f"wrote {out}" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA")
def test_without_cuda_exits_cleanly_with_a_message():
    result = _run()
    assert result.returncode == 0
    assert "no CUDA device" in result.stdout


def _bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import attention

    return attention


def test_the_staged_sweep_times_the_loads_tiles_then_launch_options_at_the_winner():
    bench = _bench()
    sweep, default = bench.SWEEP_FULL, bench.default_prefill_config(32, 8)
    assert bench.config_key(default) == "m64-n32-w4-s3"  # the launcher's prefill choice today (kv_desc off)
    keys = lambda stage, best: [bench.config_key(c) for c in bench.sweep_stages(sweep, default, best, "staged", stage)]  # noqa: E731
    # the default both ways first (the descriptor A/B), then the tiles, 128 rows at 8 warps
    # (two warpgroups of 64 rows, warps_for_rows), not 4 doing both halves
    assert keys(0, None) == ["m64-n32-w4-s3", "m64-n32-w4-s3-desc", "m64-n64-w4-s3", "m64-n128-w4-s3", "m128-n64-w8-s3",
                             "m128-n128-w8-s3"]  # fmt: skip
    assert [bench.warps_for_rows(m, 4) for m in (16, 64, 128, 256)] == [4, 4, 8, 16]
    assert bench.warps_for_rows(64, 8) == 8  # never fewer than the default's
    winner = dict(default, block_m=128, kv_tile=64, num_warps=8)
    assert keys(1, winner) == [f"m128-n64-w{w}-s{s}" for w in (4, 8) for s in (2, 3, 4)]  # one of them stage 0 timed
    assert keys(2, dict(winner, num_stages=2)) == ["m128-n64-w8-s2-desc"]  # the best, its loads the other way
    assert keys(2, dict(winner, kv_desc=True)) == ["m128-n64-w8-s3"]
    grid = bench.sweep_stages(sweep, default, None, "grid", 0)
    assert len({bench.config_key(c) for c in grid}) == len(grid) == 48 and bench.sweep_stages(sweep, default, winner, "grid", 1) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_a_sweep_past_its_time_limit_starts_no_config_and_says_so():
    bench = _bench()
    sweep = bench.prefill_sweep(bench.SWEEP_DRY, "cpu", time_limit_s=0.0)
    assert sweep["complete"] is False and sweep["not_timed"] == ["tiny:m64-n32-w4-s3", "tiny:m64-n32-w4-s3-desc", "tiny:m64-n16-w4-s3"]
    row = sweep["rows"][0]
    assert row["triton_us_by_config"] == {} and row["best_config"] is None and row["sdpa_us"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_a_staged_sweep_looks_each_stages_best_up_among_every_config_it_timed(monkeypatch):
    """Each stage starts from the fastest config so far, whichever stage timed it (the H200
    run of 2026-11-30 failed with StopIteration looking stage 2's winner up among stage 1's
    configs). Every config timed is made faster than the last, so each stage's own wins."""
    bench = _bench()
    sweep = dict(bench.SWEEP_DRY, num_warps=[4, 2])  # stage 1: the winner at 2 warps as well
    times = iter([1.0 / (i + 1) for i in range(100)])  # SDPA first, then each config faster
    monkeypatch.setattr(bench, "device_timer", lambda fn, **_: (fn(), next(times))[1])
    result = bench.prefill_sweep(sweep, "cpu")
    row = result["rows"][0]
    assert result["complete"] is True and row["best_config"] == "m64-n16-w2-s3-desc"  # stage 2's, the last timed
    assert list(row["triton_us_by_config"]) == [
        "m64-n32-w4-s3", "m64-n32-w4-s3-desc", "m64-n16-w4-s3",  # stage 0: the default both ways, the other tile
        "m64-n16-w2-s3",  # stage 1: stage 0's best (the last) at 2 warps; at 4 it was timed already
        "m64-n16-w2-s3-desc",  # stage 2: stage 1's best with descriptors
    ]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_a_sweep_whose_default_takes_descriptors_times_the_cache_only_walk_with_pointer_loads(monkeypatch):
    """Where the device's default config loads the step's rows through TMA descriptors (sm_90
    and later: the H200 run of 2026-11-30 at 17:56), the cache-only timing reads no step rows,
    so it keeps the pointer loads (descriptors load only the step's own rows) instead of failing
    the sweep with a ValueError before any config was timed."""
    bench = _bench()
    from tinyvllm.attention import triton_attention as ta

    monkeypatch.setattr(ta, "choose_kv_desc", lambda layout: True)
    result = bench.prefill_sweep(bench.SWEEP_DRY, "cpu", time_limit_s=0.0)
    row = result["rows"][0]
    assert row["default_config"].endswith("-desc")
    assert row["cache_only_default_us"] is not None and row["cache_only_default_us"] > 0
