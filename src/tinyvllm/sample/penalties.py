# --8<-- [start:header]
"""Presence, frequency and repetition penalties: the formula, and the token counts it reads.

Concept: three per-request numbers push the logits away from (or towards) tokens the
request has already seen. For one row with presence ``p``, frequency ``f`` and
repetition ``r``, over the vocabulary:
- repetition: every token of the prompt or of the output so far has its logit divided by
  ``r`` when it is positive and multiplied by ``r`` otherwise (``r > 1`` discourages
  repeats, ``r < 1`` encourages them, 1 is off);
- frequency: every token loses ``f`` times its number of occurrences in the output;
- presence: every token that occurs in the output loses ``p`` once.
Only repetition looks at the prompt. The ranges are ``SamplingParams``' (``sampling_params.py`` NOTE 5).
``apply_penalties`` is that formula for a whole batch ``[R, V]`` from a prompt-presence
mask and output counts; ``PenaltyState`` keeps that mask and those counts for every row of
the persistent batch that uses a penalty, so that no step recounts a request's tokens.
``PenaltyRows`` is one step's work on the logits: which rows read which slot, and for a
speculative step's rows (``expand``) the drafts before each row, counted as if generated.

Mirrors: vllm/model_executor/layers/utils.py apply_penalties and vllm/v1/sample/ops/penalties.py
(``apply_all_penalties``, which turns the token lists into tensors for it). The state that
keeps the counts between steps is ours (NOTE 1).

Invariants (``PenaltyState.check_invariants``):
- ``rows`` holds exactly the batch rows whose request uses a penalty, each with its own
  slot; slots in use and free slots together are ``0 .. capacity - 1``, each once;
- a row's ``prompt_mask`` slot is the set of its prompt tokens, and its ``output_counts``
  slot is the bincount of the first ``num_counted`` tokens of its live output list, with
  ``num_counted <= len(output)``.

NOTE 1 (counts kept, not recounted): vLLM V1 pads the prompts and the output lists of
the batch into tensors and bins them over the vocabulary every step, work that grows with
the length of every sequence. Here a row's counts are built once, when its request enters
the batch (from its prompt and from its whole output so far: a request that comes back
from preemption brings its outputs), and then grow by the new tokens alone:
``count_new_tokens`` (run by ``InputBatch.refresh`` every step) adds the tokens appended
to each live output list since the last step, in one indexed add. A step that sampled
nothing for a row (a partial prefill) appends nothing and changes nothing.
NOTE 2 (slots: memory for the rows that use penalties only): a dense ``[R_max, V]`` table
would cost ``R_max * V * 5`` bytes (int32 counts and a bool mask) from the first penalised
request on: 194 MB for 256 rows of Qwen's 151,936 tokens. Instead each penalised row gets
a slot in ``[P_cap, V]`` tensors whose capacity starts at 0 and doubles when full (capped
at ``R_max``), so the memory follows the most penalised requests ever in the batch at
once, 760 KB per slot for Qwen. A row's slot never moves: ``condense`` and
``swap_states`` only change which row points at it, and a freed slot is cleared when the
next request takes it. A batch in which no request uses a penalty allocates nothing, and
its sampling metadata carries no ``PenaltyState`` at all (vLLM's ``no_penalties``): the
sampler does no penalty work.
NOTE 3 (where the sampler calls it): after the logits processors that can change the
argmax (MinTokens, LogitBias) and before the temperature, so greedy rows see the
penalties too, as in vLLM V1's ``Sampler``; before the thinking budget's forcing, so that
no penalty can undo a forced token (``sample/sampler.py``).
NOTE 4 (no wait for the device): ids and penalty values go up with ``upload`` (pinned,
``non_blocking``), and a row's output counts are built by ``index_add_`` rather than
``bincount``, whose output size depends on the largest id, so that on a GPU it reads the
ids back first (``tinyvllm/device_syncs.py``).
Left out: vLLM's Triton kernel for the penalties.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinyvllm.arith import spec_row_starts
from tinyvllm.device_syncs import upload

if TYPE_CHECKING:
    from tinyvllm.sampling_params import SamplingParams


# --8<-- [start:apply_penalties]
def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """The three penalties on a batch; returns a new tensor (the inputs are not edited).

    ``logits`` ``[R, V]`` float32; ``prompt_mask`` ``[R, V]`` bool, True where the token is
    in the row's prompt; ``output_counts`` ``[R, V]`` int, occurrences in the row's output;
    ``presence``, ``frequency``, ``repetition`` ``[R]`` float32. A row with presence 0,
    frequency 0 and repetition 1 comes back unchanged, bit for bit.
    """
    output_mask = output_counts > 0  # [R, V]
    seen = prompt_mask | output_mask  # [R, V]
    rep = repetition.unsqueeze(1)  # [R, 1]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)  # [R, V]
    logits = torch.where(seen, repeated, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts  # [R, V]
    return logits - presence.unsqueeze(1) * output_mask
# --8<-- [end:apply_penalties]


def uses_penalties(params: "SamplingParams") -> bool:
    """True when a request asks for any of the three penalties."""
    return params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1


@dataclass
class PenaltyRow:
    """One penalised row: its slot in the tensors and what its counts are built from."""

    slot: int
    presence: float
    frequency: float
    repetition: float
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # the request's LIVE output list
    num_counted: int  # outputs already in output_counts[slot]


# --8<-- [start:penalty_rows]
@dataclass(frozen=True, eq=False)
class PenaltyRows:
    """One step's penalty work, row by row: the rows of the logits to penalise ``[P]``, the
    slot each reads ``[P]``, its three values ``[P]`` each, and, for draft rows, the tokens
    each counts on top of its slot (``extra``: its index into the P rows ``[E]`` and the
    token ``[E]``; None: none). Plain and draft rows alike go through ``apply``."""

    state: PenaltyState
    rows: torch.Tensor  # [P] int64, rows of the logits
    slots: torch.Tensor  # [P] int64
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    extra: tuple[torch.Tensor, torch.Tensor] | None = None  # ([E] index into P, [E] token ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``apply_penalties`` on these rows of ``logits`` ``[N, V]``, in place."""
        counts = self.state.output_counts[self.slots]  # [P, V], a copy (a gather)
        if self.extra is not None:
            ones = torch.ones(self.extra[1].shape[0], dtype=counts.dtype, device=counts.device)
            counts.index_put_(self.extra, ones, accumulate=True)
        prompt_mask = self.state.prompt_mask[self.slots]  # [P, V]
        penalised = apply_penalties(logits[self.rows], prompt_mask, counts, self.presence, self.frequency, self.repetition)
        return logits.index_copy_(0, self.rows, penalised)
# --8<-- [end:penalty_rows]


class PenaltyState:
    """Prompt masks and output counts of the persistent batch's penalised rows (NOTE 1, 2).

    The batch calls ``add_row``, ``clear_row``, ``move_row`` and ``swap_rows`` as its rows
    change, and ``count_new_tokens`` once per step; the sampler calls ``apply`` (or, on a
    speculative step's rows, ``apply`` of what ``expand`` returns).
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.rows: dict[int, PenaltyRow] = {}  # batch row -> its entry
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)  # [P_cap, V]
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)  # [P_cap, V]
        self.free_slots: list[int] = []
        self._index: PenaltyRows | None = None  # the rows apply() penalises; None: rebuild

    @property
    def capacity(self) -> int:
        return self.output_counts.shape[0]

    # --8<-- [start:rows]
    def add_row(self, row: int, params: "SamplingParams", prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """A request that uses a penalty enters ``row``: count its prompt and whole output."""
        assert row not in self.rows, f"row {row} already has penalty state"
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        self.prompt_mask[slot] = False
        self.prompt_mask[slot].index_fill_(0, self._ids(prompt_token_ids), True)  # not [slot, ids] = True: a wait
        counts = self.output_counts[slot].zero_()  # [V]; scatter, not bincount: no wait for its size (NOTE 4)
        outputs = self._ids(output_token_ids)
        counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=counts.dtype))
        self.rows[row] = PenaltyRow(
            slot, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            prompt_token_ids, output_token_ids, len(output_token_ids),
        )  # fmt: skip
        self._index = None

    def clear_row(self, row: int) -> None:
        entry = self.rows.pop(row, None)
        if entry is not None:
            self.free_slots.append(entry.slot)  # cleared by the next add_row that takes it
            self._index = None

    def move_row(self, src: int, dst: int) -> None:
        entry = self.rows.pop(src, None)
        if entry is not None:
            self.rows[dst] = entry  # the slot stays where it is (NOTE 2)
            self._index = None

    def swap_rows(self, i1: int, i2: int) -> None:
        e1, e2 = self.rows.pop(i1, None), self.rows.pop(i2, None)
        if e1 is not None:
            self.rows[i2] = e1
        if e2 is not None:
            self.rows[i1] = e2
        self._index = None

    def count_new_tokens(self) -> None:
        """Add the tokens appended to each live output list since the last call (NOTE 1)."""
        slots: list[int] = []
        tokens: list[int] = []
        for entry in self.rows.values():
            new = entry.output_token_ids[entry.num_counted :]
            if new:
                slots.extend([entry.slot] * len(new))
                tokens.extend(new)
                entry.num_counted += len(new)
        if tokens:
            index = (self._ids(slots), self._ids(tokens))
            ones = torch.ones(len(tokens), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)
    # --8<-- [end:rows]

    # --8<-- [start:apply]
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``apply_penalties`` on the penalised rows of ``logits`` ``[R, V]``, in place."""
        if not self.rows:
            return logits
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have a vocabulary of {logits.shape[-1]}, the penalty state {self.vocab_size}")
        if self._index is None:  # rebuilt when a row comes, goes or moves
            order = sorted(self.rows)
            self._index = self._penalty_rows(order, [self.rows[row] for row in order])
        return self._index.apply(logits)
    # --8<-- [end:apply]

    # --8<-- [start:expand]
    def expand(self, drafts: Sequence[Sequence[int]]) -> PenaltyRows:
        """The penalty work of a speculative step (``SamplingMetadata.expand``): batch row r
        owns ``len(drafts[r]) + 1`` rows of the logits, and its row j sees the output so far
        plus drafts ``0 .. j - 1`` as if generated (each position is penalised for the tokens
        before it)."""
        starts = spec_row_starts(drafts)
        rows, entries, extra_rows, extra_tokens = [], [], [], []
        for row, entry in sorted(self.rows.items()):
            for j in range(len(drafts[row]) + 1):
                extra_rows.extend([len(rows)] * j)  # the drafts before position j
                extra_tokens.extend(drafts[row][:j])
                rows.append(starts[row] + j)
                entries.append(entry)
        extra = (self._ids(extra_rows), self._ids(extra_tokens)) if extra_tokens else None
        return self._penalty_rows(rows, entries, extra)
    # --8<-- [end:expand]

    def _penalty_rows(
        self, rows: Sequence[int], entries: Sequence[PenaltyRow], extra: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> PenaltyRows:
        values = upload([[e.presence, e.frequency, e.repetition] for e in entries], torch.float32, self.device)
        values = values.reshape(-1, 3)  # [P, 3], P = 0 included
        return PenaltyRows(self, self._ids(rows), self._ids([e.slot for e in entries]), *values.T, extra)

    def output_counts_of(self, row: int) -> torch.Tensor:
        """Row ``row``'s output counts ``[V]`` (a view)."""
        return self.output_counts[self.rows[row].slot]

    def prompt_mask_of(self, row: int) -> torch.Tensor:
        """Row ``row``'s prompt-presence mask ``[V]`` (a view)."""
        return self.prompt_mask[self.rows[row].slot]

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return upload(ids, torch.int64, self.device)  # NOTE 4

    def _grow(self) -> None:
        """Double the capacity (1 at first, at most ``max_num_reqs``); slots keep their data."""
        old = self.capacity
        new = min(max(1, 2 * old), self.max_num_reqs)
        assert new > old, f"no free slot, and the capacity {old} is already max_num_reqs"
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], mask[:old] = self.output_counts, self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self.free_slots.extend(range(new - 1, old - 1, -1))  # pop() takes the lowest first

    def check_invariants(self) -> None:
        slots = [entry.slot for entry in self.rows.values()]
        everything = sorted(slots + self.free_slots)
        assert everything == list(range(self.capacity)), f"slots in use {slots} + free {self.free_slots} != 0 .. {self.capacity - 1}"
        for row, entry in self.rows.items():
            counted = entry.output_token_ids[: entry.num_counted]
            assert entry.num_counted <= len(entry.output_token_ids), (
                f"row {row}: {entry.num_counted} outputs counted, but the list holds {len(entry.output_token_ids)}"
            )
            expected = torch.bincount(self._ids(counted), minlength=self.vocab_size)
            got = self.output_counts[entry.slot].to(torch.int64)
            assert torch.equal(got, expected), f"row {row} (slot {entry.slot}): counts {got.tolist()} != bincount of {counted}"
            mask = self.prompt_mask[entry.slot].nonzero().view(-1).tolist()
            assert mask == sorted(set(entry.prompt_token_ids)), f"row {row}: prompt mask {mask} != prompt {entry.prompt_token_ids}"
