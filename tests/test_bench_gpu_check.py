"""``bench/gpu.sh`` (``bench/gpu_check.py``), checked on the CPU: the budgets fit eight minutes,
a step whose time is gone is skipped and said so, a failing or hanging step is recorded and
the next one still runs, and the dry run leaves exactly the summary and the log, in the
summary's schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402
import gpu_goals  # noqa: E402

STEP_NAMES = ["environment", "gpu_tests", "throughput", "cudagraph_latency", "prefix_caching", "attention_prefill"]


def test_the_steps_run_in_the_issues_order_and_their_budgets_fit_eight_minutes():
    assert [s.name for s in gpu_check.STEPS] == STEP_NAMES
    assert sum(s.budget_s for s in gpu_check.STEPS) <= gpu_check.TOTAL_BUDGET_S == 480
    assert all(s.budget_s >= gpu_check.MIN_STEP_S for s in gpu_check.STEPS)


def test_a_step_gets_its_budget_cut_to_what_is_left_or_is_skipped():
    step = gpu_check.Step("x", 100, "")
    assert gpu_check.step_timeout(step, 0, 480) == 100
    assert gpu_check.step_timeout(step, 400, 480) == 80  # cut to what is left
    assert gpu_check.step_timeout(step, 471, 480) is None  # 9 s left: under the floor of 10
    assert gpu_check.step_timeout(gpu_check.Step("y", 5, ""), 476, 480) is None  # 4 s left of its 5
    assert gpu_check.step_timeout(gpu_check.Step("y", 5, ""), 474, 480) == 5


def test_a_dry_run_stretches_every_budget_and_the_total_alike(tmp_path):
    """The budgets are a GPU's; on a loaded CPU a dry-run step may take longer than its budget
    and still be right. A step of budget 1 s that takes 1.5 s passes under a scale of 3 (and
    the check's total, 2 s, stretches with it); the header says so."""
    step = gpu_check.Step("x", 100, "")
    assert gpu_check.step_timeout(step, 0, 480, scale=4) == 400
    assert gpu_check.step_timeout(step, 1900, 480, scale=4) == 20  # 1,920 s in all
    assert gpu_check.step_timeout(step, 1911, 480, scale=4) is None  # 9 s left: under the floor
    steps = (gpu_check.Step("slow", 1, "takes 1.5 s"), gpu_check.Step("after", 1, "exits 0"))
    scripts = {"slow": "import time; time.sleep(1.5)", "after": "print('ran')"}

    def command(step, python, work, dry_run, quick):
        return [python, "-c", scripts[step.name]]

    summary = gpu_check.run_check(tmp_path, dry_run=True, quick=False, steps=steps, total_s=2, command=command, budget_scale=3)
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [("slow", "passed"), ("after", "passed")]
    assert summary["budget_scale"] == 3 and summary["total_budget_s"] == 2 and summary["passed"] is True
    assert "== slow (budget 1 s x3, at 0 s of 2 x3) ==" in (tmp_path / gpu_check.LOG).read_text()
    unscaled = gpu_check.run_check(tmp_path, dry_run=True, quick=False, steps=steps[:1], total_s=2, command=command)
    assert (unscaled["steps"][0]["reason"], unscaled["budget_scale"]) == ("timed out after 1 s", 1.0)


@pytest.mark.parametrize("quick", [False, True])
def test_each_step_runs_its_script_with_the_shared_model_folder(tmp_path, quick):
    commands = {s.name: gpu_check.step_command(s, "py", tmp_path, False, quick) for s in gpu_check.STEPS}
    assert commands["gpu_tests"][:4] == ["py", "bench/gpu_tests.py", "-m", "gpu"]  # pytest, the kernels apart
    assert "--collect-only" not in commands["gpu_tests"]
    assert commands["throughput"][commands["throughput"].index("--num-seqs") + 1] == ("128" if quick else "256")
    assert commands["cudagraph_latency"][commands["cudagraph_latency"].index("--batches") + 1] == "1,32"
    assert "--gpu" in commands["prefix_caching"]
    assert "--async-ab" in commands["throughput"] and "--async-ab" in commands["cudagraph_latency"]  # issue 39's A/B
    for name in ("throughput", "cudagraph_latency", "prefix_caching"):
        cmd = commands[name]
        assert cmd[cmd.index("--model-folder") + 1] == str(tmp_path / "model")  # built once, shared
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / f"{name}.json")
        assert ("--quick" in cmd) == (quick and name != "throughput")
    dry = gpu_check.step_command(gpu_check.STEPS[1], "py", tmp_path, True, False)
    assert "--collect-only" in dry
    sweep = commands["attention_prefill"]
    assert sweep[:3] == ["py", "bench/attention.py", "--prefill-sweep"]
    assert sweep[sweep.index("--out") + 1] == str(tmp_path / "attention_prefill.json")
    assert int(sweep[sweep.index("--time-limit") + 1]) == gpu_check.ATTENTION_SWEEP_LIMIT_S // (2 if quick else 1)
    assert gpu_check.ATTENTION_SWEEP_LIMIT_S < gpu_check.STEPS[-1].budget_s - 10  # room to start and finish


def test_a_failing_a_hanging_and_a_late_step_are_recorded_and_the_others_still_run(tmp_path):
    steps = (
        gpu_check.Step("fails", 10, "exits 3"),
        gpu_check.Step("hangs", 2, "sleeps past its budget"),
        gpu_check.Step("passes", 3, "exits 0"),
        gpu_check.Step("late", 10, "no time left for it"),
    )
    scripts = {
        "fails": "print('something broke'); raise SystemExit(3)",
        "hangs": "import time; print('waiting', flush=True); time.sleep(60)",
        "passes": "print('fine')",
        "late": "print('never runs')",
    }

    def command(step, python, work, dry_run, quick):
        return [python, "-c", scripts[step.name]]

    summary = gpu_check.run_check(tmp_path, dry_run=True, quick=False, steps=steps, total_s=11, command=command)
    by_name = {s["name"]: s for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]] == ["fails", "hangs", "passes", "late"]
    assert (by_name["fails"]["status"], by_name["fails"]["reason"]) == ("failed", "exit status 3")
    assert by_name["fails"]["output_tail"] == ["something broke"]
    assert (by_name["hangs"]["status"], by_name["hangs"]["reason"]) == ("failed", "timed out after 2 s")
    assert 1.9 <= by_name["hangs"]["seconds"] < 10
    assert by_name["passes"]["status"] == "passed"
    assert (by_name["late"]["status"], by_name["late"]["reason"]) == ("skipped", "time")
    assert summary["passed"] is False
    assert json.loads((tmp_path / gpu_check.SUMMARY).read_text()) == summary
    log = (tmp_path / gpu_check.LOG).read_text()
    assert "something broke" in log and "waiting" in log and "never runs" not in log


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TINYVLLM_GPU_DRY_RUN_IN_GPU_VENV") == "1",
    reason="CI runs the dry run once, in the GPU venv (.ci/gpu_venv_check), with the GPU machine's versions",
)
def test_the_dry_run_leaves_the_summary_and_the_log_in_their_schema(tmp_path):
    """``bash bench/gpu.sh --dry-run``: every step passes on the CPU, and the folder holds
    exactly ``gpu_summary.json`` and ``gpu.log``."""
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu.log", "gpu_summary.json"]
    summary = json.loads((out / "gpu_summary.json").read_text())
    assert summary["schema"] == gpu_check.SCHEMA_VERSION and summary["dry_run"] is True
    assert summary["total_budget_s"] == 480 and summary["passed"] is True
    assert summary["budget_scale"] == gpu_check.DRY_RUN_BUDGET_SCALE  # the CPU's time says nothing of a GPU's
    assert {"python", "torch", "triton", "transformers", "tinyvllm", "device", "nvidia_smi"} <= set(summary["environment"])
    steps = summary["steps"]
    assert [s["name"] for s in steps] == STEP_NAMES
    assert all(s["status"] == "passed" for s in steps), steps
    figures = {s["name"]: s.get("figures", {}) for s in steps}
    assert figures["gpu_tests"]["collected"] >= 60  # the 63 gpu-marked tests, collected (not run) on the CPU
    assert figures["throughput"]["output_tokens"] > 0 and figures["throughput"]["speedup_vs_transformers_same_subset"] > 0
    modes = figures["cudagraph_latency"]["modes"]
    assert set(modes) == {"NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}
    assert all(set(m["step_ms"]) == {"1", "2"} for m in modes.values())
    assert {name for name, m in modes.items() if "device_busy_share" in m} == {"NONE", "FULL_AND_PIECEWISE"}
    assert modes["NONE"]["device_busy_share"] == {"1": None, "2": None}  # nothing on a device to count
    assert modes["NONE"]["device_idle_gaps"] == {"1": None, "2": None}  # the gaps too (idle_gaps)
    assert set(modes["FULL_AND_PIECEWISE"]["host_phases_ms"]["1"]) >= {"schedule", "forward", "execute_model_rest"}
    probe = modes["FULL_AND_PIECEWISE"]["replay_probe"]["1"]  # the decode graph replayed alone (emulated here)
    assert probe["emulated"] is True and probe["host_us_idle"] > 0 and "replay_probe" not in modes["NONE"]
    parts = set(modes["FULL_AND_PIECEWISE"]["forward_parts_ms"]["1"])
    assert parts == {"step_inputs", "buffers_fill", "launch"}
    ab = figures["cudagraph_latency"]["fused_kv_write_ab"]  # the same mode with the KV write apart
    assert set(ab["speedup_of_the_kernel"]) == {"1", "2"} and ab["stats_ok"] is True
    greedy = figures["cudagraph_latency"]["greedy_ab"]  # the async run once more with the greedy draw as torch ops
    assert set(greedy["speedup_of_the_kernel"]) == {"1", "2"} and greedy["stats_ok"] is True
    assert greedy["device_busy_share_async_torch_ops"] == {"1": None, "2": None} and "pdl_ab" not in figures["cudagraph_latency"]
    async_ab = figures["cudagraph_latency"]["async_ab"]  # FULL_AND_PIECEWISE with async scheduling, same run
    assert set(async_ab["speedup_of_async"]) == {"1", "2"} and async_ab["stats_ok"] is True
    assert async_ab["device_idle_gaps_async"] == {"1": None, "2": None}
    top = async_ab["host_top_functions_async"]["2"]  # cProfile of the async steps: where the host's time goes
    assert len(top) == 25 and top[0]["tottime_us_per_step"] >= top[-1]["tottime_us_per_step"] > 0  # the most first
    assert all(f["calls_per_step"] > 0 and f["cumtime_us_per_step"] >= f["tottime_us_per_step"] for f in top)
    assert figures["throughput"]["async_speedup"] > 0 and figures["throughput"]["tinyvllm_async_tok_per_s"] > 0
    assert "mode_ab_speedup" not in figures["throughput"]  # the FULL-mode A/B answered (2026-11-30): run by hand now
    assert figures["cudagraph_latency"]["stats_check"] is True
    assert set(figures["cudagraph_latency"]["mixed_ab"]) == {"1"}  # B + the prompt fit the dry run's graphs at 1
    assert set(figures["prefix_caching"]["ratios"]) == {"hit_49"}  # the one case the budget keeps
    sweep = figures["attention_prefill"]  # the dry run's sweep: 3 or 4 configs at one tiny shape (sweep_stages)
    assert sweep["complete"] is True and list(sweep["rows"]) == ["tiny/16"]
    assert sweep["rows"]["tiny/16"]["configs_timed"] in (3, 4) and sweep["rows"]["tiny/16"]["best_x_sdpa"] > 0
    assert sweep["rows"]["tiny/16"]["plain_flash"] == "m16-n16-w4-s1"  # the baseline, beside the longest row
    assert sweep["rows"]["tiny/16"]["plain_flash_x_sdpa"] > 0 and sweep["rows"]["tiny/16"]["best_x_plain_flash"] > 0
    log = (out / "gpu.log").read_text()
    assert all(f"== {name} (budget" in log for name in STEP_NAMES)
    # The goals' table ends the output; a dry run measures none of them, and each figure a GPU
    # run will judge is where bench/gpu_goals.py looks (read as if this run had been on a GPU).
    assert "Issue 39's goals, cpu" in proc.stdout and proc.stdout.count("**not measured**") == 5
    as_if = {**summary, "dry_run": False, "environment": {**summary["environment"], "cuda_available": True}}
    found = {row.goal: row.status for row in gpu_goals.goal_rows(as_if)}
    judged = (gpu_goals.THROUGHPUT, gpu_goals.STEP, gpu_goals.MIXED)  # no batch 32 nor 4,096 tokens in a dry run
    assert all(found[goal] != gpu_goals.NOT_MEASURED for goal in judged), found


def test_the_full_workload_is_nano_vllms_draw_for_draw():
    """256 requests whose outputs add up to the 133,966 tokens nano-vllm's README reports, so
    the throughput step may be set beside its published figure."""
    from throughput import make_workload

    prompts, max_tokens = make_workload(256, 1024, 1024)
    assert sum(max_tokens) == gpu_check.NANO_VLLM_PUBLISHED["output_tokens"] == 133966
    assert len(prompts) == 256 and sum(map(len, prompts)) == 142827


@pytest.mark.slow
def test_tests_not_started_by_the_deadline_are_skipped_and_named(tmp_path):
    """The root conftest's deadline: past it, pytest skips what has not started ("out of time")
    and still writes its report, which ``pytest_figures`` counts and names."""
    selected = ["tests/test_cudagraph_wrapper.py::test_cudagraph_forward_context_nests_and_validates",
                "tests/test_cudagraph_wrapper.py::test_cudagraph_wrapper_binds_a_single_graph_mode"]  # fmt: skip

    def run(deadline: float) -> dict:
        junit = tmp_path / f"junit-{deadline:.0f}.xml"
        env = {**os.environ, gpu_check.TEST_DEADLINE_ENV: f"{deadline:.1f}"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected,
                               f"--junitxml={junit}"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:]
        return gpu_check.pytest_figures(junit, proc.stdout)

    late = run(time.time() - 1)
    assert (late["tests"], late["skipped"], late["passed"], late["skipped_for_time"]) == (2, 2, 0, 2)
    assert [name.rsplit("::", 1)[1] for name in late["not_run_for_time"]] == [s.rsplit("::", 1)[1] for s in selected]
    early = run(time.time() + 600)
    assert (early["passed"], early["skipped_for_time"], early["not_run_for_time"]) == (2, 0, [])


def test_the_gpu_tests_step_gets_a_deadline_and_is_incomplete_when_tests_ran_out_of_time(tmp_path):
    steps = (gpu_check.Step("gpu_tests", 60, "pytest"),)
    report = """<testsuites><testsuite tests="2" failures="0" errors="0" skipped="1">
<testcase classname="tests.test_a" name="test_ran"/>
<testcase classname="tests.test_a" name="test_late"><skipped message="out of time: ... (TINYVLLM_TEST_DEADLINE)"/></testcase>
</testsuite></testsuites>"""

    def command(step, python, work, dry_run, quick):
        (work / "junit.xml").write_text(report)
        return [python, "-c", f"import os; print('deadline', os.environ['{gpu_check.TEST_DEADLINE_ENV}'])"]

    began = time.time()
    summary = gpu_check.run_check(tmp_path, dry_run=True, quick=False, steps=steps, total_s=60, command=command)
    [step] = summary["steps"]
    assert (step["status"], step["reason"]) == ("incomplete", "time: 1 tests not run")
    assert step["figures"]["not_run_for_time"] == ["tests.test_a::test_late"] and summary["passed"] is False
    deadline = float((tmp_path / gpu_check.LOG).read_text().split("deadline ")[1].split()[0])
    margin = gpu_check.TEST_DEADLINE_MARGIN_S  # (the deadline is written to a tenth of a second)
    assert began + 60 - margin - 1 <= deadline <= time.time() + 60 - margin + 0.1


def test_the_shared_model_folder_appears_only_when_complete(tmp_path):
    """A step killed while building the model (its time budget) leaves no folder with a config
    and half its weights: the next step builds again instead of failing on the broken one."""
    import harness

    requested = tmp_path / "model"

    def killed(folder: Path) -> Path:
        folder.mkdir()
        (folder / "config.json").write_text("{}")  # save_pretrained writes the config first
        raise KeyboardInterrupt("the time budget ran out while the weights were being written")

    def complete(folder: Path) -> Path:
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_text("weights")
        return folder

    with pytest.raises(KeyboardInterrupt):
        harness.shared_model_folder(requested, tmp_path, killed)
    assert not requested.exists()
    assert harness.shared_model_folder(requested, tmp_path, complete) == requested
    assert sorted(p.name for p in requested.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no .partial left behind
    assert harness.shared_model_folder(requested, tmp_path, killed) == requested  # built once, reused


@pytest.mark.slow
def test_under_a_deadline_the_kernel_tests_run_first():
    """The files named after Triton and the kernels' own (``KERNEL_TEST_FILES`` in the root
    conftest: dependent launch's here) move ahead of the rest, each keeping its order."""
    files = ["tests/test_cudagraph_wrapper.py", "tests/test_triton_attention.py", "tests/test_dependent_launch.py"]

    def file_order(env_extra: dict) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k != gpu_check.TEST_DEADLINE_ENV} | env_extra
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *files],
                              cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:]
        return list(dict.fromkeys(line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line))

    assert file_order({}) == files  # the order given, without a deadline
    deadline = {gpu_check.TEST_DEADLINE_ENV: f"{time.time() + 600:.1f}"}
    assert file_order(deadline) == ["tests/test_triton_attention.py", "tests/test_dependent_launch.py", "tests/test_cudagraph_wrapper.py"]


def test_a_junit_name_becomes_the_node_id_pytest_takes(tmp_path):
    for path in ("tests/test_x.py", "property_tests/test_y.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert gpu_check.node_id("tests.test_x::test_a[FULL-qwen3]", tmp_path) == "tests/test_x.py::test_a[FULL-qwen3]"
    assert gpu_check.node_id("property_tests.test_y.TestZ::runTest", tmp_path) == "property_tests/test_y.py::TestZ::runTest"
    with pytest.raises(ValueError, match="'tests.test_gone::test_a': no file of the repository is its module"):
        gpu_check.node_id("tests.test_gone::test_a", tmp_path)


def test_the_second_call_runs_only_the_gpu_tests_an_earlier_run_left_for_time(tmp_path, capsys):
    """``--tests-left-in``: the environment, then ``pytest -m gpu`` on exactly the tests the
    earlier summary names (collected only, in a dry run), with the rest of the budget."""
    left = ["tests.test_dependent_launch::test_gpu_each_kernel_gives_the_same_bits_launched_dependent",
            "tests.test_cudagraph_gpu::test_gpu_cudagraph_float32_tokens_and_logits_equal_eager[FULL-qwen3]"]  # fmt: skip
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"steps": [{"name": "gpu_tests", "figures": {"not_run_for_time": left}}]}))
    assert gpu_check.tests_left_in(earlier) == [
        "tests/test_dependent_launch.py::test_gpu_each_kernel_gives_the_same_bits_launched_dependent",
        "tests/test_cudagraph_gpu.py::test_gpu_cudagraph_float32_tokens_and_logits_equal_eager[FULL-qwen3]"]  # fmt: skip
    out = tmp_path / "out"
    argv = ["--dry-run", "--tests-left-in", str(earlier), "--out", str(out), "--wheels", str(tmp_path / "none"), "--budget", "200"]
    assert gpu_check.main(argv) == 0
    summary = json.loads((out / gpu_check.SUMMARY).read_text())
    assert [s["name"] for s in summary["steps"]] == ["environment", "gpu_tests"] and summary["total_budget_s"] == 200
    tests = summary["steps"][1]
    assert tests["budget_s"] == 200 - 10 and tests["figures"]["collected"] == 2  # what the session has left, less the environment's
    with pytest.raises(SystemExit):  # too little for the environment and one step: refused before anything runs
        gpu_check.main(["--dry-run", "--budget", "15", "--out", str(tmp_path / "o3")])
    assert not (tmp_path / "o3").exists()
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps({"steps": [{"name": "gpu_tests", "figures": {"not_run_for_time": []}}]}))
    assert gpu_check.main(["--dry-run", "--tests-left-in", str(nothing), "--out", str(tmp_path / "o2")]) == 0
    assert "names no gpu test left for time; nothing to run" in capsys.readouterr().out
