"""Tutorial 01 (prefix caching) replays seed 002 §3.2: the facts the walkthrough relies on.

``docs/kv_cache_manager.md`` and ``docs/tutorials/01_prefix_caching.md`` embed
``docs/generated/01_prefix_caching.txt``; ``tests/test_tutorial_pages.py`` keeps that file
equal to what the script prints (regenerate it with
``python tutorials/regenerate_golden.py 01``). The script runs once per session: the
output is shared with that test.
"""

from __future__ import annotations

import pytest
from tutorial_runner import tutorial_output as run_once


@pytest.fixture(scope="module")
def tutorial_output() -> str:
    return run_once("01_prefix_caching.py")


def _section(output: str, title_start: str) -> str:
    """The printed section whose header line starts with ``title_start``."""
    parts = output.split("=" * 78)
    for i, part in enumerate(parts):
        if part.strip().startswith(title_start):
            return parts[i + 1]
    raise AssertionError(f"no section {title_start!r} in the tutorial output")


@pytest.mark.seed("002:3.2")
def test_prefix_caching_tutorial_replays_seed_002(tutorial_output: str) -> None:
    step0 = _section(tutorial_output, "step 0:")
    assert "req0: 0[ABCD]  1[EFGH]  2[IJKL]  3[MNO_]" in step0
    step3 = _section(tutorial_output, "step 3:")
    assert "req0: 0[ABCD]  1[EFGH]  2[IJKL]  3[MNOP]  4[Q___]" in step3
    assert "MNOP         -> block 3" in step3
    step4 = _section(tutorial_output, "step 4:")
    assert "get_computed_blocks(req1) -> blocks [0, 1], 8 tokens" in step4
    assert "req1: 0[ABCD]  1[EFGH]  5[IJkl]  6[mn__]" in step4
    step5 = _section(tutorial_output, "step 5:")
    assert "7  8  9  4  3*[MNOP]  2*[IJKL]\n" in step5
    step5b = _section(tutorial_output, "step 5 (cont.)")
    assert "7  8  9  4  3*[MNOP]  2*[IJKL]  6  5*[IJkl]  1*[EFGH]  0*[ABCD]" in step5b
    step6 = _section(tutorial_output, "step 6:")
    assert "get_computed_blocks(req2) -> blocks [0, 1, 2], 12 tokens" in step6
    table = next(line for line in step6.splitlines() if line.strip().startswith("req2:"))
    ids = [cell.split("[")[0] for cell in table.split(":", 1)[1].split("  ") if cell.strip()]
    assert [int(i) for i in ids] == [0, 1, 2, 7, 8, 9, 4, 3], table
    lines = step6.splitlines()
    queue_header = next(i for i, line in enumerate(lines) if line.strip().startswith("free queue, head"))
    assert lines[queue_header + 1].split() == ["6", "5*[IJkl]"], lines[queue_header + 1]
    assert "evicted: MNOP (block 3) leaves the prefix cache" in step6
    cache = step6.split("prefix cache:")[1]
    assert "MNOP" not in cache
    assert "12 13 14 15  -> block 4" in cache
