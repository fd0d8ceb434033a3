"""TokenTable: every decoding request's tokens in one row of an int32 matrix, kept by appending.

Concept: the n-gram proposer searches each decoding request's whole sequence every step.
Searching a whole batch at once (``ngram_proposer.batch_ngram_drafts``) needs the
sequences as one matrix, ``[rows, width]``; building it from the requests' Python lists
every step would copy every token of every request every step, which costs as much as
the search it is meant to speed up. So the table keeps the matrix between steps: each
request keeps its row, and a step copies only the tokens appended since the last one
(one to ``1 + k`` a decode step). Requests that are not given in a step (finished,
aborted, preempted, or back in a prefill) give their rows back; a request that comes
back is copied in full once.

Mirrors: the token matrix of vLLM's persistent input batch (``token_ids_cpu`` in
``vllm/v1/worker/gpu_input_batch.py``, ``[max_num_reqs, max_model_len]``), which vLLM's
n-gram proposer reads. Here it belongs to the proposer alone and grows as needed
(rows and width double, the width capped at ``max_model_len``) rather than being
allocated at its largest.

Invariants (``check_invariants``):
- every row is either held by one request or free, never both; rows in use and free
  rows together are ``0 .. capacity - 1``, each once;
- a free row has length 0; a held row's first ``length`` tokens are the first ``length``
  of its request's tokens, and ``length <= width <= max_width``.

NOTE 1 (keyed by the request object): rows are looked up by the ``Request`` object, not
its id, so an id that comes back for a new request (an id reused after the first
finished) never inherits the old request's row. A request's token list only grows
(``Request.all_token_ids``); a list found shorter than its row is copied again in full.
NOTE 2 (a slice, not the list): the table asks a request for ``num_tokens`` and the slice it
lacks, so a request that keeps its prompt and its outputs apart (the runner's
``RunnerRequestState``, whose drafts are proposed there under async scheduling) is never joined
into one list a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class HasTokens(Protocol):
    """What the table reads of a request whose tokens only grow: how many it has, and a slice
    of them (the engine's ``Request``, or the runner's copy of one: NOTE 2)."""

    @property
    def num_tokens(self) -> int: ...  # fmt: skip

    def token_slice(self, start: int, end: int) -> list[int]: ...  # fmt: skip


class TokenTable:
    """Rows of requests' tokens, synced each step with ``sync`` (see the module header)."""

    def __init__(self, max_width: int) -> None:
        if max_width < 1:
            raise ValueError(f"max_width must be >= 1, got {max_width}")
        self.max_width = max_width
        self.tokens = np.zeros((0, 0), dtype=np.int32)  # [capacity, width]
        self.lengths: list[int] = []  # row -> tokens held (0 for a free row)
        self._rows: dict[HasTokens, int] = {}  # request -> its row (NOTE 1)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.tokens.shape[0]

    # --8<-- [start:sync]
    def sync(self, requests: Sequence[HasTokens]) -> list[int]:
        """Hold exactly ``requests``, each row up to date; return their rows, in order."""
        given = set(requests)
        if len(given) != len(requests):
            raise ValueError(f"sync was given {len(requests) - len(given)} request(s) twice")
        for request in [r for r in self._rows if r not in given]:  # not given this step: the row goes back
            row = self._rows.pop(request)
            self.lengths[row] = 0
            self._free.append(row)
        rows = []
        for request in requests:
            num_tokens = request.num_tokens
            row = self._rows.get(request)
            if row is None:
                row = self._take_row()
            held = self.lengths[row]
            if num_tokens < held:  # cannot happen to a Request (NOTE 1): copy it all again
                held = 0
            if num_tokens > held:
                self._ensure_width(num_tokens)
                self.tokens[row, held:num_tokens] = request.token_slice(held, num_tokens)  # the new tokens only (NOTE 2)
            self.lengths[row] = num_tokens
            self._rows[request] = row
            rows.append(row)
        return rows
    # --8<-- [end:sync]

    def _take_row(self) -> int:
        if not self._free:  # double the rows (at least 8)
            old = self.capacity
            grown = max(8, 2 * old)
            self.tokens = np.concatenate([self.tokens, np.zeros((grown - old, self.tokens.shape[1]), np.int32)])
            self.lengths += [0] * (grown - old)
            self._free = list(range(grown - 1, old - 1, -1))  # the lowest row first
        row = self._free.pop()
        self.lengths[row] = 0
        return row

    def _ensure_width(self, width: int) -> None:
        if width > self.max_width:
            raise ValueError(f"a request has {width} tokens, more than the table's max_width {self.max_width}")
        if width <= self.tokens.shape[1]:
            return
        grown = min(self.max_width, max(width, 2 * self.tokens.shape[1], 64))
        wider = np.zeros((self.capacity, grown), np.int32)
        wider[:, : self.tokens.shape[1]] = self.tokens
        self.tokens = wider

    def check_invariants(self) -> None:
        held = sorted(self._rows.values())
        assert len(held) == len(set(held)), f"two requests share a row: {held}"
        assert sorted(held + self._free) == list(range(self.capacity)), (
            f"rows held {held} and free {sorted(self._free)} are not 0..{self.capacity - 1}, each once"
        )
        assert len(self.lengths) == self.capacity
        assert self.tokens.shape[1] <= self.max_width
        for row in self._free:
            assert self.lengths[row] == 0, f"free row {row} holds {self.lengths[row]} tokens"
        for request, row in self._rows.items():
            n = self.lengths[row]
            assert n <= self.tokens.shape[1], f"row {row} holds {n} tokens, wider than the table"
            assert self.tokens[row, :n].tolist() == request.token_slice(0, n), (
                f"row {row} does not hold its request's first {n} tokens"
            )
