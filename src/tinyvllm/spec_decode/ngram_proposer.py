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
Left out: vLLM's numba batch over requests and its search window.
"""

from __future__ import annotations

from collections.abc import Sequence


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


class NgramProposer:
    """Proposes drafts for each running request from its own tokens (see the module header)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """Drafts for one request whose tokens (prompt and output) are ``token_ids``: never
        more than fit before ``max_model_len``."""
        room = self.max_model_len - len(token_ids)
        return find_ngram_drafts(token_ids, self.min_n, self.max_n, min(self.k, room))
