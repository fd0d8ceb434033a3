"""N-gram prompt lookup: drafts copied from the request's own earlier tokens.

Concept: text often repeats itself (code edits a function it just quoted, a list repeats
its pattern). If the last few tokens of a request occurred earlier in its prompt or
output, the tokens that followed them there are a good guess for what comes next. The
proposer finds the longest suffix of the sequence, between ``prompt_lookup_min`` and
``prompt_lookup_max`` tokens long, that occurred before, takes its earliest occurrence, and
proposes the (up to ``k``) tokens that followed it as drafts. No model runs: the target
model checks the drafts in its next step (``sample/rejection_sampler.py``).

Worked example (min 2, max 5, k 3): ``tokens = [A B C D E A B C]``. The suffixes
``B C`` and ``A B C`` occurred before, at position 0 (``A B C`` is the longest, 3 tokens;
``B C A B C`` and longer did not). What followed that occurrence is ``D E A``: the drafts.

Mirrors: ``vllm/v1/spec_decode/ngram_proposer.py`` (``NgramProposer``,
``_find_longest_matched_ngram_and_propose_tokens``): the same rule (the longest match, then
its earliest occurrence) and the same linear-time search (NOTE 1).

Invariants: the drafts are a contiguous run of the sequence's own tokens that starts right
after an earlier occurrence of its suffix; there are at most ``k`` of them, none past the
end of the sequence, and none past ``max_model_len``.

NOTE 1 (linear time): reading the sequence backwards turns "a suffix that occurred before"
into "a prefix of the reversed sequence that occurs again later in it", which is what the
prefix function of Knuth-Morris-Pratt computes in one pass: ``match`` is the length of the
longest prefix of the reversed sequence that ends at position ``i``. Matches are capped at
``max_n`` (a longer one falls back to the longest shorter border, ``lps[max_n - 1]``), so the
table needs only ``max_n`` entries. The last position with the longest match is, read
forwards again, its earliest occurrence.
NOTE 2 (a whole batch at once): ``find_ngram_drafts`` is the rule, one request at a time,
in Python: about 25 ns per token, so 58 us a step for a request of 2,048 tokens, 15 ms a
step for 256 of them, more than the rest of the engine's bookkeeping. ``propose_batch``
instead searches every decoding request together with numpy, over the requests' tokens
kept in a ``TokenTable`` (``token_table.py``): one vectorised compare of each row (over its
own length, not the longest row's) with its last token finds where a match can end; the
(few) candidates of all rows are then extended backwards together, one token at a time
up to ``max_n``; per row the longest match wins, then the earliest. Same result as
``find_ngram_drafts`` (a Hypothesis test compares them), 10x faster at 256 requests of
2,048 tokens and 1.8x at 8 of 512 (``bench/ngram_proposer.py``). The numpy calls cost
about 20 us a step whatever the batch, which the Python search beats below about 1,000
tokens in all (4 us for one request of 128), so a batch of fewer than
``MIN_BATCH_TOKENS`` tokens is searched one request at a time, with the same result.
vLLM runs the KMP search compiled with numba, over its batch's token matrix, in threads.
Left out: vLLM's search window.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinyvllm.spec_decode.token_table import HasTokens, TokenTable

_NONE = np.zeros(0, dtype=np.int64)  # a row with no candidates
MIN_BATCH_TOKENS = 1024  # NOTE 2: below this many tokens in all, the one-request search is quicker


# --8<-- [start:find]
def find_ngram_drafts(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest occurrence of the longest suffix of
    ``tokens`` (``min_n`` to ``max_n`` tokens long) that occurred before; [] when none did."""
    total = len(tokens)
    if total < min_n or k <= 0:
        return []
    rev = tokens[::-1]  # rev[j] = tokens[total - 1 - j]
    lps = [0] * max_n  # lps[i]: the longest proper border of rev[: i + 1] (NOTE 1)
    longest, at = 0, 0
    match, i = 0, 1
    while i < total:
        if rev[match] == rev[i]:
            match += 1
            if match >= longest:  # ">=": the last such position is the earliest occurrence
                longest, at = match, i
            if i < max_n:
                lps[i] = match
            if match == max_n:  # never longer than max_n: fall back to a shorter border
                match = lps[max_n - 1]
            i += 1
        elif match:
            match = lps[match - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - at + longest  # the token right after the occurrence, read forwards
    return list(tokens[start : start + min(k, total - start)])
# --8<-- [end:find]


# --8<-- [start:batch]
def batch_ngram_drafts(
    tokens: np.ndarray, lengths: np.ndarray, min_n: int, max_n: int, ks: np.ndarray
) -> list[list[int]]:
    """``find_ngram_drafts`` for every row at once (NOTE 2): row ``r``'s sequence is
    ``tokens[r, :lengths[r]]`` (``tokens`` ``[R, W]``, ``lengths`` and ``ks`` ``[R]``);
    returns up to ``ks[r]`` drafts per row (``[]`` for a row of length 0)."""
    num_rows = len(lengths)
    drafts: list[list[int]] = [[] for _ in range(num_rows)]
    # Candidates: an earlier position holding the row's last token, where a match may end.
    # One compare per row, over its own length (a padded [R, W] compare would cost R times
    # the longest row: one long request among many short ones).
    found = [
        (tokens[row, : n - 1] == tokens[row, n - 1]).nonzero()[0] if n > min_n and k > 0 else _NONE
        for row, (n, k) in enumerate(zip(lengths.tolist(), ks.tolist()))
    ]
    ends = np.concatenate([_NONE, *found])  # [C]
    if not ends.size:
        return drafts
    rows = np.repeat(np.arange(num_rows), [len(f) for f in found])  # [C], sorted
    last = lengths[rows] - 1  # [C]: where each candidate's row ends
    length = np.ones(len(rows), dtype=np.int64)  # [C]: how far each match reaches back (capped at max_n)
    live = np.arange(len(rows))  # the candidates still matching
    for t in range(1, max_n):
        live = live[ends[live] >= t]
        live = live[tokens[rows[live], ends[live] - t] == tokens[rows[live], last[live] - t]]
        if not live.size:
            break
        length[live] += 1
    keep = length >= min_n
    rows, ends, length = rows[keep], ends[keep], length[keep]
    if not rows.size:
        return drafts
    # Per row: the longest match, then the earliest.
    width = int(lengths.max())
    score = length * (width + 1) + (width - ends)  # [C]: larger is better, and it encodes both
    new_row = np.ones(len(rows), dtype=bool)
    np.not_equal(rows[1:], rows[:-1], out=new_row[1:])
    firsts = np.flatnonzero(new_row)  # where each row's candidates begin
    best = np.maximum.reduceat(score, firsts)
    for row, end in zip(rows[firsts].tolist(), (width - best % (width + 1)).tolist()):
        start = end + 1  # the token after the occurrence
        count = min(int(ks[row]), int(lengths[row]) - start)
        if count > 0:
            drafts[row] = tokens[row, start : start + count].tolist()
    return drafts
# --8<-- [end:batch]


class NgramProposer:
    """Proposes drafts for each running request from its own tokens (see the module header)."""

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int,
        min_batch_tokens: int = MIN_BATCH_TOKENS,
    ) -> None:  # fmt: skip
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len
        self.table = TokenTable(max_model_len)  # the decoding requests' tokens, kept between steps (NOTE 2)
        self.min_batch_tokens = min_batch_tokens  # fewer tokens in all: one request at a time (NOTE 2)

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Drafts for one request whose tokens (prompt and output) are ``token_ids``: never
        more than fit before ``max_model_len``."""
        room = self.max_model_len - len(token_ids)
        return find_ngram_drafts(token_ids, self.min_n, self.max_n, min(self.k, room))

    # --8<-- [start:propose_batch]
    def propose_batch(self, requests: Sequence[HasTokens]) -> list[list[int]]:
        """Drafts for each of ``requests`` (every request that decodes next), as ``propose``
        gives them one by one, searched together (NOTE 2)."""
        rows = self.table.sync(requests)
        if sum(self.table.lengths[row] for row in rows) < self.min_batch_tokens:  # a small batch: Python is quicker
            return [self.propose(request.token_slice(0, request.num_tokens)) for request in requests]
        used = max(rows, default=-1) + 1  # rows go lowest first: the search stops at the last held
        lengths = np.asarray(self.table.lengths[:used], dtype=np.int64)  # [used]; 0 for a free row
        ks = np.minimum(self.max_model_len - lengths, self.k)  # [used]: never past max_model_len
        drafts = batch_ngram_drafts(self.table.tokens, lengths, self.min_n, self.max_n, ks)
        return [drafts[row] for row in rows]
    # --8<-- [end:propose_batch]

    def check_invariants(self) -> None:
        self.table.check_invariants()
