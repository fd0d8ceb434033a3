"""Run a script of ``tutorials/`` the way a reader would, and return what it printed.

``tutorial_output(name)`` runs each script at most once per test session: the golden-file
test (``tests/test_tutorial_pages.py``) and the tests that check a tutorial's key lines
share the same run, so a slow tutorial is not run twice.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_tutorial(name: str, timeout: int = 300) -> str:
    """Run ``tutorials/<name>`` with this interpreter and the repo's ``src``; fail on a non-zero exit."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tutorials" / name)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"tutorials/{name} exited with {proc.returncode}:\n{proc.stderr}"
    return proc.stdout


@functools.cache
def tutorial_output(name: str) -> str:
    """``run_tutorial(name)``, run once per session and remembered."""
    return run_tutorial(name)
