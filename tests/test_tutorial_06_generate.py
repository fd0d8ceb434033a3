"""Tutorial 06 runs the shipped model, round-trips text through the tokenizer, reuses a
shared file header in whole blocks, changes no token with caching off, and matches
transformers.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/06_generate.txt``; this test pins the facts the page relies on. The
script runs once per session: the output is shared with that test.
"""

import re

import pytest

from tutorial_runner import tutorial_output

BLOCK_SIZE = 16  # LLM's default


def _table(out: str) -> dict[int, dict[str, str]]:
    """The request table as ``{request id: {column: cell}}``."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("request |"))
    columns = [c.strip() for c in lines[header].split("|")]
    rows = {}
    for line in lines[header + 1 :]:
        if "|" not in line:
            break
        cells = dict(zip(columns, (c.strip() for c in line.split("|", len(columns) - 1))))
        rows[int(cells["request"])] = cells
    return rows


@pytest.mark.slow
def test_tutorial_06_generate():
    out = tutorial_output("06_generate.py")
    assert "model: stdlib_tiny" in out
    assert "prompt_token_ids are the tokenizer's encoding of the prompt: yes" in out
    assert "text is the tokenizer's decoding of token_ids: yes" in out
    header_tokens = int(re.search(r"the same (\d+)-token file header", out).group(1))
    rows = _table(out)
    assert len(rows) == 6, rows
    first, *others = sorted(rows)
    cached = {r: int(row["num_cached_tokens"]) for r, row in rows.items()}
    assert cached[first] == 0, f"the first request with the header has nothing to hit, got {cached}"
    for r in others:
        # a hit is whole blocks of the header, and never the prompt's last token
        assert 0 < cached[r] <= header_tokens and cached[r] % BLOCK_SIZE == 0, (r, rows[r])
        assert header_tokens - cached[r] < 2 * BLOCK_SIZE, (r, rows[r])
    total = sum(int(row["prompt tokens"]) for row in rows.values())
    rate = f"prompt tokens served from the cache: {sum(cached.values())} of {total} ({100 * sum(cached.values()) / total:.0f}%)"
    assert rate in out
    assert "with prefix caching off: same text yes, cached tokens 0" in out
    assert "token ids equal transformers' greedy generate for all 7 requests: yes" in out
