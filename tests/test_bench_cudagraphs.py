"""bench/cudagraphs.py: its --dry-run runs every code path (every CUDA-graph mode, emulated,
Triton under the interpreter) on the tiny model, and the timed steps ran in the expected mode."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.mark.slow
@pytest.mark.seed("000:performance")
def test_cudagraphs_bench_dry_run(tmp_path):
    out_file = tmp_path / "cudagraphs.json"
    cmd = [sys.executable, str(ROOT / "bench" / "cudagraphs.py"), "--dry-run", "--out", str(out_file)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out_file.read_text())
    assert result["dry_run"] is True and result["complete"] is True
    assert {"torch", "triton", "device", "torch_threads"} <= result["environment"].keys()
    assert list(result["modes"]) == MODES and list(result["ratios"]) == MODES
    assert result["stats_check"] is True
    expected = {"NONE": "NONE", "PIECEWISE": "PIECEWISE"}  # the three others decode in FULL graphs
    for mode, m in result["modes"].items():
        assert m["resolved_mode"] == mode, "the Triton backend supports every mode: nothing is downgraded"
        assert [r["batch"] for r in m["latency"]] == [1, 2]
        for r in m["latency"]:
            assert r["runtime_modes_timed"] == {expected.get(mode, "FULL"): r["timed_steps"]}
            assert r["median_step_s"] > 0 and r["tok_per_s"] > 0
        assert m["throughput"]["output_tokens"] > 0 and m["throughput"]["stats_ok"] is True
        assert (m["graphs_captured"]["FULL"] > 0) == (mode.startswith("FULL"))
        assert (m["graphs_captured"]["PIECEWISE"] > 0) == (mode in ("PIECEWISE", "FULL_AND_PIECEWISE"))
        for r in m["latency"]:  # the profile runs on the CPU too, with no device time to count
            if mode in ("NONE", "FULL_AND_PIECEWISE"):
                assert r["profile"]["steps"] == 2 and r["profile"]["device_busy_share"] is None
                assert r["profile"]["device_idle_gaps"] is None
                phases = r["profile"]["phases_ms"]
                assert set(phases) == {"schedule", "update_states", "forward", "logits", "sample",
                                       "execute_model_rest", "update_from_output", "engine_rest"}  # fmt: skip
                assert min(phases["forward"], phases["schedule"], phases["sample"]) > 0
                assert sum(phases.values()) == pytest.approx(r["profile"]["step_ms"])
                parts = r["profile"]["forward_parts_ms"]  # the forward, split: inputs, then the launch
                assert set(parts) == {"step_inputs", "buffers_fill", "launch"}
                assert min(parts.values()) > 0 and sum(parts.values()) == pytest.approx(phases["forward"])
                probe = r["profile"]["replay_probe"]  # the decode step's FULL graph replayed alone
                if mode == "NONE":
                    assert probe is None  # no graph to replay
                else:
                    assert probe["emulated"] is True and min(probe["host_us_idle"], probe["host_us_queued"]) > 0
                    assert probe["wall_us_per_replay_queued"] >= probe["host_us_queued"]
            else:
                assert r["profile"] is None
    mixed_mode = {"FULL_AND_PIECEWISE": "PIECEWISE", "FULL": "FULL"}  # the A/B: a mixed step in each
    for mode, m in result["modes"].items():
        for r in m["latency"]:
            if mode not in mixed_mode or r["batch"] == 2:  # 2 decodes + 3 prompt tokens: no graph that large
                assert r["mixed"] is None
                continue
            mixed = r["mixed"]
            modes = {"decode": {"FULL": 1}, "mixed": {mixed_mode[mode]: 1}}
            if mode == "FULL_AND_PIECEWISE":  # a third step: the pre-bound launch (the JIT on the CPU)
                modes["mixed_prebound"] = {"PIECEWISE": 1}
                assert mixed["prebound_error"] is None and mixed["jit_over_prebound"] > 0
            assert mixed["runtime_modes"] == modes
            key = mixed["mixed_batch_descriptor"]
            assert key["num_tokens"] == 4 and key["uniform"] is False  # 1 + 3 tokens, not uniform
            assert mixed["mixed_step_s"] > 0 and mixed["mixed_over_decode"] > 0 and mixed["stats_ok"] is True
    [(batch, ab)] = result["mixed_ab"].items()
    assert batch == "1" and ab["piecewise_over_full"] > 0 and ab["mixed_over_decode_full"] > 0
    assert ab["mixed_ms_piecewise_prebound"] > 0 and ab["piecewise_jit_over_prebound"] > 0
    assert "mixed step, B=1 decodes + 3 prompt tokens: PIECEWISE" in out.stdout
    for ratio in result["ratios"].values():
        assert all(x > 0 for x in ratio["latency_speedup_vs_none"].values())
        assert ratio["throughput_ratio_vs_none"] > 0
    assert result["ratios"]["NONE"]["throughput_ratio_vs_none"] == 1.0
    assert "stats ok" in out.stdout and "WRONG" not in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="only meaningful without CUDA; gpu.sh runs the real one")
def test_cudagraphs_bench_without_cuda_exits_cleanly_with_a_message():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "cudagraphs.py")],
                         capture_output=True, text=True, env=ENV, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "no CUDA device" in out.stdout


def test_union_length_counts_overlapping_intervals_once():
    sys.path.insert(0, str(ROOT / "bench"))
    from cudagraphs import union_length

    assert union_length([]) == 0.0
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # [0, 3] and [5, 6]
    assert union_length([(4.0, 5.0), (0.0, 10.0), (2.0, 3.0)]) == 10.0  # nested, out of order
    assert union_length([(0.0, 1.0), (1.0, 2.0)]) == 2.0  # touching


def test_idle_gaps_bins_the_device_idle_between_ops_by_length():
    """The idle time between the device's ops, binned by gap length and averaged per step:
    a graph's back-to-back kernels leave gaps of a few µs, a host-bound step one long gap."""
    sys.path.insert(0, str(ROOT / "bench"))
    from cudagraphs import GAP_BINS_US, idle_gaps

    assert GAP_BINS_US == (2.0, 5.0, 20.0, 100.0)
    # two steps: kernels [0, 10] [11, 20] (1 µs gap) [15, 18] (inside) [23, 30] (3 µs gap),
    # then 150 µs idle (the host), then [180, 190] [200, 210] (10 µs) [260, 261] (50 µs)
    intervals = [(11.0, 20.0), (0.0, 10.0), (15.0, 18.0), (23.0, 30.0), (180.0, 190.0), (200.0, 210.0), (260.0, 261.0)]
    gaps = idle_gaps(intervals, steps=2)
    assert gaps == {
        "<2us": {"count": 0.5, "us": 0.5}, "2-5us": {"count": 0.5, "us": 1.5},
        "5-20us": {"count": 0.5, "us": 5.0}, "20-100us": {"count": 0.5, "us": 25.0},
        ">=100us": {"count": 0.5, "us": 75.0},
    }  # fmt: skip
    assert idle_gaps([(0.0, 1.0), (1.0, 2.0)], steps=1) == {label: {"count": 0.0, "us": 0.0} for label in gaps}
    assert idle_gaps([], steps=1) == {label: {"count": 0.0, "us": 0.0} for label in gaps}


def test_each_kernel_ab_flag_switches_the_variable_its_kernel_reads():
    """``--rms-norm-ab``, ``--rotary-ab`` and ``--silu-and-mul-ab`` each rebuild the engine with
    one variable set to "torch", ``--fused-kv-write-ab`` with its variable "0": the one its
    module reads, so the A/B changes that kernel only."""
    sys.path.insert(0, str(ROOT / "bench"))
    import cudagraphs

    from tinyvllm.models import activation, qk_norm_rotary, rms_norm, rotary

    assert cudagraphs.KERNEL_AB == {"rms_norm_ab": (rms_norm.IMPL_ENV, "torch"), "rotary_ab": (rotary.IMPL_ENV, "torch"),
                                    "silu_and_mul_ab": (activation.IMPL_ENV, "torch"),
                                    "fused_kv_write_ab": (qk_norm_rotary.FUSED_KV_WRITE_ENV, "0")}  # fmt: skip
    assert set(cudagraphs.KERNEL_AB_WHAT) == set(cudagraphs.KERNEL_AB)
