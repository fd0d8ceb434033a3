"""The sampling tutorials print the documents' results.

``tests/test_tutorial_pages.py`` compares each whole output with its golden file in
``docs/generated/``; these tests pin the facts the pages rely on. Each script runs once
per session: the output is shared with that test.
"""

import pytest
from tutorial_runner import tutorial_output as run


@pytest.mark.seed("001:N", "001:R2", "001:S2", "001:U2")
def test_tutorial_03_logits_processors():
    out = run("03_logits_processors.py")
    assert "after:  biases = {1: {100: 0.5}, 0: {200: -0.3}}" in out  # N.3 swap
    assert "after:  biases = {2: {300: 0.8}, 1: {100: 0.5}}" in out  # N.4 one-way move
    assert "rows = [0, 0, 2]  tokens = [100, 200, 50]  bias = [0.5, -0.3, 1.0]" in out  # S2
    # R2: the appendix's hand-made update, then the same step from a real batch
    r2 = out.split("== Appendix R2")[1].split("== Appendix U2")[0]
    assert "update: removed = [1]  added at rows [1, 3]  moved = [(2, 3, 'UNIDIRECTIONAL')]" in r2
    assert "update: removed = []  added at rows [1, 3]  moved = [(2, 3, 'SWAP')]" in r2
    assert r2.count("after:  min_p = [0.1, 0.2, 0.0, 0.05]  count = 3  non-zero rows = 3") == 2
    assert "pop_removed x3 = [3, 5, 7]" in out  # U2


@pytest.mark.seed("001:O", "001:T2")
def test_tutorial_04_thinking_budget():
    out = run("04_thinking_budget.py")
    assert "budget=10 think_count=8 spec_len=3 -> force_index=[2]" in out
    assert "output = [1, 7, 7, 7, 2, 3, 7, 7, 7]" in out
    assert "-> token 2 (forced)" in out and "-> token 3 (forced)" in out
    assert "force_index = [2]; forced rows = [[2, 2]]" in out
