"""The map of the package on ``docs/architecture.md`` lists every module: a reader who opens a
file the map does not name has no walkthrough to go to, and a map that silently falls behind
the code teaches the wrong shape.

A module is on the map when the first column of the page's module table names it in
backticks (``core/scheduler.py``) or names a folder that holds it (``trace/``: the row
stands for the whole package)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tinyvllm"


def mapped_names(page: str) -> set[str]:
    """Every backticked name in the first column of the page's module table."""
    section = page.split("## The package", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| module") and not line.startswith("|---"):
            first = line.split("|")[1]
            names |= set(re.findall(r"`([^`]+)`", first))
    return names


def missing_modules(page: str) -> list[str]:
    names = mapped_names(page)
    folders = {name for name in names if name.endswith("/")}
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in names or path.name in names and "/" not in rel:
            continue
        if any(rel.startswith(folder) for folder in folders):
            continue
        if path.name == "__init__.py" and rel != "__init__.py":
            continue  # a package's __init__ goes with its folder's modules
        missing.append(rel)
    return missing


def test_every_module_is_on_the_architecture_map():
    missing = missing_modules((ROOT / "docs" / "architecture.md").read_text())
    assert not missing, f"docs/architecture.md's module table does not name {missing}"


def test_the_check_finds_a_module_left_off_the_map():
    page = (ROOT / "docs" / "architecture.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `core/block_pool.py`"))
    assert missing_modules(page.replace(row + "\n", "")) == ["core/block_pool.py"]
