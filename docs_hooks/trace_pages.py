"""MkDocs hook: the pages show pictures of every engine step, drawn from the code at build time.

A page asks for a trace with a marker (an HTML comment, so a plain Markdown viewer shows
nothing):

- ``<!-- tinyvllm:trace NAME -->``: the viewer of built-in workload ``NAME``
  (``tinyvllm/trace/workloads.py``) in an ``<iframe>``, with a link to open it alone;
- ``<!-- tinyvllm:trace-figure NAME WHAT -->``: a still, as an ``<img>``: ``step-N`` (the
  picture of step N), ``budget``, ``tables`` or ``padding`` (the whole-run pictures of
  ``tinyvllm/trace/svg_runs.py``).

``on_files`` runs every workload, adds its viewer ``traces/NAME.html`` to the site, and
``traces/NAME/WHAT.svg`` for each still a page asks for (nothing is committed, so
the pictures cannot drift from the code); ``on_page_markdown`` replaces the markers. An
unknown name or figure fails the build.

Cost: the workloads that run the engine import torch and build a tiny model (about 5 s
on two cores). Each trace is kept as JSON in ``$TINYVLLM_DOCS_CACHE/traces-<key>/``
(default ``~/.cache/tinyvllm-docs``, as ``mermaid_assets.py`` keeps mermaid), where the key
hashes every source file of the package, this hook, and the versions of the libraries
the tiny model comes from: any change to the code draws them afresh, an unchanged
tree reads them back in milliseconds.
"""

from __future__ import annotations

import hashlib
import html
import importlib.metadata
import os
import re
import sys
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File
from mkdocs.utils import get_relative_url

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # draw with the working tree's code

MARK = re.compile(r"<!--\s*tinyvllm:trace(?P<figure>-figure)?\s+(?P<name>[\w-]+)(?:\s+(?P<what>[\w-]+))?\s*-->")
RUN_FIGURES = ("budget", "tables", "padding")
VIEWER_MAX_HEIGHT = 780
_state: dict = {}


def cache_dir() -> Path:
    return Path(os.environ.get("TINYVLLM_DOCS_CACHE") or "~/.cache/tinyvllm-docs").expanduser()


def cache_key() -> str:
    """A hash of everything a trace depends on (module docstring)."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "src" / "tinyvllm").rglob("*.py")) + [Path(__file__)]:
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for package in ("torch", "transformers", "tokenizers", "safetensors"):
        try:
            digest.update(f"{package}={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{package}=none".encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


def load_trace(name: str, cache: Path | None = None):
    """The trace of workload ``name``: from the cache, else run and cached."""
    from tinyvllm.trace.snapshot import Trace
    from tinyvllm.trace.workloads import run_workload

    folder = (cache or cache_dir()) / f"traces-{cache_key()}"
    path = folder / f"{name}.json"
    if path.is_file():
        return Trace.from_json(path.read_text(encoding="utf-8"))
    trace = run_workload(name)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}-", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(trace.to_json())
    os.replace(tmp, path)
    return trace


def wanted(docs_dir: Path) -> dict[str, set[str]]:
    """Workload -> the stills the pages ask for (a viewer alone asks for none)."""
    found: dict[str, set[str]] = {}
    for page in sorted(docs_dir.rglob("*.md")):
        for m in MARK.finditer(page.read_text(encoding="utf-8")):
            stills = found.setdefault(m["name"], set())
            if m["figure"]:
                stills.add(m["what"] or "")
    return found


def figure_svg(trace, what: str, name: str) -> str:
    from tinyvllm.trace.svg_runs import RUN_FIGURES as DRAW_RUN
    from tinyvllm.trace.svg_step import step_svg

    step = re.fullmatch(r"step-(\d+)", what)
    if step and int(step[1]) < len(trace.steps):
        return step_svg(trace, int(step[1]))
    if what in RUN_FIGURES:
        return DRAW_RUN[what](trace)
    raise PluginError(
        f"trace_pages: tinyvllm:trace-figure {name} {what!r}: choose step-0..step-{len(trace.steps) - 1} or one of {RUN_FIGURES}"
    )


def on_files(files, config):
    from tinyvllm.trace.viewer import trace_html
    from tinyvllm.trace.workloads import WORKLOADS

    _state.clear()
    asked = wanted(Path(config["docs_dir"]))
    unknown = sorted(set(asked) - set(WORKLOADS))
    if unknown:
        raise PluginError(f"trace_pages: pages ask for workloads {unknown}; the workloads are {sorted(WORKLOADS)}")
    for name in WORKLOADS:  # every viewer, so that any page may link to traces/NAME.html
        stills = asked.get(name, set())
        trace = load_trace(name)
        page = trace_html(trace)
        files.append(File.generated(config, f"traces/{name}.html", content=page))
        heights = [int(m) for m in re.findall(r'<svg [^>]*?height="(\d+)"', page)]
        _state[name] = (trace, min(max(heights) + 130, VIEWER_MAX_HEIGHT))
        for what in sorted(stills):
            files.append(File.generated(config, f"traces/{name}/{what}.svg", content=figure_svg(trace, what, name)))
    return files


def _embed(m: re.Match, page) -> str:
    name, what = m["name"], m["what"]
    trace, height = _state[name]
    viewer = get_relative_url(f"traces/{name}.html", page.url)
    title = html.escape(trace.title)
    if m["figure"]:
        src = get_relative_url(f"traces/{name}/{what}.svg", page.url)
        return (
            f'\n<figure class="tinyvllm-trace-still" markdown="0"><a href="{viewer}"><img src="{src}" alt="{title}: {what}" '
            f'style="max-width:100%;border:1px solid #e4e4e4"></a></figure>\n'
        )
    return (
        f'\n<div class="tinyvllm-trace" markdown="0"><iframe class="tinyvllm-trace" src="{viewer}" title="{title}" '
        f'style="width:100%;height:{height}px;border:1px solid #ddd;border-radius:4px"></iframe>'
        f'<p style="font-size:.8em;margin-top:.2em">{title}: drag the slider or use the arrow keys (click the picture '
        f'first). <a href="{viewer}">Open it on its own page</a>; '
        f"<code>tinyvllm trace --workload {name}</code> writes the same file.</p></div>\n"
    )


def on_page_markdown(markdown, page, config, files):
    return MARK.sub(lambda m: _embed(m, page), markdown)
