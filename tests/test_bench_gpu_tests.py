"""``bench/gpu_tests.py``: ``pytest -m gpu`` in two processes, the kernels' tests apart.

The split follows the root conftest's ``is_kernel_test``; the two runs' JUnit reports merge
into the one the ``gpu_tests`` step reads; the rest runs whatever the kernels' run did.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402
import gpu_tests  # noqa: E402

KERNEL = "tests/test_rms_norm.py::test_the_torch_ops_are_eight_kernels_and_the_kernel_one_launch"
ENGINE = "tests/test_cudagraph_wrapper.py::test_cudagraph_forward_context_nests_and_validates"


def test_node_ids_go_to_their_run_and_a_run_with_none_is_left_out():
    options = ["-m", "gpu", "-v"]
    attention = "tests/test_triton_attention.py::test_gpu_long_prefill[dtype0]"
    assert gpu_tests.plan_runs([*options, KERNEL, ENGINE, attention]) == [
        ("kernels", [*options, KERNEL, attention]), ("rest", [*options, ENGINE])]  # fmt: skip
    assert gpu_tests.plan_runs([*options, ENGINE]) == [("rest", [*options, ENGINE])]
    other = "property_tests/test_sampling_properties.py::test_seeded_sampling_is_reproducible"  # not under tests/
    assert gpu_tests.plan_runs([*options, KERNEL, other]) == [("kernels", [*options, KERNEL]), ("rest", [*options, other])]


def test_without_node_ids_the_kernels_files_run_first_and_the_rest_ignores_them():
    (kernels, kernel_args), (rest, rest_args) = gpu_tests.plan_runs(["-m", "gpu"])
    files = kernel_args[2:]
    assert (kernels, rest) == ("kernels", "rest") and kernel_args[:2] == rest_args[:2] == ["-m", "gpu"]
    assert {"tests/test_triton_attention.py", "tests/test_rms_norm.py", "tests/test_dependent_launch.py"} <= set(files)
    assert all(gpu_tests.is_kernel_test(f) for f in files) and "tests/test_scheduler.py" not in files
    assert rest_args[2:] == [f"--ignore={f}" for f in files]
    every = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert set(files) == {f for f in every if gpu_tests.is_kernel_test(f)}  # no kernel file left to the rest


@pytest.mark.slow
def test_both_runs_land_in_one_report_and_the_rest_runs_after_a_failed_kernels_run(tmp_path):
    junit = tmp_path / "junit.xml"
    options = ["-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    assert gpu_tests.run([*options, KERNEL, ENGINE]) == 0
    figures = gpu_check.pytest_figures(junit, "")
    assert (figures["tests"], figures["passed"], figures["failing"]) == (2, 2, [])
    missing = KERNEL.replace("eight_kernels", "no_such")  # the kernels' run fails (no such test)
    assert gpu_tests.run([*options, missing, ENGINE]) not in (0, gpu_tests.NO_TESTS_COLLECTED)
    figures = gpu_check.pytest_figures(junit, "")
    assert (figures["tests"], figures["passed"]) == (1, 1)  # the engine's test still ran, and is reported
