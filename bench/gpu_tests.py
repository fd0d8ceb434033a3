"""``pytest -m gpu`` in two processes: the kernels' tests, then the rest, one JUnit report.

Concept: ``bench/gpu_check.py``'s ``gpu_tests`` step runs this script instead of pytest. A
kernel that faults on the device (an illegal address) poisons its process's CUDA context:
every later CUDA call in that process fails, so one faulty kernel fails every test after it.
Run apart, the kernels' tests (``conftest.is_kernel_test``: the files named after Triton and
``KERNEL_TEST_FILES``) can fail only each other; the engine's tests run in a fresh process.
The two reports are merged into the one ``--junitxml`` the step reads.

Invariants: every test pytest would have run with the same arguments runs exactly once, in
one of the two processes; the exit status is 0 only when both runs pass (pytest's 5, "no tests
collected", counts as passing for a part that has none of the tests asked for); the merged
report holds both runs' test suites.

NOTE 1 (why two, not one a test): a process costs pytest's start-up and the imports (seconds),
and the Triton kernels compile once a process; the faults seen so far (the H200 run of
2026-11-30: a gather out of shared memory in the attention kernel) were in kernels, so two
processes cut the damage to the kernels' own tests at the cost of one start-up.

Run: ``python3 bench/gpu_tests.py [pytest options] --junitxml=PATH [node ids]`` from the
repository root: without node ids, every test of the ``testpaths``; with them, those.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_TESTS_COLLECTED = 5  # pytest's exit status when the selection is empty


@functools.lru_cache(maxsize=1)
def _root_conftest():
    """The root ``conftest.py``, loaded by its path: under pytest, ``conftest`` may name another."""
    spec = importlib.util.spec_from_file_location("tinyvllm_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_kernel_test(node_id: str) -> bool:
    """The root conftest's rule (kernel tests first under a deadline), read from it."""
    return _root_conftest().is_kernel_test(node_id)


def is_node_id(arg: str) -> bool:
    """A test file or node id (``tests/test_x.py::test_y``, ``property_tests/...``), not an
    option or an option's value (``-m``, ``gpu``, ``no:cacheprovider``)."""
    return not arg.startswith("-") and ".py" in arg


def plan_runs(args: list[str], test_dir: Path = ROOT / "tests") -> list[tuple[str, list[str]]]:
    """The runs, ``(name, pytest's arguments)``: node ids (``is_node_id``) go to the kernels' run
    or the rest's, and a run with none is left out; without
    node ids, the kernels' run takes the kernels' test files and the rest's run ignores them."""
    ids = [a for a in args if is_node_id(a)]
    options = [a for a in args if not is_node_id(a)]
    if ids:
        kernels = [i for i in ids if is_kernel_test(i)]
        rest = [i for i in ids if not is_kernel_test(i)]
        return [(name, options + chosen) for name, chosen in (("kernels", kernels), ("rest", rest)) if chosen]
    files = sorted(f"tests/{p.name}" for p in test_dir.glob("test_*.py") if is_kernel_test(f"tests/{p.name}"))
    return [("kernels", options + files), ("rest", options + [f"--ignore={f}" for f in files])]


def merge_reports(parts: list[Path], out: Path) -> None:
    """Every ``testsuite`` of the JUnit files in ``parts`` (those that exist) under one
    ``testsuites`` in ``out``."""
    merged = ET.Element("testsuites")
    for part in parts:
        if not part.is_file():
            continue
        root = ET.parse(part).getroot()
        merged.extend(root.iter("testsuite") if root.tag == "testsuites" else [root])
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)


def run(args: list[str], python: str = sys.executable) -> int:
    """Run the two parts in turn; merge their reports into ``--junitxml``'s path."""
    junit = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("--junitxml=")), None)
    rest_args = [a for a in args if not a.startswith("--junitxml=")]
    statuses, parts = [], []
    for name, selection in plan_runs(rest_args):
        part = junit.with_name(f"{junit.stem}.{name}.xml") if junit else None
        cmd = [python, "-m", "pytest", *selection] + ([f"--junitxml={part}"] if part else [])
        print(f"== gpu tests, {name}: {' '.join(cmd[3:])[:300]}", flush=True)
        statuses.append(subprocess.call(cmd, cwd=ROOT))
        parts += [part] if part else []
    if junit:
        merge_reports(parts, junit)
    failed = [s for s in statuses if s not in (0, NO_TESTS_COLLECTED)]
    return failed[0] if failed else (0 if statuses else NO_TESTS_COLLECTED)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
