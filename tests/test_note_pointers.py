"""Every ``NOTE n`` pointer resolves: a module header's numbered NOTEs are where the code
explains itself, and a pointer to one that does not exist sends a reader nowhere.

Two forms are checked, in ``src/`` and ``docs/``:
- a pointer naming a module, ``file.py NOTE n`` (a path, a bare file name or a module's
  stem, with or without backticks; ``NOTES 1 and 2`` too): that module defines NOTE n;
- a bare ``NOTE n`` in a source file: that same file defines it.
A NOTE is defined by a line that starts with ``NOTE n (title):`` or ``NOTE n:``.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tinyvllm"

DEFINITION = re.compile(r"^\s*(?:# )?NOTE (\d+)(?: \(|:)", re.M)
# An optional module token before the pointer, then NOTE(S) and its numbers.
POINTER = re.compile(
    r"(?:``?(?P<quoted>[\w/.]+)``?\s|(?P<file>[\w/]+\.py)\s|(?P<word>\b[a-z_]+)\s)?"
    r"NOTES? (?P<first>\d+)(?P<more>(?:(?:,| and| or) \d+)*)"
)


def _modules() -> dict[Path, str]:
    return {path: path.read_text() for path in sorted(SRC.rglob("*.py"))}


def _names(modules: dict[Path, str]) -> dict[str, set[Path]]:
    """Every way a pointer may name a module: path from the package, file name, stem."""
    names: dict[str, set[Path]] = {}
    for path in modules:
        rel = path.relative_to(SRC).as_posix()
        for name in {rel, rel[:-3], path.name, path.stem, f"tinyvllm/{rel}", f"src/tinyvllm/{rel}"}:
            names.setdefault(name, set()).add(path)
    return names


def dangling_pointers() -> list[str]:
    modules = _modules()
    names = _names(modules)
    defined = {path: {int(n) for n in DEFINITION.findall(text)} for path, text in modules.items()}
    texts = [(path, text, True) for path, text in modules.items()]
    texts += [(path, path.read_text(), False) for path in sorted((ROOT / "docs").rglob("*.md"))]
    problems = []
    for path, text, bare_allowed in texts:
        for match in POINTER.finditer(text):
            line_start = text.rfind("\n", 0, match.start()) + 1
            if DEFINITION.match(text, line_start) and match.start() <= text.find("NOTE", line_start):
                continue  # the definition itself
            named = match["quoted"] or match["file"] or match["word"]
            targets = names.get(named) if named else None
            if targets is None and (match["quoted"] or match["file"]) and named.endswith(".py"):
                problems.append(f"{path.relative_to(ROOT)}: {match[0]!r} names no module of src/tinyvllm")
                continue
            if targets is None:
                if not bare_allowed:
                    continue  # a page's bare NOTE n: which module it means is the prose's to say
                targets = {path}
            if len(targets) > 1:
                continue  # a stem shared by two modules: the prose around it says which
            (target,) = targets
            numbers = [int(match["first"]), *map(int, re.findall(r"\d+", match["more"]))]
            for n in numbers:
                if n not in defined[target]:
                    line = text.count("\n", 0, match.start()) + 1
                    problems.append(
                        f"{path.relative_to(ROOT)}:{line}: {match[0].strip()!r}: {target.relative_to(ROOT)} "
                        f"defines NOTEs {sorted(defined[target])}, not {n}"
                    )
    return problems


def test_every_note_pointer_resolves():
    problems = dangling_pointers()
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_dangling_pointer(tmp_path, monkeypatch):
    """The check has teeth: a pointer to a NOTE that no header defines is reported, in both forms."""
    pkg = tmp_path / "src" / "tinyvllm"
    pkg.mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (pkg / "a.py").write_text('"""A.\n\nNOTE 1 (one): x.\nNOTE 2: y.\n"""\n# see NOTE 2, NOTE 3\n')
    (pkg / "b.py").write_text('"""B: as ``a.py`` NOTES 1 and 4 say (NOTE 1)."""\n')
    (tmp_path / "docs" / "p.md").write_text("See `a.py` NOTE 2 and a.py NOTE 9; bare NOTE 7 is prose.\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "SRC", pkg)
    found = dangling_pointers()
    assert len(found) == 4, found
    assert any("a.py:6" in p and "not 3" in p for p in found)
    assert any("b.py" in p and "not 4" in p for p in found)  # cross-file
    assert any("b.py" in p and "'(NOTE 1)'" not in p and "not 1" in p for p in found)  # bare: b.py has no NOTE 1
    assert any("p.md" in p and "not 9" in p for p in found)
