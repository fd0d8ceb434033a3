"""The n-gram proposer (``spec_decode/ngram_proposer.py``): the module's worked example, its
edge cases, (Hypothesis) the linear-time search against a brute-force definition, and the
batched search over a ``TokenTable`` against the one-request search, step after step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.spec_decode.ngram_proposer import NgramProposer, batch_ngram_drafts, find_ngram_drafts
from tinyvllm.spec_decode.token_table import TokenTable

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


# -- the batched search (NOTE 2) and the token table -------------------------------------------


class Seq:
    """A request as the table sees it: a token list that only grows (``Request.all_token_ids``)."""

    def __init__(self, tokens: list[int]) -> None:
        self.all_token_ids = list(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.all_token_ids[start:end]


def as_table(seqs: list[list[int]], junk: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """The sequences as rows of a matrix wider than the longest, the rest filled with junk
    (a row's tokens past its length must never be read)."""
    width = max(map(len, seqs), default=0) + 3
    tokens = np.full((len(seqs) + 2, width), junk, dtype=np.int32)
    for row, seq in enumerate(seqs):
        tokens[row, : len(seq)] = seq
    return tokens, np.array([len(seq) for seq in seqs], dtype=np.int64)


def test_the_worked_example_in_a_batch():
    seqs = [[A, B, C, D, E, A, B, C], [A, B, C, D], [A, A, A, A], [A, B, C, A, B, D, A, B], []]
    tokens, lengths = as_table(seqs, junk=A)
    drafts = batch_ngram_drafts(tokens, lengths, 2, 5, np.array([3, 3, 2, 1, 3]))
    assert drafts == [[D, E, A], [], [A], [C], []]
    assert drafts == [find_ngram_drafts(seq, 2, 5, k) for seq, k in zip(seqs, [3, 3, 2, 1, 3])]


@settings(max_examples=300, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 4),
    ks=st.lists(st.integers(0, 5), min_size=6, max_size=6),
    junk=st.integers(0, 3),
)
def test_the_batched_search_equals_the_one_request_search(seqs, min_n, extra, ks, junk):
    tokens, lengths = as_table(seqs, junk)
    ks = np.array(ks[: len(seqs)])
    got = batch_ngram_drafts(tokens, lengths, min_n, min_n + extra, ks)
    assert got == [find_ngram_drafts(seq, min_n, min_n + extra, int(k)) for seq, k in zip(seqs, ks)]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_propose_batch_equals_propose_step_after_step(data):
    """Requests join, grow by 1 to 4 tokens a step (a decode step with drafts kept), leave,
    and come back (a preempted request, copied again); a new request may reuse nothing of a
    finished one. Each step ``propose_batch`` equals ``propose`` request by request, and the
    table's invariants hold."""
    k, min_n = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3))
    proposer = NgramProposer(k, min_n, min_n + data.draw(st.integers(0, 3)), max_model_len=48, min_batch_tokens=0)
    tokens = st.integers(0, 3)
    pool = [Seq(data.draw(st.lists(tokens, min_size=1, max_size=20))) for _ in range(6)]
    for _ in range(data.draw(st.integers(1, 12))):
        decoding = data.draw(st.lists(st.sampled_from(pool), unique_by=id, max_size=len(pool)))
        assert proposer.propose_batch(decoding) == [proposer.propose(seq.all_token_ids) for seq in decoding]
        proposer.check_invariants()
        for seq in pool:
            room = proposer.max_model_len - len(seq.all_token_ids)
            seq.all_token_ids += data.draw(st.lists(tokens, max_size=min(4, room)))
        if data.draw(st.booleans()):  # one request finishes; a new one takes its place in the pool
            pool[data.draw(st.integers(0, len(pool) - 1))] = Seq(data.draw(st.lists(tokens, min_size=1, max_size=20)))


def test_the_table_copies_only_new_tokens_and_gives_rows_back():
    table = TokenTable(max_width=100)
    a, b, c = Seq([1, 2, 3]), Seq([4, 5]), Seq([6])
    assert table.sync([a, b]) == [0, 1]  # the lowest rows first
    a.all_token_ids.append(9)
    table.tokens[0, :3] = -1  # already held: a sync must not copy these again
    assert table.sync([a, b]) == [0, 1]
    assert table.tokens[0, :4].tolist() == [-1, -1, -1, 9] and table.lengths[:2] == [4, 2]
    table.tokens[0, :3] = [1, 2, 3]
    assert table.sync([b, c]) == [1, 0]  # a left: its row went back, and c has it
    assert table.lengths[:2] == [1, 2] and table.tokens[0, :1].tolist() == [6]
    table.check_invariants()
    b.all_token_ids[:] = [8]  # shorter than its row (a Request never shrinks): copied again in full
    assert table.sync([b]) == [1] and table.tokens[1, :1].tolist() == [8] and table.lengths[1] == 1
    table.check_invariants()
    assert table.sync([]) == [] and table.lengths == [0] * table.capacity
    table.check_invariants()


def test_the_table_grows_and_refuses_what_it_cannot_hold():
    table = TokenTable(max_width=70)
    seqs = [Seq([i] * (i + 1)) for i in range(20)]  # more rows than the first 8
    rows = table.sync(seqs)
    assert sorted(rows) == list(range(20)) and table.capacity >= 20
    assert all(table.tokens[row, : i + 1].tolist() == [i] * (i + 1) for i, row in enumerate(rows))
    table.check_invariants()
    with pytest.raises(ValueError, match="twice"):
        table.sync([seqs[0], seqs[0]])
    with pytest.raises(ValueError, match="71 tokens, more than the table's max_width 70"):
        table.sync([Seq([0] * 71)])
    with pytest.raises(ValueError, match="max_width must be >= 1"):
        TokenTable(0)


def test_a_row_that_does_not_match_its_request_is_caught():
    table = TokenTable(max_width=10)
    a = Seq([1, 2, 3])
    table.sync([a])
    table.tokens[0, 1] = 5
    with pytest.raises(AssertionError, match="does not hold its request's first 3 tokens"):
        table.check_invariants()


def test_a_small_batch_is_searched_one_request_at_a_time(monkeypatch):
    """Below ``min_batch_tokens`` tokens in all, ``propose_batch`` runs the Python search per
    request (quicker than numpy's call overheads there); at or above, the batched search.
    The drafts are the same either way, and the table is kept in step both ways."""
    import tinyvllm.spec_decode.ngram_proposer as ngram

    batched = []
    monkeypatch.setattr(ngram, "batch_ngram_drafts", lambda *a: batched.append(1) or _real_batch(*a))
    seqs = [Seq([A, B, C, D, E, A, B, C]), Seq([A, B, A, B])]  # 12 tokens
    proposer = NgramProposer(3, 2, 5, max_model_len=64, min_batch_tokens=13)
    assert proposer.propose_batch(seqs) == [[D, E, A], [A, B]] and batched == []
    proposer.check_invariants()
    seqs[1].all_token_ids.append(A)  # 13 tokens
    assert proposer.propose_batch(seqs) == [[D, E, A], [B, A]] and batched == [1]
    proposer.check_invariants()


_real_batch = batch_ngram_drafts
