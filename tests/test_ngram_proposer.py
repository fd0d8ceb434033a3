"""The n-gram proposer (``spec_decode/ngram_proposer.py``): the module's worked example, its
edge cases, and (Hypothesis) the linear-time search against a brute-force definition."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.spec_decode.ngram_proposer import NgramProposer, find_ngram_drafts

A, B, C, D, E = range(5)


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: the longest suffix (min_n..max_n) with an earlier occurrence, its
    earliest occurrence, the k tokens after it."""
    total = len(tokens)
    for length in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - length :]
        for start in range(0, total - length):  # ends before the suffix itself starts... or overlaps it
            if tokens[start : start + length] == suffix:
                after = start + length
                return tokens[after : after + k]
    return []


def test_the_worked_example():
    tokens = [A, B, C, D, E, A, B, C]
    assert find_ngram_drafts(tokens, 2, 5, 3) == [D, E, A]
    assert find_ngram_drafts(tokens, 4, 5, 3) == []  # B C A B C ... never occurred before
    assert find_ngram_drafts(tokens, 2, 2, 3) == [D, E, A]  # B C at position 1
    assert find_ngram_drafts(tokens, 2, 5, 10) == [D, E, A, B, C]  # never past the end


def test_the_earliest_occurrence_of_the_longest_match_wins():
    tokens = [A, B, C, A, B, D, A, B]
    assert find_ngram_drafts(tokens, 2, 3, 1) == [C]  # A B at 0 and at 3: the earliest
    assert find_ngram_drafts([A, A, A, A], 1, 3, 2) == [A]  # the suffix A A A occurred at 0


def test_no_drafts_without_a_match_or_room():
    assert find_ngram_drafts([A, B, C, D], 2, 4, 3) == []
    assert find_ngram_drafts([A], 1, 3, 3) == []
    assert find_ngram_drafts([A, B, A, B], 2, 3, 0) == []
    proposer = NgramProposer(3, 2, 5, max_model_len=9)
    assert proposer.propose([A, B, C, D, E, A, B, C]) == [D]  # one slot left before max_model_len
    assert proposer.propose([A, B, C, D, E, A, B, C, D]) == []


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
    k=st.integers(0, 6),
)
def test_the_linear_search_equals_the_definition(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert find_ngram_drafts(tokens, min_n, max_n, k) == brute_force(tokens, min_n, max_n, k)
