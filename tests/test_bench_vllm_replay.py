"""bench/vllm_scheduler_replay.py without vLLM: its tinyvllm side reduces a run to the decisions
the trace of the same workload records, its comparison finds the first differing step, its
random workloads are reproducible and fit the engine's limits, and without vLLM importable it
says so in one line (exit 2). The replay against vLLM itself is the script's run, recorded in
bench/results/vllm_scheduler_replay.json (vLLM is not a dependency)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import vllm_scheduler_replay as replay  # noqa: E402

from tinyvllm.trace.workloads import scheduler_preemption  # noqa: E402


def test_the_tinyvllm_side_records_what_the_trace_of_the_same_workload_shows():
    """The first hand-written workload is the trace workload ``scheduler-preemption`` (tutorial
    02's): each step's scheduled tokens, admissions with their hits, preemptions and finishes
    must be the snapshots' own."""
    [workload] = [w for w in replay.hand_written() if w.name == "chunked prefill, budget 10"]
    steps = replay.run_tinyvllm(workload)
    trace = scheduler_preemption()
    assert len(steps) == len(trace.steps) == 9
    for step, snapshot in zip(steps, trace.steps):
        d = snapshot.scheduler
        assert step.scheduled == [(x.request_id, x.num_tokens) for x in d.scheduled]
        assert [(rid, hit) for rid, hit, _, _ in step.admitted] == sorted((x.request_id, x.num_hit_tokens) for x in d.scheduled if x.admitted)
        assert step.preempted == sorted(d.preempted) and step.finished == sorted(d.finished)
    assert any(s.preempted for s in steps) and any(resumed for s in steps for *_, resumed in s.admitted)
    assert steps[2].admitted == [("C", 8, (0, 1, 7), False)]  # C finds A's two full system-prompt blocks


def test_compare_names_the_first_step_that_differs():
    a = [replay.Step(scheduled=[("x", 4)]), replay.Step(scheduled=[("x", 1)], finished=["x"])]
    b = [replay.Step(scheduled=[("x", 4)]), replay.Step(scheduled=[("x", 1)])]
    assert replay.compare(a, a) is None
    diff = replay.compare(a, b)
    assert diff["step"] == 1 and diff["tinyvllm"]["finished"] == ["x"] and diff["vllm"]["finished"] == []
    assert replay.compare(a, a[:1]) == {"step": 1, "tinyvllm_steps": 2, "vllm_steps": 1}


def test_random_workloads_are_reproducible_and_fit_the_engine():
    for seed in range(50):
        w = replay.random_workload(seed)
        assert w == replay.random_workload(seed)
        assert w.num_blocks * w.block_size >= w.max_model_len  # one request of max_model_len fits
        assert all(len(a.prompt) + a.max_tokens <= w.max_model_len and a.max_tokens >= 1 for a in w.arrivals)
        steps = replay.run_tinyvllm(w)
        finished = sorted(rid for s in steps for rid in s.finished)
        assert finished == sorted(a.request_id for a in w.arrivals), f"seed {seed}: {finished}"


def test_without_vllm_the_script_says_so_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run([sys.executable, str(ROOT / "bench/vllm_scheduler_replay.py"), "--random", "0",
                             "--out", str(tmp_path / "r.json")], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert result.returncode == 2 and not (tmp_path / "r.json").exists()
    assert result.stderr.count("\n") == 1 and "vLLM's Python source is not importable" in result.stderr


def test_the_fake_proposer_is_right_up_to_the_position_the_tokens_choose():
    """``fake_drafts`` guesses the fake model's next k tokens and gets them wrong from a position
    the tokens choose; ``verified`` keeps exactly the right ones, then the target's own token."""
    kept_counts = set()
    for start in range(40):
        tokens = [start, start + 3, 7]
        drafts = replay.fake_drafts(tokens, 4, room=10)
        out = replay.verified(tokens, drafts)
        seq = list(tokens)
        for t in out:  # every token the target returns is the fake model's own next one
            assert t == replay.fake_next_token(seq)
            seq.append(t)
        kept = len(out) - 1
        assert drafts[:kept] == out[:kept] and (kept == 4 or drafts[kept] != out[kept])
        kept_counts.add(kept)
    assert kept_counts == {0, 1, 2, 3, 4}  # every acceptance length occurs
    assert replay.fake_drafts([1, 2], 4, room=2) == replay.fake_drafts([1, 2], 4, room=10)[:2]


def test_the_tinyvllm_side_verifies_drafts_within_the_budget():
    [workload] = [w for w in replay.hand_written() if w.name == "drafts in the budget"]
    steps = replay.run_tinyvllm(workload)
    drafted = [(i, rid, n) for i, s in enumerate(steps) for rid, n in s.drafts]
    assert drafted and all(n <= 3 for *_, n in drafted)
    for s in steps:
        assert sum(n for _, n in s.scheduled) <= workload.max_num_batched_tokens
        assert all(dict(s.scheduled)[rid] == 1 + n for rid, n in s.drafts)  # one real token and its drafts
