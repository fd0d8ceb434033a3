"""Tutorial 13 follows one embedding step by step: this test pins the facts its page relies on.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/13_embeddings.txt``; here each row of the step table is checked against the
rules of the pooling runner: the chunks cover the prompt back to back within the token
budget, the pooling state has summed exactly the positions computed so far, and the vector
is made once, in the step that ends the prompt. Then MEAN takes no prefix hit and LAST does,
and every vector is transformers'. The script runs once per session (``tutorial_runner``).
"""

import re

import pytest

from tutorial_runner import tutorial_output

BUDGET = 8  # max_num_batched_tokens in the script


@pytest.mark.slow
def test_tutorial_13_embeddings_pools_every_chunk_and_follows_the_cache_rule():
    out = tutorial_output("13_embeddings.py")
    prompt_len = int(re.search(r"prompt \((\d+) tokens\)", out).group(1))
    rows = re.findall(r"^\s*(\d+) \|\s*(\d+) \.\.\s*(\d+)\s*\|\s*(\d+) \|\s*(\d+) \| (yes|no)$", out, re.M)
    assert len(rows) >= 2, out
    position = 0
    for i, (step, first, last, count, summed, made) in enumerate(rows):
        first, last, count, summed = int(first), int(last), int(count), int(summed)
        assert first == position and count == last - first + 1 <= BUDGET, rows[i]
        position = last + 1
        assert summed == position, f"step {step}: the state has summed {summed} positions, {position} computed"
        assert (made == "yes") is (position == prompt_len), f"step {step}: a vector {made} at {position}/{prompt_len}"
    assert position == prompt_len
    hits = dict(re.findall(r"^(MEAN|LAST): B found (\d+) tokens", out, re.M))
    assert hits["MEAN"] == "0" and int(hits["LAST"]) == 16
    checks = re.findall(r"max difference < 1e-5\): (\w+)$", out, re.M)
    assert checks == ["True"] * 3
