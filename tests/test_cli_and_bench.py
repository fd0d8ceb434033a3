"""The command line and the throughput benchmark's CPU path (``--dry-run``)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"}


def test_cli_generate_prints_the_completion_and_figures(tiny_model_dirs):
    cmd = [sys.executable, "-m", "tinyvllm", "generate", "--model", str(tiny_model_dirs["qwen3"]),
           "--prompt", "def add(a, b):", "--max-tokens", "5", "--device", "cpu", "--max-model-len", "64"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr
    *text, figures = out.stdout.rstrip("\n").split("\n")
    assert figures.startswith("[tinyvllm] prompt ") and "generated 5 tokens" in figures and "tok/s" in figures


def test_cli_reports_bad_input_as_an_error(tmp_path):
    cmd = [sys.executable, "-m", "tinyvllm", "generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_throughput_bench_dry_run(tmp_path):
    out_file = tmp_path / "throughput.json"
    cmd = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--dry-run", "--out", str(out_file)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out_file.read_text())
    assert result["dry_run"] is True
    assert result["tinyvllm_full_workload"]["requests"] == 4
    assert result["tinyvllm_on_hf_subset"]["output_tokens"] == result["transformers_on_hf_subset"]["output_tokens"]
    assert result["speedup_vs_transformers_same_subset"] > 0


def test_cli_cudagraph_mode_flag_runs_emulated_graphs(tiny_model_dirs):
    cmd = [sys.executable, "-m", "tinyvllm", "generate", "--model", str(tiny_model_dirs["qwen3"]),
           "--prompt", "def add(a, b):", "--max-tokens", "3", "--device", "cpu", "--max-model-len", "64",
           "--cudagraph-mode", "PIECEWISE"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "cudagraph_mode PIECEWISE on cpu: CUDA graphs are emulated" in out.stderr
    assert "generated 3 tokens" in out.stdout
    eager = subprocess.run(cmd[:-2] + ["--enforce-eager"], capture_output=True, text=True, env=ENV, timeout=300)
    assert eager.returncode == 0 and "emulated" not in eager.stderr
    assert eager.stdout.split("\n")[0] == out.stdout.split("\n")[0], "graphs changed the completion"
    bad = subprocess.run(cmd[:-1] + ["full"], capture_output=True, text=True, env=ENV, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'full'" in bad.stderr
