"""Tutorial 02 (the scheduler) shows each mechanism the walkthrough describes.

``docs/scheduler.md`` and ``docs/tutorials/02_scheduler.md`` embed
``docs/generated/02_scheduler.txt``; ``tests/test_tutorial_pages.py`` keeps that file equal
to what the script prints (regenerate it with ``python tutorials/regenerate_golden.py 02``).
The script runs once per session: the output is shared with that test.
"""

from __future__ import annotations

import pytest
from tutorial_runner import tutorial_output as run_once

COLUMNS = ["step", "tokens", "running", "waiting", "free", "hits", "preempted", "finished"]


@pytest.fixture(scope="module")
def tutorial_output() -> str:
    return run_once("02_scheduler.py")


def _table(output: str) -> list[dict[str, str]]:
    """The step table as one dict per row, keyed by column name."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("step |"))
    assert [c.strip() for c in lines[header].split("|")] == COLUMNS, lines[header]
    rows = []
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        cells = [c.strip() for c in line.split("|")]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


@pytest.mark.seed("002:opening")
def test_scheduler_tutorial_shows_chunking_hit_and_preemption(tutorial_output: str) -> None:
    rows = _table(tutorial_output)
    by_step = {int(r["step"]): r for r in rows}
    assert [int(r["step"]) for r in rows] == list(range(len(rows)))
    # Chunked prefill: the 10-token budget cuts A's 12-token prompt; B waits for budget.
    assert by_step[0]["tokens"] == "A:10*", by_step[0]
    assert by_step[0]["waiting"] == "B", by_step[0]
    assert by_step[1]["tokens"] == "A:2 B:8*", by_step[1]
    # Every step stays within the budget.
    for r in rows:
        total = sum(int(cell.split(":")[1].rstrip("*")) for cell in r["tokens"].split())
        assert total <= 10, r
    # A prefix hit at admission: C shares A's 8-token system prompt.
    assert by_step[2]["hits"] == "C:8", by_step[2]
    # Preemption: the pool runs dry, the *last* running request (C) is preempted and goes
    # to the front of the waiting queue; nothing is admitted in that step.
    assert by_step[5]["free"] == "0" and by_step[5]["running"] == "A B C", by_step[5]
    assert by_step[6]["preempted"] == "C", by_step[6]
    assert by_step[6]["waiting"] == "C" and "C" not in by_step[6]["tokens"], by_step[6]
    assert [r["step"] for r in rows if r["preempted"] != "-"] == ["6"]
    # C resumes and re-hits its own prefix: the system prompt plus its own full block.
    assert by_step[7]["hits"] == "C:12 resumed", by_step[7]
    assert by_step[7]["tokens"] == "B:1 C:3", by_step[7]
    # Everything finishes, nothing leaks, and preemption changed no output.
    assert all(by_step[s]["finished"].endswith("(length)") for s in (6, 7, 8))
    assert by_step[len(rows) - 1]["running"] == "-" and by_step[len(rows) - 1]["free"] == "10"
    assert "preemptions: 1\n" in tutorial_output
    assert "free blocks at the end: 10 of 10\n" in tutorial_output
    assert "no chunking, no preemption): yes\n" in tutorial_output
