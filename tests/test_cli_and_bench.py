"""The command line, and the benchmark scripts' CPU paths (``--dry-run``: every code path, timings unchecked)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def run_bench(script: str, out_file: Path, *args: str) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / script), "--dry-run", "--out", str(out_file), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out_file.read_text())


def check_engine_record(engine: dict, caching: bool) -> None:
    assert engine["attention_backend_requested"] == "auto"
    assert engine["attention_backend"] not in ("", "auto")  # what "auto" resolved to
    assert engine["enable_prefix_caching"] is caching and engine["device"] == "cpu"


@pytest.mark.slow
def test_throughput_bench_dry_run(tmp_path):
    result = run_bench("throughput.py", tmp_path / "throughput.json", "--repeats", "2", "--async-ab")
    assert result["dry_run"] is True and result["repeats"] == 2
    # the async-scheduling A/B: the same full workload, every token produced, a ratio beside it
    assert result["tinyvllm_full_workload_async"]["output_tokens"] == result["tinyvllm_full_workload"]["output_tokens"]
    assert result["async_speedup_full_workload"] > 0
    full, subset, hf = (result[k] for k in ("tinyvllm_full_workload", "tinyvllm_on_hf_subset", "transformers_on_hf_subset"))
    assert full["requests"] == 4 and subset["requests"] == hf["requests"] == 2
    assert subset["output_tokens"] == hf["output_tokens"]
    assert all(len(r["seconds_per_repeat"]) == 2 for r in (full, subset, hf))
    # Caching off: no run finds an earlier run's prompts in the cache.
    assert full["hit_tokens"] == subset["hit_tokens"] == [0, 0]
    check_engine_record(result["engine"], caching=False)
    counts = result["token_counts"]
    assert counts["full_output"] == full["output_tokens"] and counts["subset_prompt"] == subset["prompt_tokens"]
    assert counts["hf_padded_prompt"] >= counts["subset_prompt"] and hf["generated_tokens"] == [counts["hf_generated"]] * 2
    assert counts["hf_generated"] >= counts["subset_output"]
    assert result["speedup_vs_transformers_same_subset"] > 0 and result["complete"] is True


@pytest.mark.slow
def test_throughput_bench_mode_ab_without_transformers(tmp_path):
    """``--cudagraph-mode-ab FULL --no-transformers``: the full workload sync, async, and async
    once more under the other mode (resolved as the backend allows: the CPU's torch backend
    has no full graphs, so PIECEWISE), every token produced; no baseline, no subset."""
    result = run_bench("throughput.py", tmp_path / "throughput.json", "--repeats", "1", "--async-ab",
                       "--cudagraph-mode-ab", "FULL", "--no-transformers")  # fmt: skip
    full, ab = result["tinyvllm_full_workload"], result["tinyvllm_full_workload_async_mode_ab"]
    assert ab["output_tokens"] == result["tinyvllm_full_workload_async"]["output_tokens"] == full["output_tokens"]
    assert result["mode_ab"]["cudagraph_mode"] == "FULL" and result["mode_ab"]["engine"]["cudagraph_mode"] == "PIECEWISE"
    assert result["mode_ab_speedup"] > 0 and result["complete"] is True
    assert not {"tinyvllm_on_hf_subset", "transformers_on_hf_subset", "speedup_vs_transformers_same_subset"} & set(result)
    with pytest.raises(AssertionError):  # the mode A/B compares with the async run: refused without it
        run_bench("throughput.py", tmp_path / "refused.json", "--cudagraph-mode-ab", "FULL")


def cut_short(main, argv: list[str]) -> None:
    """Run a bench script's ``main`` in this process until the patched-in KeyboardInterrupt
    (its time budget) stops it; the dry run's one torch thread is undone for later tests."""
    import pytest
    import torch

    threads = torch.get_num_threads()
    try:
        with pytest.raises(KeyboardInterrupt):
            main(argv)
    finally:
        torch.set_num_threads(threads)


def test_throughput_bench_cut_short_keeps_the_full_workload(tmp_path, monkeypatch):
    """The record is written after every timed run, the full workload first: a run that dies
    while loading transformers (as a time budget would cut it) still leaves the headline."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check
    import throughput

    def out_of_time(*args, **kwargs):
        raise KeyboardInterrupt("the time budget ran out")

    monkeypatch.setattr(throughput, "load_transformers", out_of_time)
    out = tmp_path / "throughput.json"
    cut_short(throughput.main, ["--dry-run", "--repeats", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["complete"] is False and "transformers_on_hf_subset" not in record
    assert record["tinyvllm_full_workload"]["requests"] == 4
    figures = gpu_check.throughput_figures(record)
    assert figures["complete"] is False and figures["tinyvllm_tok_per_s"] > 0
    assert "speedup_vs_transformers_same_subset" not in figures
    check_engine_record(record["engine"], caching=False)


@pytest.mark.slow
def test_cpu_throughput_bench_dry_run(tmp_path):
    result = run_bench("cpu_throughput.py", tmp_path / "cpu.json")
    assert result["mode"] == "dry" and set(result["threads"]) == set(result["ratios"]) == {"1"}
    assert {"machine", "versions", "model", "engine", "workload", "token_counts", "repeats"} <= set(result)
    check_engine_record(result["engine"]["throughput_and_batch1"], caching=False)
    check_engine_record(result["engine"]["prefix_caching_on"], caching=True)
    work, counts = result["workload"], result["token_counts"]
    rows = work["num_seqs"]
    assert len(work["prompt_lens"]) == len(work["output_lens"]) == rows
    assert counts["prompt"] == sum(work["prompt_lens"]) and counts["output"] == sum(work["output_lens"])
    assert counts["useful_total"] == counts["prompt"] + counts["output"]
    assert counts["hf_padded_prompt"] == rows * max(work["prompt_lens"])
    assert counts["hf_generated"] == rows * max(work["output_lens"])
    per = result["threads"]["1"]
    assert per["torch_threads"] == 1
    tp = per["throughput"]
    assert tp["tinyvllm"]["output_tokens_computed"] == counts["output"]
    assert tp["hf_dynamic"]["output_tokens_computed"] == tp["hf_static"]["output_tokens_computed"] == counts["hf_generated"]
    assert all(len(tp[s]["seconds"]) == result["repeats"] for s in ("tinyvllm", "hf_dynamic", "hf_static"))
    b1 = per["batch1"]
    assert len(b1["tinyvllm"]["tokens_generated"]) == len(b1["hf_static"]["tokens_generated"]) == b1["new_tokens"]
    pc = per["prefix_caching"]
    assert pc["prompt_tokens"] == pc["num_seqs"] * (pc["shared_tokens"] + pc["unique_tokens"])
    assert pc["caching_off"]["hit_tokens"] == [0] * result["repeats"]
    hits = pc["caching_on"]["hit_tokens"]
    assert all(0 < h <= (pc["num_seqs"] - 1) * pc["shared_tokens"] for h in hits)  # at most the shared prefixes
    assert pc["caching_on"]["cached_tokens_in_outputs"] == hits
    assert set(result["ratios"]["1"]) == {
        "tinyvllm_over_hf_dynamic", "tinyvllm_over_hf_static", "tinyvllm_over_hf_best",
        "batch1_decode_tinyvllm_over_hf_static", "prefix_caching_on_over_off_input",
    }  # fmt: skip


def test_prefix_caching_bench_cut_short_keeps_the_cases_it_measured(tmp_path, monkeypatch):
    """The record is written after every case: a run cut short in the second case keeps the first."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check
    import prefix_caching

    measure, calls = prefix_caching.bench_case, []

    def second_case_runs_out_of_time(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("the time budget ran out")
        return measure(*args, **kwargs)

    monkeypatch.setattr(prefix_caching, "bench_case", second_case_runs_out_of_time)
    out = tmp_path / "prefix.json"
    cut_short(prefix_caching.main, ["--dry-run", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["complete"] is False and list(record["threads"]["1"]["cases"]) == ["hit_49"]
    figures = gpu_check.prefix_caching_figures(record)
    assert figures["complete"] is False and list(figures["ratios"]) == ["hit_49"]


def test_prefix_caching_bench_runs_the_cases_asked_for_and_refuses_unknown_ones(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import prefix_caching

    out = tmp_path / "prefix.json"
    assert prefix_caching.main(["--dry-run", "--cases", "hit_0", "--out", str(out)]) == 0
    assert list(json.loads(out.read_text())["threads"]["1"]["cases"]) == ["hit_0"]
    with pytest.raises(SystemExit):
        prefix_caching.main(["--dry-run", "--cases", "hit_0,hit_99", "--out", str(out)])
    assert "unknown case(s) ['hit_99']" in capsys.readouterr().err


@pytest.mark.seed("004:benchmark")
@pytest.mark.slow
def test_prefix_caching_bench_dry_run(tmp_path):
    result = run_bench("prefix_caching.py", tmp_path / "prefix.json")
    assert result["mode"] == "dry" and set(result["threads"]) == {"1"} and result["complete"] is True
    check_engine_record(result["engine"]["caching_off"], caching=False)
    check_engine_record(result["engine"]["caching_on"], caching=True)
    cases = result["threads"]["1"]["cases"]
    assert set(cases) == set(result["seed_004_reference"]) == {"hit_49", "hit_37", "hit_0"}
    for name, case in cases.items():
        off, on = case["caching_off"], case["caching_on"]
        assert case["prompt_tokens"] == case["num_seqs"] * (case["shared"] + case["unique"])
        assert off["hit_tokens"] == [0] * result["repeats"] and off["hit_rate"] == 0
        assert on["looked_up_tokens"] == [case["prompt_tokens"]] * result["repeats"]
        assert on["cached_tokens_in_outputs"] == on["hit_tokens"]
        if name == "hit_0":  # nothing shared: caching looks up every block and finds none
            assert case["expected_hit_rate_upper_bound"] == 0 and on["hit_tokens"] == [0] * result["repeats"]
            continue
        # Every request after the first finds the shared prefix's full blocks, and nothing more.
        assert 0.5 * case["expected_hit_rate_upper_bound"] < on["hit_rate"] <= case["expected_hit_rate_upper_bound"]
        for run in (off, on):
            assert run["output_tokens"] == [case["num_seqs"] * case["output"]] * result["repeats"]
            assert len(run["ttft_s_last_repeat"]) == case["num_seqs"] and min(run["ttft_s_last_repeat"]) > 0
        ratios = case["ratios"]
        assert set(ratios) == {
            "input_throughput_on_over_off", "mean_ttft_off_over_on",
            "input_throughput_on_over_off_per_repeat", "mean_ttft_off_over_on_per_repeat",
        }  # fmt: skip
        # Each repeat's pair ran the same prompts back to back: its own ratio, one per repeat.
        assert ratios["input_throughput_on_over_off_per_repeat"] == [
            a / b for a, b in zip(off["seconds"], on["seconds"])
        ]  # fmt: skip
        assert ratios["mean_ttft_off_over_on_per_repeat"] == [
            a / b for a, b in zip(off["mean_ttft_s"], on["mean_ttft_s"])
        ]  # fmt: skip


@pytest.mark.slow
def test_cpu_profile_dry_run_splits_the_whole_run_into_its_parts(tmp_path):
    """bench/cpu_profile.py --dry-run: the parts add up to the run, the forward's own parts
    were all hooked (the tiny model runs the torch backend's plan too); timings mean nothing."""
    result = run_bench("cpu_profile.py", tmp_path / "profile.json")
    assert result["dry_run"] is True and result["engine"]["attention_backend"] == "torch"
    run = result["threads"]["1"]
    assert set(run["parts_s"]) == set(result["parts"])
    assert abs(sum(run["parts_s"].values()) - run["seconds"]) < 1e-9 * max(1.0, run["seconds"])
    assert abs(sum(run["shares"].values()) - 1) < 1e-9
    for part in ("attention", "kv_write", "attention_plan", "forward_other", "lm_head", "sampler", "bookkeeping"):
        assert run["parts_s"][part] > 0, part
    assert run["total_tokens"] > 0 and run["tok_per_s"] == run["total_tokens"] / run["seconds"]
    # Decode steps: every running request gets one token per step, so the requests of the
    # decode steps add up to the outputs less the one each request got from its prefill.
    decode = run["decode_steps"]
    assert decode["request_steps"] == run["output_tokens"] - result["workload"]["num_seqs"]
    assert 0 < decode["steps_all_running"] <= decode["steps"]
    assert decode["bookkeeping_us_per_req_step"] > 0 and decode["bookkeeping_us_per_req_step_all_running"] > 0


@pytest.mark.slow
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
