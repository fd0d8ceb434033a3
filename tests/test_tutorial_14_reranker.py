"""Tutorial 14 reads a causal LM as a reranker pair by pair: this test pins the facts its page
relies on.

``tests/test_tutorial_pages.py`` compares the whole output with ``docs/generated/14_reranker.txt``;
here the lines are checked against the rules: the overrides make a pooling engine whose one
label's head is exactly ``w_yes - w_no``; the first pair finds nothing in the prefix cache and
every later pair finds the query's full blocks (and no more than the query); ``LLM.score``
gives the same scores, and each equals the causal LM's softmax over the two tokens. The
script runs once per session (``tutorial_runner``).
"""

import re

import pytest

from tutorial_runner import tutorial_output

BLOCK = 4  # block_size in the script


@pytest.mark.slow
def test_tutorial_14_reranker_shares_the_query_and_scores_as_the_causal_lm():
    out = tutorial_output("14_reranker.py")
    assert "runner: pooling, tasks: ('classify', 'score', 'token_classify'), labels: ('LABEL_0',)" in out
    assert "score head: (1, 256), equal to w_yes - w_no: True" in out
    query_len = int(re.search(r"^query: (\d+) tokens", out, re.M).group(1))
    rows = re.findall(r"^\s*(\d+) \| .{19} \|\s*(\d+) \|\s*(\d+) \| (0\.\d{4})$", out, re.M)
    assert len(rows) == 4, out
    for pair, tokens, found, score in rows:
        assert int(tokens) > query_len and 0 < float(score) < 1
        want = 0 if pair == "0" else (query_len // BLOCK) * BLOCK  # the query's full blocks, once computed
        assert int(found) == want, (pair, found, want)
    assert "LLM.score gives the same scores: True" in out
    assert out.rstrip().endswith("(max difference < 1e-5): True")
