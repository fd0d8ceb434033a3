"""``tinyvllm/arith.py``: the rows each request owns in a speculative verification step."""

from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.arith import spec_row_starts


def test_row_starts_of_the_docstring_example():
    assert spec_row_starts([[7, 8], [], [9]]) == [0, 3, 4, 6]
    assert spec_row_starts([]) == [0]


@given(st.lists(st.lists(st.integers(0, 9), max_size=5), max_size=8))
def test_each_request_owns_its_drafts_plus_one_row_back_to_back(drafts):
    starts = spec_row_starts(drafts)
    assert [b - a for a, b in zip(starts, starts[1:])] == [len(d) + 1 for d in drafts]
    assert starts[0] == 0 and starts[-1] == sum(len(d) for d in drafts) + len(drafts)
