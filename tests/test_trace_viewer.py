"""The trace viewer: one self-contained HTML file whose pictures draw the snapshots' numbers.

Without a browser: the page holds one figure per step (the first shown), embeds the trace
as JSON that reads back equal, references nothing outside itself, and each step's SVG
draws as many free blocks, block-table entries per request, queue entries, batch rows and
written slots as the snapshot holds; the whole-run pictures draw one column per step.

In a browser (Debian's Chromium driven by Playwright, as ``tests/test_docs_site.py``;
skipped without one unless ``TINYVLLM_REQUIRE_BROWSER=1``): each built-in workload's file
is opened from disk with every request that is not a ``file://`` one aborted; the test
steps forward with the right arrow through every step and back with the left arrow, checks
the shown step and that the counts drawn in the visible picture equal the snapshot's, and
that Home, End, the buttons, the slider and ``#step-N`` work, with no console error.
"""

from __future__ import annotations

import json
import re

import pytest
from test_docs_site import CHROMIUM_FLAGS, _find_chromium, _no_browser
from trace_fixtures import drawn_counts, snapshot_counts, workload_trace

from tinyvllm.trace.snapshot import Trace
from tinyvllm.trace.svg_runs import block_tables_timeline_svg, budget_timeline_svg, padding_timeline_svg
from tinyvllm.trace.svg_step import step_svg
from tinyvllm.trace.viewer import trace_html, write_html, write_svgs
from tinyvllm.trace.workloads import WORKLOADS

NAMES = sorted(WORKLOADS)


@pytest.mark.parametrize("name", NAMES)
def test_viewer_page_holds_every_step_and_the_trace_and_nothing_from_outside(name):
    trace = workload_trace(name)
    page = trace_html(trace)
    figures = re.findall(r'<figure class="step" id="figure-(\d+)"[^>]*?( hidden)?>', page)
    assert [int(i) for i, _ in figures] == list(range(len(trace.steps)))
    assert [bool(h) for _, h in figures] == [False] + [True] * (len(trace.steps) - 1)
    data = re.search(r'<script type="application/json" id="tinyvllm-trace">(.*?)</script>', page, re.S)[1]
    assert "<" not in data and Trace.from_dict(json.loads(data)) == trace
    outside = [u for u in re.findall(r"https?://[^\s\"'<>]+", page) if u != "http://www.w3.org/2000/svg"]
    assert outside == [], outside
    assert not re.search(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=[\"'](?!data:)", page), "the page loads a file"
    # Its icon is empty and inline: without one a browser asks the server for /favicon.ico,
    # which the docs site does not have (a console error on the page, found by the docs crawl).
    assert re.search(r'<link rel="icon" href="data:,">', page.split("</head>")[0])


@pytest.mark.parametrize("name", NAMES)
def test_each_step_picture_draws_the_snapshots_counts(name):
    trace = workload_trace(name)
    for index, snapshot in enumerate(trace.steps):
        want = snapshot_counts(snapshot, trace.panels)
        assert want, f"{name} step {index}: nothing to count"
        assert drawn_counts(step_svg(trace, index)) == want, f"{name} step {index}"


def test_whole_run_pictures_draw_one_column_per_step_and_the_documents_marks():
    budget = budget_timeline_svg(workload_trace("scheduler-preemption"))
    assert budget.count('data-role="timeline-step"') == 9
    assert budget.count('data-role="timeline-segment"') == sum(
        len(s.scheduler.scheduled) for s in workload_trace("scheduler-preemption").steps
    )
    assert "A:10*" in budget and "\u2715C preempted" in budget and "+C hit 12" in budget
    tables = block_tables_timeline_svg(workload_trace("seed004-duplication"))
    assert tables.count('data-role="timeline-step"') == 6 and "[block3, block4]" in tables
    assert "3 (14/16)" in tables and "4 (full)" in tables
    padding = padding_timeline_svg(workload_trace("cuda-graphs-padding"))
    pads = re.findall(r'data-role="timeline-pad" data-tokens="(\d+)"', padding)
    assert pads == ["3", "1"] and padding.count('data-mode="FULL"') == 3
    with pytest.raises(ValueError, match="no CUDA-graph dispatch"):
        padding_timeline_svg(workload_trace("seed002-prefix-caching"))


def test_a_large_pool_draws_only_the_blocks_the_run_touched():
    """svg_step NOTE 2: an engine with 4096 blocks and a short run. Before the fix, every step
    drew all 4096 blocks three times (pool, free queue, KV cache; 190 MB of viewer for five
    steps of two prompts on the shipped model). Now the pool and the cache draw the touched
    blocks, the free queue folds each untouched run into one box, and the counts still add up;
    the JSON of the trace holds the blocks that differ from a plain free one."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.trace import record
    from tinyvllm.trace.workloads import tiny_model_folder
    from tinyvllm.trace.svg_step import MAX_DRAWN_BLOCKS, touched_blocks

    llm = LLM(tiny_model_folder(), device="cpu", max_model_len=64, block_size=4, num_gpu_blocks_override=4096, seed=0)
    with record(llm) as t:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [5, 6, 7, 8, 11]}],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)  # fmt: skip
    trace = t.trace
    touched = touched_blocks(trace)
    assert trace.num_blocks == 4096 > MAX_DRAWN_BLOCKS and 0 < len(touched) <= 8
    for index, snapshot in enumerate(trace.steps):
        svg = step_svg(trace, index)
        assert drawn_counts(svg) == snapshot_counts(snapshot, trace.panels), f"step {index}"
        assert svg.count('data-role="pool-block"') == len(touched)
        assert svg.count('data-role="free-run"') >= 1 and len(svg) < 200_000, len(svg)
    # snapshot.py NOTE 3: the JSON (embedded in the viewer) leaves the plain free blocks out
    # (about 90 bytes per block per step before) and reads back into the same trace
    text = trace.to_json()
    assert len(text) < 20_000 * len(trace.steps), len(text)
    assert Trace.from_json(text) == trace


def test_write_svgs_writes_one_still_per_step(tmp_path):
    trace = workload_trace("seed002-prefix-caching")
    paths = write_svgs(trace, tmp_path / "stills")
    assert [p.name for p in paths] == [f"step-{i:02d}.svg" for i in range(7)]
    assert paths[3].read_text(encoding="utf-8") == step_svg(trace, 3)
    assert paths[0].read_text(encoding="utf-8").startswith('<svg xmlns="http://www.w3.org/2000/svg"')


# --- In a browser ---------------------------------------------------------------------------

COUNT_VISIBLE = """
() => {
  const fig = [...document.querySelectorAll('figure.step')].filter(f => !f.hidden);
  if (fig.length !== 1) return {error: `${fig.length} figures shown`};
  const counts = {};
  for (const e of fig[0].querySelectorAll('rect[data-role]')) {
    const role = e.dataset.role;
    let key = null;
    if (role === 'table-block') key = `table-block:${e.dataset.request}`;
    else if (role === 'slot') key = e.dataset.written === '1' ? 'written-slot' : null;
    else if (['free-block', 'running', 'waiting', 'batch-row'].includes(role)) key = role;
    if (role === 'free-run') counts['free-block'] = (counts['free-block'] || 0) + Number(e.dataset.count);
    if (role === 'allowed-tokens') e.dataset.allowed.split(' ').forEach((n, row) => {
      counts[`allowed:${e.dataset.request}:${row}`] = Number(n) + 1;  // trace_fixtures.drawn_counts
    });
    if (key) counts[key] = (counts[key] || 0) + 1;
  }
  const box = fig[0].querySelector('svg').getBoundingClientRect();
  return {step: Number(fig[0].dataset.step), current: window.tinyvllmTrace.current(), counts,
          slider: Number(document.getElementById('step-slider').value), width: box.width, height: box.height};
}
"""


@pytest.fixture(scope="module")
def browser():
    chromium = _find_chromium()
    if chromium is None:
        _no_browser("no Chromium binary was found (looked for /usr/bin/chromium and chromium on PATH)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _no_browser("the Python package 'playwright' is not installed")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def _shown(tab) -> dict:
    shown = tab.evaluate(COUNT_VISIBLE)
    assert "error" not in shown, shown
    return shown


@pytest.mark.parametrize("name", NAMES)
def test_viewer_steps_through_the_trace_offline_drawing_the_snapshots_counts(browser, tmp_path, name):
    trace = workload_trace(name)
    path = write_html(trace, tmp_path / f"{name}.html")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    outside: list[str] = []

    def abort(route):
        outside.append(route.request.url)
        route.abort()

    context.route(lambda url: not url.startswith("file://"), abort)
    tab = context.new_page()
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))
    try:
        tab.goto(path.as_uri(), wait_until="load")
        last = len(trace.steps) - 1
        order = list(range(len(trace.steps))) + list(range(last - 1, -1, -1))
        for k, index in enumerate(order):
            if k:
                tab.keyboard.press("ArrowRight" if index > order[k - 1] else "ArrowLeft")
            shown = _shown(tab)
            assert (shown["step"], shown["current"], shown["slider"]) == (index, index, index), shown
            assert shown["counts"] == dict(snapshot_counts(trace.steps[index], trace.panels)), f"step {index}"
            assert shown["width"] > 400 and shown["height"] > 100, shown
        assert tab.url.endswith("#step-0")
        tab.keyboard.press("ArrowLeft")  # already at the first step: it stays
        assert _shown(tab)["step"] == 0
        tab.keyboard.press("End")
        assert _shown(tab)["step"] == last and tab.url.endswith(f"#step-{last}")
        tab.keyboard.press("ArrowRight")  # and at the last
        assert _shown(tab)["step"] == last
        tab.keyboard.press("Home")
        tab.click("#step-next")
        assert _shown(tab)["step"] == 1
        tab.click("#step-prev")
        assert _shown(tab)["step"] == 0
        tab.locator("#step-slider").fill(str(last))
        assert _shown(tab)["step"] == last
        tab.goto(path.as_uri() + "#step-2", wait_until="load")  # a link to a step opens it
        tab.reload(wait_until="load")
        assert _shown(tab)["step"] == 2
    finally:
        context.close()
    assert errors == [] and outside == [], (errors, outside)
