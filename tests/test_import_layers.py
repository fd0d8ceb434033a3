"""Import layering: no arrow runs back up the map of ``docs/architecture.md``.

The worker (persistent batch, model runner) sits above the model, attention and sampling
packages and hands them frozen records (``SamplingMetadata``, attention metadata); an
import the other way would tie a lower layer to the worker's internals. The attention
kernels know nothing of the KV-cache core; the worker reads only the scheduler's output
from it; ``validation.py`` is the bottom layer, which ``SamplingParams`` builds on. The step
recorder ``tinyvllm/trace/`` only reads the engine's state: nothing below the engine
(``core/``, ``worker/``, ``sample/``, ``attention/``, ``models/``) imports it, so recording
stays off the engine's path (its one hook is ``LLMEngine.add_observer``). ``platform.py`` (where
kernels can run, and the choice between a kernel and the torch ops) is a bottom layer too:
``attention/``, ``models/`` and ``engine/`` all ask it, so it imports nothing of tinyvllm and
no torch, and every layer may import it. Each file is parsed with ``ast``, so imports
nested under ``if TYPE_CHECKING:`` or inside functions count too, and relative imports
are resolved against the file's package.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "src" / "tinyvllm"
FORBIDDEN = "tinyvllm.worker"


def forbidden_imports(
    source: str, package: str, filename: str = "<string>", forbidden: str = FORBIDDEN, allowed: tuple[str, ...] = ()
) -> list[str]:
    """Every import in ``source`` (a module of ``package``) that reaches ``forbidden`` and no
    module of ``allowed``, as ``line N: code``."""
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
        reached = [t for t in targets if t == forbidden or t.startswith(forbidden + ".")]
        if any(not any(t == a or t.startswith(a + ".") for a in allowed) for t in reached):
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]


def worker_imports_under(*subpackages: str, forbidden: str = FORBIDDEN, allowed: tuple[str, ...] = ()) -> list[str]:
    """``path: line N: code`` for every forbidden import under the given subpackages (or modules)."""
    problems = []
    for sub in subpackages:
        target = PACKAGE_ROOT / sub
        files = [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))
        assert files, f"no Python files under {PACKAGE_ROOT / sub}"
        for path in files:
            rel = path.relative_to(PACKAGE_ROOT.parent)
            package = ".".join(rel.parent.parts)  # tinyvllm/sample/x.py -> tinyvllm.sample
            for hit in forbidden_imports(path.read_text(encoding="utf-8"), package, str(path), forbidden, allowed):
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


def test_attention_does_not_import_the_kv_cache_core():
    problems = worker_imports_under("attention", forbidden="tinyvllm.core")
    assert not problems, "attention/ imports core/ (cdiv lives in tinyvllm/arith.py):\n" + "\n".join(problems)


def test_the_worker_reads_only_the_schedulers_output_from_the_core():
    problems = worker_imports_under("worker", forbidden="tinyvllm.core", allowed=("tinyvllm.core.sched_output",))
    assert not problems, "worker/ imports more of core/ than its output:\n" + "\n".join(problems)


def test_validation_is_the_bottom_layer():
    problems = worker_imports_under("validation.py", forbidden="tinyvllm")
    assert not problems, "validation.py imports tinyvllm:\n" + "\n".join(problems)


def test_the_detector_honours_allowed_modules():
    source = "from tinyvllm.core.sched_output import SchedulerOutput\nfrom tinyvllm.core import kv_cache_manager\n"
    assert forbidden_imports(source, "tinyvllm.worker", forbidden="tinyvllm.core", allowed=("tinyvllm.core.sched_output",)) == [
        "line 2: from tinyvllm.core import kv_cache_manager"
    ]


def test_nothing_below_the_engine_imports_the_trace_package():
    source = "from tinyvllm.trace.recorder import record\nimport tinyvllm.tracer\nfrom .. import trace\n"
    assert forbidden_imports(source, "tinyvllm.core", forbidden="tinyvllm.trace") == [
        "line 1: from tinyvllm.trace.recorder import record",
        "line 3: from .. import trace",
    ]
    problems = worker_imports_under("core", "worker", "sample", "attention", "models", forbidden="tinyvllm.trace")
    assert not problems, "layers below the engine import tinyvllm.trace:\n" + "\n".join(problems)


def test_config_does_not_import_the_worker():
    problems = worker_imports_under("config.py")
    assert not problems, "config.py imports the worker (CUDAGraphMode lives in config.py):\n" + "\n".join(problems)


def test_the_shipped_model_package_sits_on_the_models():
    """``stdlib_tiny/`` owns the shipped model: its folder path (``__init__.py``, which the
    engine and the CLI read for their default model), its training and its loss plot. It sits
    above ``models/`` (training builds on the tiny tokenizer helpers there) and below
    everything else: it imports nothing of ours but ``models/``, and ``models/`` does not
    import it."""
    problems = worker_imports_under("stdlib_tiny", forbidden="tinyvllm", allowed=("tinyvllm.models", "tinyvllm.stdlib_tiny"))
    assert not problems, "stdlib_tiny/ imports more of tinyvllm than models/:\n" + "\n".join(problems)
    problems = worker_imports_under("models", forbidden="tinyvllm.stdlib_tiny")
    assert not problems, "models/ imports stdlib_tiny/ (the layer above it):\n" + "\n".join(problems)


def test_only_the_train_tiny_command_imports_the_training_code():
    """The runtime reads the shipped model's folder path and nothing else of ``stdlib_tiny/``:
    the training code (torch on the trainer's side, argparse, the SVG plot) is reached only
    by ``tinyvllm train-tiny`` in ``cli.py``."""
    runtime = [
        p.relative_to(PACKAGE_ROOT).as_posix()
        for p in sorted(PACKAGE_ROOT.rglob("*.py"))
        if p.relative_to(PACKAGE_ROOT).parts[0] not in ("stdlib_tiny", "cli.py")
    ]
    for module in ("tinyvllm.stdlib_tiny.train", "tinyvllm.stdlib_tiny.plot"):
        problems = worker_imports_under(*runtime, forbidden=module)
        assert not problems, f"the runtime imports {module}:\n" + "\n".join(problems)
    cli = [hit.split(": ", 2)[2] for hit in worker_imports_under("cli.py", forbidden="tinyvllm.stdlib_tiny.train")]
    assert cli == [
        "from tinyvllm.stdlib_tiny.train import DESCRIPTION, add_arguments",
        "from tinyvllm.stdlib_tiny.train import run",
    ], cli


# Where kernels can run, and the choice between a kernel and the torch ops, are asked by
# attention/, models/ and engine/ alike: their one home is the bottom-layer ``platform.py``.
PLATFORM_NAMES = ("triton_can_run_on", "impl_from_env", "uses_kernel", "IMPLS")


def test_platform_is_a_bottom_layer_without_torch():
    problems = worker_imports_under("platform.py", forbidden="tinyvllm")
    assert not problems, "platform.py imports tinyvllm (it is the bottom layer):\n" + "\n".join(problems)
    code = (
        "import sys, tinyvllm.platform\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'triton')))\n"
    )
    src = str(PACKAGE_ROOT.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing tinyvllm.platform loaded {out.stdout.strip()}"


def test_every_importer_of_the_platform_names_imports_them_from_platform():
    misplaced = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module != "tinyvllm.platform":
                if any(alias.name in PLATFORM_NAMES for alias in node.names):
                    rel = path.relative_to(PACKAGE_ROOT.parent).as_posix()
                    misplaced.append(f"src/{rel}: line {node.lineno}: {ast.unparse(node)}")
    assert misplaced == [], "platform names imported from elsewhere:\n" + "\n".join(misplaced)


def import_graph(src: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Module -> the tinyvllm modules it imports, anywhere in its file (a function's body and
    ``if TYPE_CHECKING:`` count); ``from pkg import name`` reaches ``pkg.name`` when that is a
    module, else ``pkg``."""
    modules: dict[str, Path] = {}
    for path in src.rglob("*.py"):
        rel = path.relative_to(src.parent).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        reached: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                candidates = [[alias.name] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                candidates = [[f"{base}.{alias.name}", base] for alias in node.names]
            else:
                continue
            for options in candidates:
                hit = next((m for m in options if m in modules), None)
                if hit is not None and hit != name:
                    reached.add(hit)
        graph[name] = reached
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                circles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_import_circles_finds_a_circle_through_a_function_body_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_tinyvllm_modules():
    """Issue 37: no two modules import each other, even lazily (a circle ties two concepts
    into one; ``sample/sampler.py`` and ``sample/rejection_sampler.py`` had one)."""
    graph = import_graph()
    assert "tinyvllm.sample.sampler" in graph and graph["tinyvllm.engine.llm"], "the graph reads the package"
    assert import_circles(graph) == []
