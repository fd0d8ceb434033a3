"""The GPU path does not need the serving or browser packages (issue 24).

The GPU machine has torch, triton, transformers (and what it brings: ``httpx`` comes with
``huggingface_hub``), tokenizers, safetensors, numpy, pytest and hypothesis, and none of
fastapi, uvicorn, prometheus_client, openai or playwright. Each test here runs a subprocess
in which those five cannot be imported (``tests/without_packages.py``), so it checks the
claim in any venv, CI's main one included, which has them all:

- every module of ``tinyvllm`` outside ``tinyvllm.entrypoints`` (the serve extra's) imports;
- ``tinyvllm generate`` works, and ``tinyvllm serve`` says in one line that it needs the
  serve extra;
- ``pytest -m gpu --collect-only`` exits 0 and lists the gpu tests, and each test module
  that needs the serve extra is skipped at collection, with a reason; so is the golden test
  of the tutorial that serves;
- with ``TINYVLLM_REQUIRE_SERVE=1`` (``.ci/run`` sets it for its main run) those modules are
  collection errors instead, so a broken main venv cannot turn its serving tests into skips.

``.ci/gpu_venv_check`` checks the same in a real second venv, built without them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "tests" / "without_packages.py"
HIDDEN = ("fastapi", "uvicorn", "prometheus_client", "openai", "playwright")
SERVE_MODULES = (
    "tests/test_openai_server.py",
    "tests/test_cli_serve.py",
    "tests/test_tutorial_08_serve_client.py",
    "tests/test_bench_serving.py",
)


def run_without_serve_packages(*args: str, require_serve: bool = False) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repo with ``HIDDEN`` unimportable; ``TINYVLLM_REQUIRE_SERVE`` only if asked."""
    env = {k: v for k, v in os.environ.items() if k != "TINYVLLM_REQUIRE_SERVE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    env["TOKENIZERS_PARALLELISM"] = "false"
    if require_serve:
        env["TINYVLLM_REQUIRE_SERVE"] = "1"
    cmd = [sys.executable, str(RUNNER), ",".join(HIDDEN), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _report(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout[-6000:]}\n--- stderr\n{out.stderr[-3000:]}"


IMPORT_EVERYTHING = """
import importlib, importlib.util, pkgutil, sys
import tinyvllm
from tinyvllm import LLM, SamplingParams
hidden = sys.argv[1].split(",")
for name in hidden:  # the runner really hides them
    assert importlib.util.find_spec(name) is None, name
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(f"{name} was imported")
names = sorted(m.name for m in pkgutil.walk_packages(tinyvllm.__path__, "tinyvllm."))
skipped = [n for n in names if n.startswith("tinyvllm.entrypoints.") or n == "tinyvllm.__main__"]
for name in names:
    if name not in skipped:
        importlib.import_module(name)
print("imported", len(names) - len(skipped), "modules; not imported:", ", ".join(skipped))
"""


def test_every_module_outside_entrypoints_imports_without_the_serving_packages():
    out = run_without_serve_packages("-c", IMPORT_EVERYTHING, ",".join(HIDDEN))
    assert out.returncode == 0, _report(out)
    imported = int(re.search(r"imported (\d+) modules", out.stdout).group(1))
    assert imported > 20, out.stdout  # the model runner, the attention backends, the engine, the CLI, ...
    assert "tinyvllm.worker.model_runner" not in out.stdout.split("not imported:")[1]


@pytest.mark.slow
def test_cli_generate_works_and_serve_names_the_extra_without_the_serving_packages():
    out = run_without_serve_packages(
        "-m", "tinyvllm", "generate", "--prompt", "def add(a, b):", "--device", "cpu", "--max-tokens", "4"
    )  # fmt: skip
    assert out.returncode == 0, _report(out)
    assert "generated 4 tokens" in out.stdout, _report(out)
    out = run_without_serve_packages("-m", "tinyvllm", "serve", "--device", "cpu")
    assert out.returncode == 2, _report(out)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinyvllm: error: "), _report(out)
    assert "pip install 'tinyvllm[serve]'" in lines[0] and "No module named" in lines[0], lines[0]


@pytest.mark.slow
def test_pytest_collects_the_gpu_tests_and_skips_serving_modules_without_the_serving_packages():
    out = run_without_serve_packages("-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider")
    assert out.returncode == 0, _report(out)
    lines = out.stdout.splitlines()
    assert any(line.startswith("tests/test_generate_gpu.py::") for line in lines), _report(out)
    assert "error" not in lines[-1] and not [line for line in lines if line.startswith("ERROR")], _report(out)
    for module in SERVE_MODULES:
        pattern = rf"SKIPPED \[1\] {re.escape(module)}:\d+: needs \w+ \(the serve extra:"
        assert re.search(pattern, out.stdout), f"{module} is not skipped at collection:\n{_report(out)}"


def test_the_serving_tutorials_golden_test_skips_without_the_serving_packages():
    test = "tests/test_tutorial_pages.py::test_tutorial_output_matches_golden_file[08_serve_client]"
    out = run_without_serve_packages("-m", "pytest", "-q", "-p", "no:cacheprovider", test)
    assert out.returncode == 0, _report(out)
    assert re.search(r"SKIPPED \[1\] tests/test_tutorial_pages.py:\d+: needs \w+ \(the serve extra:", out.stdout), (
        _report(out)
    )
    assert re.search(r"^1 skipped in ", out.stdout.splitlines()[-1]), _report(out)


def test_require_serve_turns_each_missing_serving_package_into_a_collection_error():
    out = run_without_serve_packages("-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *SERVE_MODULES,
                                     require_serve=True)  # fmt: skip
    assert out.returncode == 2, _report(out)  # pytest's "interrupted: errors during collection"
    for module in SERVE_MODULES:
        assert f"ERROR {module}" in out.stdout, _report(out)
    assert "TINYVLLM_REQUIRE_SERVE=1 but" in out.stdout, _report(out)
    assert "skipped" not in out.stdout.splitlines()[-1], _report(out)


def test_the_serving_tutorial_is_told_from_the_others_by_its_imports():
    sys.path.insert(0, str(REPO / "tests"))
    from serve_fixtures import imports_serve_packages

    assert imports_serve_packages(REPO / "tutorials" / "08_serve_client.py")
    assert not imports_serve_packages(REPO / "tutorials" / "06_generate.py")
    assert not imports_serve_packages(REPO / "tutorials" / "07_cuda_graphs.py")
