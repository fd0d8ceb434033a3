"""Import layering: the model, attention and sampling packages never import the worker.

The worker (persistent batch, model runner) sits above them and hands them frozen
records (``SamplingMetadata``, attention metadata); an import the other way would tie a
lower layer to the worker's internals. Each file is parsed with ``ast``, so imports
nested under ``if TYPE_CHECKING:`` or inside functions count too, and relative imports
are resolved against the file's package.
"""

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "src" / "tinyvllm"
FORBIDDEN = "tinyvllm.worker"


def forbidden_imports(source: str, package: str, filename: str = "<string>") -> list[str]:
    """Every import in ``source`` (a module of ``package``) that reaches ``FORBIDDEN``, as ``line N: code``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: drop (level - 1) trailing parts of the package
                parts = package.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from tinyvllm import worker`` names the package in the alias, not the module.
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(t == FORBIDDEN or t.startswith(FORBIDDEN + ".") for t in targets):
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def worker_imports_under(*subpackages: str) -> list[str]:
    """``path: line N: code`` for every forbidden import under the given subpackages."""
    problems = []
    for sub in subpackages:
        files = sorted((PACKAGE_ROOT / sub).rglob("*.py"))
        assert files, f"no Python files under {PACKAGE_ROOT / sub}"
        for path in files:
            rel = path.relative_to(PACKAGE_ROOT.parent)
            package = ".".join(rel.parent.parts)  # tinyvllm/sample/x.py -> tinyvllm.sample
            for hit in forbidden_imports(path.read_text(encoding="utf-8"), package, str(path)):
                problems.append(f"src/{rel.as_posix()}: {hit}")
    return problems


def test_detector_sees_every_form_of_import():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from tinyvllm.sample.metadata import SamplingMetadata\n"
        "if TYPE_CHECKING:\n"
        "    from tinyvllm.worker.input_batch import InputBatch\n"
        "import tinyvllm.worker.model_runner as mr\n"
        "from tinyvllm import worker\n"
        "from ..worker import input_batch\n"
        "def f():\n"
        "    from tinyvllm.workers_elsewhere import x\n"  # a different name: allowed
        "    from .. import worker as w\n"
    )
    assert forbidden_imports(source, "tinyvllm.sample") == [
        "line 5: from tinyvllm.worker.input_batch import InputBatch",
        "line 6: import tinyvllm.worker.model_runner as mr",
        "line 7: from tinyvllm import worker",
        "line 8: from ..worker import input_batch",
        "line 11: from .. import worker as w",
    ]


def test_sample_does_not_import_worker():
    problems = worker_imports_under("sample")
    assert not problems, "sample/ imports the worker:\n" + "\n".join(problems)


def test_models_attention_and_sample_do_not_import_worker():
    problems = worker_imports_under("models", "attention", "sample")
    assert not problems, "lower layers import the worker:\n" + "\n".join(problems)
