"""Rewrite the tutorials' golden output, ``docs/generated/NN_name.txt``, from what each
tutorial prints now.

Run from the repository root:

    python tutorials/regenerate_golden.py           # every tutorial
    python tutorials/regenerate_golden.py 03 06     # only tutorials 03 and 06

Each tutorial runs the way the tests run it (``tests/tutorial_runner.py``): with this
interpreter, the repository's ``src`` first on ``PYTHONPATH`` and
``TOKENIZERS_PARALLELISM=false``. Only stdout is kept. Read ``git diff docs/generated/``
before committing: a golden file is what the docs show, and a change in it should be
one you meant. ``tests/test_tutorial_pages.py`` fails while a golden file and its
tutorial's output differ.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TUTORIALS = REPO / "tutorials"
GENERATED = REPO / "docs" / "generated"


def tutorial_scripts() -> list[Path]:
    """The numbered tutorials, ``NN_name.py``, in order."""
    return sorted(p for p in TUTORIALS.glob("[0-9][0-9]_*.py"))


def run(script: Path) -> str:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{script.relative_to(REPO)} exited with {proc.returncode}:\n{proc.stderr}")
    return proc.stdout


def main(numbers: list[str]) -> None:
    scripts = tutorial_scripts()
    if numbers:
        unknown = [n for n in numbers if not any(s.name.startswith(f"{n}_") for s in scripts)]
        if unknown:
            sys.exit(f"no tutorial numbered {', '.join(unknown)}; there are {', '.join(s.name[:2] for s in scripts)}")
        scripts = [s for s in scripts if s.name[:2] in numbers]
    GENERATED.mkdir(parents=True, exist_ok=True)
    for script in scripts:
        golden = GENERATED / f"{script.stem}.txt"
        output = run(script)
        old = golden.read_text(encoding="utf-8") if golden.exists() else None
        golden.write_text(output, encoding="utf-8")
        state = "unchanged" if old == output else ("written" if old is None else "CHANGED")
        print(f"{golden.relative_to(REPO)}: {state}")


if __name__ == "__main__":
    main(sys.argv[1:])
