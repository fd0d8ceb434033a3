"""Session-wide test set-up, loaded before tests/ and property_tests/.

- Hypothesis profiles: ``ci`` (bounded, derandomized; chosen automatically when the
  ``CI`` environment variable is set) and ``dev`` (more examples, random). Override with
  ``HYPOTHESIS_PROFILE=dev|ci``.
- With no CUDA device, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1``
  is set here, before any test module imports a kernel.
- Ctrl-C works in the tests: a run started as a background job of a non-interactive shell
  (``pytest ... &`` in a script) inherits SIGINT ignored, and so would every process it
  starts; the tests of Ctrl-C (``tests/test_multiproc_executor.py``) need the default, so
  an ignored SIGINT is given back Python's default handler here.
- A time budget: when ``TINYVLLM_TEST_DEADLINE`` (seconds since the epoch) is set and has
  passed, every test not yet started is skipped with a reason that starts "out of time".
  ``bench/gpu_check.py`` sets it for its ``pytest -m gpu`` step, so a run that would outlast
  its budget ends normally, writes its report, and names the tests it did not run, instead
  of being killed with nothing said. Under a deadline the kernel tests run first (the files
  named after Triton, and ``KERNEL_TEST_FILES``: the norms, rotary, SiLU-and-multiply, the KV
  write, dependent launch): every engine test stands on the kernels, so if the budget runs
  out it cuts the others.
"""

import os
import signal
import time

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    stateful_step_count=30,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # inherited: see the module docstring
    signal.signal(signal.SIGINT, signal.default_int_handler)


DEADLINE_ENV = "TINYVLLM_TEST_DEADLINE"
OUT_OF_TIME = "out of time: the time budget of this run had passed before the test started"


def pytest_runtest_setup(item):
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline is not None and time.time() > float(deadline):
        pytest.skip(f"{OUT_OF_TIME} ({DEADLINE_ENV})")


# The kernels' own test files besides those named after Triton: under a deadline they run first.
KERNEL_TEST_FILES = ("test_rms_norm.py", "test_rotary.py", "test_qk_norm_rotary.py", "test_activation.py",
                     "test_kv_cache_write.py", "test_dependent_launch.py")  # fmt: skip


def is_kernel_test(nodeid: str) -> bool:
    path = nodeid.split("::")[0]
    return "triton" in path or path.rsplit("/", 1)[-1] in KERNEL_TEST_FILES


def pytest_collection_modifyitems(config, items):
    if os.environ.get(DEADLINE_ENV) is not None:  # stable: files keep their order otherwise
        items.sort(key=lambda item: 0 if is_kernel_test(item.nodeid) else 1)
