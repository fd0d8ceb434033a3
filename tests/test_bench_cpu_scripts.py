"""bench/sampler_cpu.py, bench/hashing.py, bench/bookkeeping.py, bench/ngram_proposer.py,
bench/rejection_sampler.py, bench/top_k_top_p.py, bench/beam_search.py, bench/embeddings.py,
bench/rerank.py: their --quick runs go through every code path and write the
JSON the README describes (timings mean nothing)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", *args],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip


def test_sampler_cpu_quick_writes_ratios_for_both_thread_counts(tmp_path):
    out = tmp_path / "sampler_cpu.json"
    result = _run("sampler_cpu.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and set(record["results_by_threads"]) == {"1", "2"}
    for by_threads in record["results_by_threads"].values():
        assert set(by_threads["ratios"]) == {
            "random_sample_old_over_new", "random_sample_seeded_old_over_new",
            "sampler_old_over_new", "sampler_seeded_old_over_new",
        }  # fmt: skip
        assert all(v > 0 for v in by_threads["median_ms"].values())


@pytest.mark.slow
def test_hashing_quick_checks_the_new_hashes_and_writes_ratios(tmp_path):
    out = tmp_path / "hashing.json"
    result = _run("hashing.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["block_size"] == 16
    assert set(record["ratios"]) == {
        f"{fn}_{path}_old_over_new" for fn in ("sha256", "builtin") for path in ("request", "per_block")
    }
    # The gc section: the counts of tracked objects are exact, whatever the timings.
    gc_run = record["gc"]["by_num_blocks"]["2000"]
    per_block = {v: d["tracked_objects_per_block"] for v, d in gc_run["variants"].items()}
    want = {"namedtuple": 3, "tuple": 2, "bytes": 2, "current": 2, "blocks_only": 1, "tuple_flat": 1, "tuple_frozen": 2}
    assert {v: round(n, 2) for v, n in per_block.items()} == want, per_block
    assert gc_run["variants"]["current"]["key_type"] == "tuple"  # the core's keys: only a block and its dict stay tracked
    assert set(gc_run["ratios"]) == {f"namedtuple_over_{v}_gc_ms" for v in want if v != "namedtuple"}
    assert all(d["gc_ms_median"] > 0 for d in gc_run["variants"].values())


@pytest.mark.slow
def test_bookkeeping_quick_reports_per_request_figures(tmp_path):
    out = tmp_path / "bookkeeping.json"
    result = _run("bookkeeping.py", "--cases", "stub", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["threads"] == 1
    case = record["cases"]["stub"]
    assert case["stub_forward"] is True and case["decode_steps_timed"] > 0
    assert record["repeats"] == 1 and case["runs_bookkeeping_us_per_req_step"] == [case["bookkeeping_us_per_req_step"]]
    assert case["bookkeeping_us_per_req_step"] > 0
    assert set(case["parts_us_per_req_step"]) == {
        "schedule", "update_states", "execute_model_other", "update_from_output", "engine_other",
    }  # fmt: skip


@pytest.mark.slow
def test_bookkeeping_stub_sweep_case_sweeps_in_every_forward(tmp_path):
    """stub_sweep: the stub forward also rewrites a --sweep-mb buffer, every call; the plain
    stub never does. Timings mean nothing here."""
    out = tmp_path / "bookkeeping.json"
    result = _run("bookkeeping.py", "--cases", "stub,stub_sweep", "--sweep-mb", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["sweep_mb"] == 2
    stub, swept = record["cases"]["stub"], record["cases"]["stub_sweep"]
    assert stub["stub_forward"] and swept["stub_forward"]
    assert stub["sweep_mb"] == 0 and swept["sweep_mb"] == 2
    assert swept["sweeps"] == swept["forward_calls"] > 0 and stub["sweeps"] == 0
    assert "stub_sweep: bookkeeping" in result.stdout


@pytest.mark.slow
def test_bookkeeping_counts_the_median_of_its_runs(tmp_path):
    """--repeats 3: every case runs three times and the record is the median run's."""
    out = tmp_path / "bookkeeping.json"
    result = _run("bookkeeping.py", "--cases", "stub", "--repeats", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    case = record["cases"]["stub"]
    assert record["repeats"] == 3 and len(case["runs_bookkeeping_us_per_req_step"]) == 3
    assert case["bookkeeping_us_per_req_step"] == sorted(case["runs_bookkeeping_us_per_req_step"])[1]


@pytest.mark.slow
def test_bookkeeping_quick_splits_per_request_and_per_step_costs(tmp_path):
    out = tmp_path / "bookkeeping.json"
    result = _run("bookkeeping.py", "--cases", "tiny,tiny_wide", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    narrow, wide = record["cases"]["tiny"], record["cases"]["tiny_wide"]
    assert (narrow["num_reqs"], wide["num_reqs"]) == (4, 8) and not wide["stub_forward"]
    split = record["split_per_request_and_per_step"]
    assert split["reqs"] == [4, 8]
    # The two numbers reproduce both measured totals per step, and each part's pair its part.
    for case in (narrow, wide):
        total = split["per_step_us"] + case["num_reqs"] * split["marginal_us_per_request"]
        assert abs(total - case["bookkeeping_us_per_step"]) < 1e-6 * max(1.0, total)
        for part, costs in split["parts"].items():
            part_total = costs["per_step_us"] + case["num_reqs"] * costs["marginal_us_per_request"]
            measured = case["parts_us_per_req_step"][part] * case["num_reqs"]
            assert abs(part_total - measured) < 1e-6 * max(1.0, measured), part
    assert record["split_per_request_and_per_step_stub"] is None  # no stub cases in this run


@pytest.mark.slow
def test_cascade_dry_run_times_both_engines_on_the_same_prompts(tmp_path):
    """bench/cascade.py --dry-run: both engines (split on and off) ran every round and the
    ratio is theirs; timings mean nothing."""
    out = tmp_path / "cascade.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "cascade.py"), "--dry-run", "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["repeats"] == 2
    [w] = record["threads"]["1"]["workloads"].values()
    assert {k: len(v) for k, v in w["seconds"].items()} == {"cascade": 2, "one_group": 2}
    assert w["ratio_one_group_over_cascade"] == w["median_s"]["one_group"] / w["median_s"]["cascade"]
    assert w["split_decode_groups"]["cascade"] > 0 and w["split_decode_groups"]["one_group"] == 0


def test_ngram_proposer_quick_checks_both_ways_agree_and_writes_ratios(tmp_path):
    out = tmp_path / "ngram_proposer.json"
    result = _run("ngram_proposer.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["workload"]["tokens"] > 10_000
    assert [(c["num_reqs"], c["tokens_per_request"]) for c in record["cases"]] == [(1, 64), (4, [256, 128])]
    for case in record["cases"]:
        assert set(case["us_per_request_step"]) == {"one_by_one", "batch"}
        assert all(len(v) == 2 for v in case["rounds_us_per_request_step"].values())
        assert case["one_by_one_over_batch"] > 0


def test_rejection_sampler_quick_times_old_and_new(tmp_path):
    out = tmp_path / "rejection_sampler.json"
    result = _run("rejection_sampler.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["threads"] == 1 and record["k"] == 3
    assert [(c["num_reqs"], c["vocab"]) for c in record["cases"]] == [(1, 512), (4, 512)]
    for case in record["cases"]:
        assert set(case["ms_per_step"]) == {"old", "new"} and case["old_over_new"] > 0
        assert all(1 <= n <= 4 for n in case["tokens_kept_per_request_step"].values())  # 1 to k + 1 tokens a step


def test_top_k_top_p_quick_times_old_and_new_on_the_same_masks(tmp_path):
    out = tmp_path / "top_k_top_p.json"
    result = _run("top_k_top_p.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and set(record["cases_by_threads"]) == {"1", "2"}
    for cases in record["cases_by_threads"].values():
        assert [(c["workload"], c["vocab"]) for c in cases] == [
            ("qwen3_defaults", 512), ("mixed", 512), ("top_p_only", 512)
        ]  # fmt: skip
        for case in cases:
            assert set(case["ms_per_call"]) == {"old", "new"} and case["old_over_new"] > 0
            assert all(len(v) == 2 for v in case["rounds_ms_per_call"].values())


def test_beam_search_quick_times_every_system_on_the_same_beams(tmp_path):
    """bench/beam_search.py --quick: seven systems, the same beams from each (transformers'
    per-prompt search is the reference), and the prefix cache's hits growing as blocks shrink."""
    out = tmp_path / "beam_search.json"
    result = _run("beam_search.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["workload"]["beam_width"] == 2 and record["repeats"] == 1
    assert all(record["beams_equal_hf_per_prompt"].values()) and len(record["beams_equal_hf_per_prompt"]) == 7
    hits = {name: counts["found"] for name, counts in record["prefix_cache_per_search"].items()}
    assert hits["tinyvllm_no_prefix_cache"] == 0 < hits["tinyvllm_block_size_4"] < hits["tinyvllm_block_size_1"]
    assert all(v > 0 for v in record["ratios"].values())


def test_embeddings_quick_times_every_system_on_the_same_vectors(tmp_path):
    """bench/embeddings.py --quick: four systems on two workloads, every vector transformers'
    (float32 rounding apart), and the prefix cache finding the shared instruction only."""
    out = tmp_path / "embeddings.json"
    result = _run("embeddings.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["repeats"] == 1 and set(record["workloads"]) == {"plain", "instruction"}
    for name, workload in record["workloads"].items():
        assert workload["num_prompts"] == 6 and len(workload["median_s"]) == 4
        assert all(diff < 1e-4 for diff in workload["max_abs_diff_from_hf_per_prompt"].values())
        found = {system: counts["found"] for system, counts in workload["prefix_cache_per_run"].items()}
        assert found["tinyvllm_no_prefix_cache"] == 0
        assert (found["tinyvllm"] > 0) is (name == "instruction"), found  # a run's own prompts share only the instruction


def test_rerank_quick_times_every_system_on_the_same_scores(tmp_path):
    """bench/rerank.py --quick: four systems, every score transformers' (float32 rounding
    apart), and the prefix cache finding the shared query's blocks, only with caching on."""
    out = tmp_path / "rerank.json"
    result = _run("rerank.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["quick"] is True and record["num_docs"] == 6 and len(record["median_s"]) == 4
    assert all(diff < 1e-5 for diff in record["max_abs_diff_from_hf_per_pair"].values())
    found = {system: counts["found"] for system, counts in record["prefix_cache_per_run"].items()}
    assert found["tinyvllm_no_prefix_cache"] == 0 < found["tinyvllm"] < record["pair_tokens"]
