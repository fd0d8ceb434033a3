"""Run Python as if some installed packages were not installed.

    python tests/without_packages.py fastapi,uvicorn -m pytest -m gpu --collect-only -q
    python tests/without_packages.py openai -c "import tinyvllm"

The first argument names top-level packages, comma-separated; the rest is what follows
``python`` on a command line, ``-m MODULE ARGS...`` or ``-c CODE ARGS...``. Every finder of
``sys.meta_path`` is wrapped so that it finds nothing for those names (nor their
submodules): ``import fastapi`` raises ``ModuleNotFoundError: No module named 'fastapi'`` and
``importlib.util.find_spec("fastapi")`` is ``None``, as on a machine without the package (only
its distribution metadata stays visible). A finder added later (pytest's assertion rewriter)
finds only test files, never these names.

``tests/test_gpu_path_without_serve_extras.py`` uses it to show, in a venv that has the
serving packages, that the GPU path and ``pytest -m gpu`` do not need them.
"""

from __future__ import annotations

import os
import runpy
import sys


class _Hiding:
    """A meta path finder that finds nothing for the hidden names and defers to ``finder`` otherwise."""

    def __init__(self, finder, hidden: frozenset[str]):
        self.finder = finder
        self.hidden = hidden

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.hidden:
            return None
        find_spec = getattr(self.finder, "find_spec", None)
        return find_spec(name, path, target) if find_spec is not None else None

    def __getattr__(self, attribute):  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, attribute)


def hide(names) -> None:
    """Make ``names`` (top-level packages) unimportable in this process; they must not be imported yet."""
    hidden = frozenset(names)
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in hidden)
    if loaded:
        raise RuntimeError(f"already imported, cannot hide: {loaded}")
    sys.meta_path[:] = [_Hiding(finder, hidden) for finder in sys.meta_path]


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] not in ("-m", "-c"):
        sys.exit("usage: python tests/without_packages.py NAME[,NAME...] (-m MODULE | -c CODE) [ARGS...]")
    hide(name for name in argv[0].split(",") if name)
    if argv[1] == "-m":  # as `python -m`: sys.path[0] is the working directory
        sys.path[0] = os.getcwd()
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:  # as `python -c`: sys.path[0] is ''
        sys.path[0] = ""
        sys.argv = ["-c", *argv[3:]]
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main(sys.argv[1:])
