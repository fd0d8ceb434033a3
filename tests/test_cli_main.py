"""Every ``tinyvllm`` subcommand, driven through ``cli.main`` with real arguments.

Contract (``tinyvllm/cli.py``): ``generate``, ``serve``, ``tiny-model``, ``train-tiny`` and
``trace`` (``--list``, ``--workload``, ``--prompts``) each run to the end and return 0 with
what they print or write; the cheap checks (an empty ``--prompt``, a port in use,
``--threads``) fail in a fraction of a second, before torch or the model loads, as one line
and status 2. The engine runs on the shipped model (``stdlib_tiny``) on the CPU.
"""

from __future__ import annotations

import pytest

from tinyvllm import cli


def test_trace_list_prints_every_workload(capsys):
    from tinyvllm.trace.workloads import WORKLOADS

    assert cli.main(["trace", "--list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(WORKLOADS)
    assert "seed002-prefix-caching" in out


def test_trace_workload_writes_the_viewer(tmp_path, capsys):
    out_html = tmp_path / "trace.html"
    assert cli.main(["trace", "--workload", "seed002-prefix-caching", "--out", str(out_html)]) == 0
    html = out_html.read_text(encoding="utf-8")
    assert html.startswith("<!doctype html>") and html.count("<svg") >= 7  # a still per step
    printed = capsys.readouterr().out
    assert printed.startswith("[tinyvllm] 7 steps of ") and str(out_html) in printed  # steps 0-6 of seed 002 §3.2


def test_trace_prompts_runs_the_shipped_model(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n\ndef main():\n", encoding="utf-8")
    out_html, out_json = tmp_path / "t.html", tmp_path / "t.json"
    argv = ["trace", "--prompts", str(prompts), "--max-tokens", "3", "--device", "cpu", "--max-model-len", "64",
            "--num-gpu-blocks-override", "16", "--out", str(out_html), "--json", str(out_json)]  # fmt: skip
    assert cli.main(argv) == 0
    import json

    trace = json.loads(out_json.read_text(encoding="utf-8"))
    assert trace["title"] == "2 prompts on stdlib_tiny, block size 16"
    assert len(trace["steps"]) >= 3  # the prefill step, then at least two decode steps of 3 tokens each
    assert out_html.stat().st_size > 0
    assert capsys.readouterr().out.startswith(f"[tinyvllm] {len(trace['steps'])} steps of ")
