"""Tutorial 10 replays one request's drafts step by step: this test pins the facts its page
relies on.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/10_spec_decode.txt``; here each row of the step table is checked against
the rules of speculative decoding: what is kept is a prefix of the drafts, one token is
added after it, and ``num_computed_tokens`` advances by the sampled token plus the kept
drafts only (the scheduler counted every draft, ``update_from_output`` took the rejected
ones back). The script runs once per session: the output is shared with that test.
"""

import re

import pytest

from tutorial_runner import tutorial_output

K = 3  # num_speculative_tokens in the script


def _tokens(cell: str) -> list[str]:
    return [] if cell == "-" else cell.split("|")


@pytest.mark.slow
def test_tutorial_10_spec_decode_steps_follow_the_rules():
    out = tutorial_output("10_spec_decode.py")
    # the cells join tokens with "|", so each row is cut at the table's fixed column widths
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step |")) + 2
    rows = [line for line in lines[start : lines.index("", start)] if line[:4].strip().isdigit()]
    prompt_len = int(re.search(r"prompt \((\d+) tokens\)", out).group(1))
    total_drafts = total_kept = 0
    for line in rows:
        step, drafts, kept, added, computed = (line[0:4], line[7:28], line[31:45], line[48:54], line[57:])
        drafts, kept, added = _tokens(drafts.strip()), _tokens(kept.strip()), _tokens(added.strip())
        before, after = (int(x) for x in computed.split("->"))
        assert len(drafts) <= K and len(added) == 1, line
        assert kept == drafts[: len(kept)], f"step {step}: the kept tokens are not a prefix of the drafts: {line}"
        if int(step) == 1:
            assert (before, after) == (0, prompt_len), line  # the whole prompt in one step, no drafts yet
        else:
            # scheduled: the last sampled token and every draft; kept: that token and the accepted drafts
            assert after == before + 1 + len(kept), f"step {step}: computed tokens not rolled back: {line}"
        total_drafts += len(drafts)
        total_kept += len(kept)
    assert total_kept > 0 and total_drafts > total_kept, "the page needs steps with kept and with rejected drafts"
    stats = re.search(r"drafts verified (\d+), kept (\d+) \(acceptance (\d+)%\), kept by position \[([\d, ]+)\]", out)
    assert stats, out
    assert (int(stats.group(1)), int(stats.group(2))) == (total_drafts, total_kept)
    per_pos = [int(x) for x in stats.group(4).split(",")]
    assert len(per_pos) == K and sum(per_pos) == total_kept and per_pos == sorted(per_pos, reverse=True)
    steps = int(re.search(r"(\d+) tokens in (\d+) steps", out).group(2))
    assert steps == len(rows) and steps < int(re.search(r"(\d+) tokens in", out).group(1))
    assert "same tokens as without speculation: yes" in out


@pytest.mark.slow
def test_tutorial_10_under_async_scheduling_schedules_placeholders_and_gets_the_same_tokens():
    """The second table: each call schedules the next step's drafts as placeholders before the
    last step's tokens are back; the tokens arrive one call later, all 24 of them, and the same
    tokens and drafts as the synchronous run."""
    out = tutorial_output("10_spec_decode.py")
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("call |")) + 2
    rows = [[line[0:4].strip(), line[7:18].strip(), line[21:].strip()] for line in lines[start:] if line[:4].strip().isdigit()]
    assert rows[0][1].endswith("tokens") and rows[0][2] == "0"  # the prompt; nothing is back yet
    assert all(cell == "1 + ?|?|?" for _, cell, _ in rows[1:-1])  # k placeholders, whatever the runner finds
    assert rows[-1][1:] == ["-", "0"]  # the step scheduled after the last token was thrown away
    assert sum(int(back) for *_, back in rows) == 24
    assert "24 tokens in " + str(len(rows)) + " calls; the same tokens and drafts as above: yes" in out
