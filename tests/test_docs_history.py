"""The docs lead with the rule and the mechanism; history waits in collapsed notes (issue 41).

Each phrase below tells how a page's subject came to be (a document's slip, a first run's
count, a listing's error) rather than what the code does. It must stay on its page, inside
a collapsed ``??? note`` block, so the page reads as an explanation first. A GPU run's log
(one run against another) lives in the ``bench/results/*/README.md`` of that run, which
the page links.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (page, phrase): history that must sit, collapsed, on that page.
COLLAPSED: list[tuple[str, str]] = [
    ("docs/logits_processors.md", "Appendix R2 walks one update through this listing"),
    ("docs/logits_processors.md", "The count of 1 is a slip of the walkthrough"),
    ("docs/logits_processors.md", "The appendix's closing estimate is too mild."),
    ("docs/logits_processor_plugins.md", "| input | the document's listing | ours | test |"),
    ("docs/thinking_budget.md", "For a SWAP, the listing reads both rows"),
    ("docs/thinking_budget.md", "The matrix gives one next state for both ways out of `in_end`."),
    ("docs/thinking_budget.md", "One line of the diagram does not match the document's own code."),
    ("docs/device_syncs.md", "found 26 waits in the step that adds them"),
    ("docs/device_syncs.md", "| workload | waits a step, before | after |"),
    ("docs/device_syncs.md", "Its first run, on an H100"),
]

# (page, the run's README, a line of the run log that moved there and left the page).
RUN_LOGS: list[tuple[str, str, str]] = [
    ("docs/running_on_a_gpu.md", "bench/results/gpu-h100-2026-11-27-run2/README.md", "| figure | latest run | first run |"),
]


def _enclosing_block(lines: list[str], index: int) -> str:
    """The nearest line above ``index`` that is not indented: the block a line belongs to."""
    for line in reversed(lines[:index]):
        if line.strip() and not line.startswith((" ", "\t")):
            return line
    return ""


@pytest.mark.parametrize(("page", "phrase"), COLLAPSED, ids=[f"{p}:{s[:30]}" for p, s in COLLAPSED])
def test_history_sits_in_a_collapsed_note(page: str, phrase: str):
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    found = [i for i, line in enumerate(lines) if phrase in line]
    assert found, f"{page} no longer says {phrase!r}: keep every fact (move it, do not drop it)"
    for i in found:
        block = _enclosing_block(lines, i)
        assert lines[i].startswith("    ") and block.startswith("??? "), (
            f"{page}:{i + 1}: {phrase!r} is outside a collapsed note (it sits under {block!r})"
        )


@pytest.mark.parametrize(("page", "readme", "line"), RUN_LOGS, ids=[p for p, _, _ in RUN_LOGS])
def test_a_run_log_lives_in_its_runs_readme_and_the_page_links_it(page: str, readme: str, line: str):
    text = (ROOT / page).read_text(encoding="utf-8")
    assert line in (ROOT / readme).read_text(encoding="utf-8"), f"{readme} lacks the run log: {line!r}"
    assert line not in text, f"{page} still holds the run log {line!r}; it belongs in {readme}"
    assert f"/blob/main/{readme})" in text, f"{page} does not link {readme}"
