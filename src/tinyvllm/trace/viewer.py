"""The trace viewer: one self-contained HTML file, a step slider and arrow keys over inline SVG.

Concept: ``trace_html(trace)`` writes every step's picture (``svg_step.step_svg``) into one
page, shows one at a time, and moves between them with a slider, two buttons and the
arrow keys (Home and End jump to the ends); the address ends in ``#step-N``, so a link can
open a given step. The trace itself is embedded as JSON (``<script type="application/json"
id="tinyvllm-trace">``), for whoever wants the numbers behind a picture. The page loads
nothing: no script, style sheet, font or image from anywhere, so it works offline, from a
file, inside the docs site (an ``<iframe>``) or attached to an issue; its icon is an empty
``data:`` URL, so a browser does not ask the server for ``/favicon.ico`` either.

Follows: issue 26 ("a viewer"). Mirrors: nothing in vLLM.

Invariants: the page holds exactly ``len(trace.steps)`` ``<figure class="step">``, the
first shown and the others ``hidden``; the JSON parses back into the same ``Trace``
(``Trace.from_json``); the page contains no ``http://`` or ``https://`` reference except
the SVG namespace.

NOTE 1 (the script): about forty lines of plain JavaScript, no framework. It exposes
``window.tinyvllmTrace`` (``show(i)``, ``current()``, ``count``) for the browser tests.
NOTE 2 (``</script>`` in the JSON): the JSON is escaped so that no ``<`` appears in it (a
token's text could contain ``</script>``).
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from tinyvllm.trace.snapshot import Trace
from tinyvllm.trace.svg_step import step_svg

STYLE = """
:root { color-scheme: light; }
body { margin: 0; font-family: system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; color: #222; background: #fafafa; }
header { position: sticky; top: 0; background: #fff; border-bottom: 1px solid #ddd; padding: 8px 16px; z-index: 1; }
h1 { font-size: 17px; margin: 0 0 4px 0; }
header p { margin: 0 0 6px 0; font-size: 13px; color: #555; max-width: 960px; }
.controls { display: flex; align-items: center; gap: 8px; font-size: 13px; }
.controls input[type=range] { flex: 1; max-width: 640px; }
.controls button { font-size: 14px; padding: 2px 10px; cursor: pointer; }
main { padding: 12px 16px; }
figure.step { margin: 0; }
figure.step svg { max-width: 100%; height: auto; background: #fff; border: 1px solid #e4e4e4; }
kbd { border: 1px solid #ccc; border-radius: 3px; padding: 0 4px; font-size: 12px; background: #f3f3f3; }
"""

SCRIPT = """
(() => {
  const figures = [...document.querySelectorAll('figure.step')];
  const slider = document.getElementById('step-slider');
  const label = document.getElementById('step-number');
  let current = 0;
  function show(i) {
    i = Math.max(0, Math.min(figures.length - 1, i));
    figures[current].hidden = true;
    figures[i].hidden = false;
    current = i;
    slider.value = String(i);
    label.textContent = `step ${i + 1} of ${figures.length}: ${figures[i].dataset.label}`;
    if (location.hash !== `#step-${i}`) history.replaceState(null, '', `#step-${i}`);
  }
  slider.addEventListener('input', () => show(Number(slider.value)));
  document.getElementById('step-prev').addEventListener('click', () => show(current - 1));
  document.getElementById('step-next').addEventListener('click', () => show(current + 1));
  document.addEventListener('keydown', (e) => {
    if (e.target instanceof HTMLInputElement && e.target.type !== 'range') return;
    const to = {ArrowLeft: current - 1, ArrowRight: current + 1, Home: 0, End: figures.length - 1}[e.key];
    if (to !== undefined) { e.preventDefault(); show(to); }
  });
  const m = /^#step-(\\d+)$/.exec(location.hash);
  figures.forEach((f, i) => { f.hidden = i !== 0; });
  show(m ? Number(m[1]) : 0);
  window.tinyvllmTrace = {show, current: () => current, count: figures.length};
})();
"""


def trace_html(trace: Trace) -> str:
    """The viewer page of ``trace`` (module header)."""
    if not trace.steps:
        raise ValueError(f"the trace {trace.title!r} has no steps: nothing to show")
    figures = "\n".join(
        f'<figure class="step" id="figure-{i}" data-step="{i}" data-label="{escape(s.label)}"{" hidden" if i else ""}>'
        f"{step_svg(trace, i)}</figure>"
        for i, s in enumerate(trace.steps)
    )
    data = trace.to_json().replace("<", "\\u003c")  # NOTE 2
    last = len(trace.steps) - 1
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'  # an empty icon: no request for /favicon.ico
        f"<title>{escape(trace.title)}</title><style>{STYLE}</style></head><body>"
        f"<header><h1>{escape(trace.title)}</h1>"
        + (f"<p>{escape(trace.description).replace(chr(10), '<br>')}</p>" if trace.description else "")  # a line per rank
        + '<div class="controls"><button id="step-prev" title="previous step (left arrow)">&#9664;</button>'
        f'<input id="step-slider" type="range" min="0" max="{last}" value="0" aria-label="step">'
        '<button id="step-next" title="next step (right arrow)">&#9654;</button>'
        '<span id="step-number"></span><span style="color:#777">&nbsp;<kbd>&larr;</kbd> <kbd>&rarr;</kbd> step, '
        "<kbd>Home</kbd> <kbd>End</kbd></span></div></header>"
        f"<main>{figures}</main>"
        f'<script type="application/json" id="tinyvllm-trace">{data}</script>'
        f"<script>{SCRIPT}</script></body></html>\n"
    )


def write_html(trace: Trace, path: str | Path) -> Path:
    """Write the viewer of ``trace`` to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(trace_html(trace), encoding="utf-8")
    return path


def write_svgs(trace: Trace, folder: str | Path) -> list[Path]:
    """Write one still per step, ``step-00.svg``, ``step-01.svg``, ... into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    width = max(len(str(len(trace.steps) - 1)), 2)
    paths = []
    for i in range(len(trace.steps)):
        path = folder / f"step-{i:0{width}d}.svg"
        path.write_text(step_svg(trace, i), encoding="utf-8")
        paths.append(path)
    return paths
