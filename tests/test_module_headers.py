"""Every module under src/tinyvllm opens with a header that explains, in at most 60 lines,
and holds one concept, in at most 520 lines.

A module header says the concept, the vLLM file it mirrors, its invariants and the numbered
``NOTE n`` why-notes; measurements and history belong on the docs page or the bench README
that owns them. A header is counted as the source lines its docstring spans, from the line
with the opening quotes to the line with the closing ones. An empty ``__init__.py`` (no code
at all) is the one module allowed no docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tinyvllm"
MAX_HEADER_LINES = 60


def header_lines(source: str) -> int | None:
    """The number of source lines the module docstring spans, or None when there is none."""
    body = ast.parse(source).body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return None


def header_problems(src: Path = SRC) -> list[str]:
    problems = []
    for path in sorted(src.rglob("*.py")):
        source = path.read_text()
        rel = path.relative_to(src.parents[1]).as_posix()
        lines = header_lines(source)
        if lines is None:
            if not (path.name == "__init__.py" and not source.strip()):
                problems.append(f"{rel}: no module docstring")
        elif lines > MAX_HEADER_LINES:
            problems.append(f"{rel}: {lines} lines")
    return problems


def test_header_lines_counts_the_span_of_the_docstring():
    assert header_lines('"""One line."""\nx = 1\n') == 1
    assert header_lines('"""Title.\n\nBody.\n"""\n') == 4
    assert header_lines("x = 1\n") is None
    assert header_lines("") is None


def test_header_problems_names_long_headers_and_missing_ones(tmp_path):
    pkg = tmp_path / "src" / "tinyvllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "short.py").write_text('"""Short."""\n')
    (pkg / "bare.py").write_text("x = 1\n")
    (pkg / "long.py").write_text('"""' + "line\n" * 61 + '"""\n')
    assert header_problems(pkg) == [
        "src/tinyvllm/bare.py: no module docstring",
        "src/tinyvllm/long.py: 62 lines",
    ]


def test_every_module_header_is_at_most_60_lines():
    problems = header_problems()
    assert not problems, f"module headers over {MAX_HEADER_LINES} lines or missing:\n" + "\n".join(problems)


# One concept per module: a module past this many lines holds two (issue 37 split llm.py,
# llm_engine.py, model_runner.py and loader.py at it); the facade ``LLM`` is held tighter.
MAX_MODULE_LINES = 520
MAX_LLM_LINES = 380


def long_modules(src: Path = SRC, limit: int = MAX_MODULE_LINES) -> list[str]:
    """``path: N lines`` for every module of ``src`` over ``limit`` lines."""
    found = []
    for path in sorted(src.rglob("*.py")):
        count = len(path.read_text().splitlines())
        if count > limit:
            found.append(f"{path.relative_to(src.parents[1]).as_posix()}: {count} lines")
    return found


def test_long_modules_names_each_module_over_the_limit(tmp_path):
    pkg = tmp_path / "src" / "tinyvllm"
    pkg.mkdir(parents=True)
    (pkg / "short.py").write_text("x = 1\n" * 3)
    (pkg / "long.py").write_text("x = 1\n" * 4)
    assert long_modules(pkg, limit=3) == ["src/tinyvllm/long.py: 4 lines"]


def test_no_module_is_over_520_lines_and_llm_py_over_380():
    assert not long_modules(), f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long_modules())
    llm = len((SRC / "engine" / "llm.py").read_text().splitlines())
    assert llm <= MAX_LLM_LINES, f"engine/llm.py has {llm} lines, more than {MAX_LLM_LINES}"
