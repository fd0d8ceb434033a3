# --8<-- [start:header]
"""The thinking-token budget: end a request's think section after B tokens.

Concept: reasoning models think between a start sequence (``<think>``) and an end
sequence (``</think>``). A request with ``thinking_token_budget = B`` thinks for exactly
B tokens after its start sequence; then the whole end sequence is forced, one token per
step (the forced token's logit is set to 1e9); then generation is free again (a later
start sequence opens a new section with a fresh budget). ``ThinkingBudgetStateHolder``
keeps one state dict per tracked row (appendix O.1's fields), follows the persistent
batch (``sync_batch``), re-reads the outputs every step (``update_state``) and writes the
forced tokens into the logits (``apply_to_logits``).

Seed: 001 ch. 13, appendices D, O, T2. Mirrors: ``vllm/v1/sample/thinking_budget_state.py``
(newer vLLM; the document's line numbers follow it).

State machine (per request; ``_advance`` consumes one confirmed token):
- idle (in_think=F, in_end=F): the start sequence completes -> thinking, think_count 0;
- thinking (in_think=T): a token counts (think_count += 1); think_count reaching the
  budget -> forcing (in_end=T, end_count 0). The model closing the section itself
  (its own end sequence) -> idle;
- forcing (in_end=T): the token must be end[end_count] -> end_count += 1; the last one
  -> idle with the budget restored.
With speculative decoding the switch to forcing is predicted: a thinking request with
``remaining = budget - think_count <= spec_len`` forces at draft row ``force_index``
(``compute_force_index``, appendix O.3) while its confirmed count is still below budget.

NOTE 1: the document's ``_update_think_state`` is a "simplified version" (its variables
are partly undefined). We keep its fields and its three force_index cases and replace
the position bookkeeping by the token-by-token machine above: rejected drafts simply
never reach ``_advance``, so a forced token that was rolled back is forced again.
NOTE 2: ``sync_batch`` pops both rows of every move before writing. For a SWAP the
listing writes ``state1`` to i2 and leaves it at i1 when i2 was empty. For a one-way move
the listing pops only i1, so a destination that still holds a departed request's state
keeps it under the moved request. Our ``condense`` lists that destination in ``removed``;
vLLM's pops it from ``removed``, so there only the move can drop that state.
NOTE 3: the document's forcing fills ``mask`` and ``force_token_ids`` on the device and
indexes the logits with ``mask.nonzero()``, whose size a GPU must report back first: a
wait for the whole forward in every step where a request thinks. We keep both tensors up
to date as the document does but index with the rows collected on the host, copied up
with ``upload`` (``tinyvllm/device_syncs.py``), and write them with ``index_fill_``,
``index_copy_`` and ``fill_at``: the document's ``mask[row] = True`` and
``force_token_ids[row] = token`` copy each number up and wait (seen on an H100).
NOTE 4 (one layout for the sampler): under speculation the document forces in two calls, a
target call over the draft rows and a bonus call over one row per request
(``apply_to_logits`` with ``predict_bonus_token``, kept with its tests). tinyvllm samples a
step's rows in one call, each request's draft rows then its bonus row
(``SamplingMetadata.expand``), so the sampler calls ``apply_to_rows`` with that layout; a
plain step is one row per request, where ``force_index`` is always 0.
Left out: ``bonus_token_forced`` bookkeeping of the two-call spec path (kept as a field).
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from tinyvllm.device_syncs import fill_at, upload
from tinyvllm.sample.batch_update import BatchUpdate, MoveDirectionality

if TYPE_CHECKING:
    from tinyvllm.config import ReasoningConfig

FORCED_LOGIT = 1e9  # large enough to win every softmax, finite so softmax never sees inf - inf


# --8<-- [start:pure]
def compute_force_index(budget: int, think_count: int, spec_len: int) -> list[int]:
    """The draft row where the end sequence must start (appendix O.3).

    Row ``j`` predicts thinking token ``think_count + j + 1``; it must be forced once that
    exceeds the budget, i.e. from ``j = budget - think_count`` on.
    """
    remaining = budget - think_count
    if remaining <= 0:
        return [0]
    if remaining < spec_len:
        return [remaining]
    return [spec_len]


def ends_with_sequence(prompt: Sequence[int] | None, output: Sequence[int], pos: int, seq: Sequence[int]) -> bool:
    """True when ``seq`` ends at ``output[pos]``, reaching back into the prompt if needed."""
    n = len(seq)
    if n == 0:
        return False
    start = pos - n + 1
    if start >= 0:
        return list(output[start : pos + 1]) == list(seq)
    prompt = prompt or []
    if len(prompt) < -start:
        return False
    return list(prompt[len(prompt) + start :]) + list(output[: pos + 1]) == list(seq)


def token_row_offsets(n_layout: int, spec_lists: Sequence[Sequence[int]], in_spec_mode: bool, predict_bonus_token: bool) -> dict[int, int]:
    """Row offset of each request in the flattened logits (appendix T2's ``cu_num_tokens``).

    Without speculation every request has one row. With it, the target call has one row
    per draft token, the bonus call one row per request.
    """
    offsets: dict[int, int] = {}
    total = 0
    for index in range(n_layout):
        offsets[index] = total
        if in_spec_mode and not predict_bonus_token:
            total += len(spec_lists[index]) if index < len(spec_lists) else 0
        else:
            total += 1
    return offsets
# --8<-- [end:pure]


# --8<-- [start:factory]
def maybe_create_thinking_budget_state_holder(
    reasoning_config: "ReasoningConfig | None",
    max_num_seqs: int,
    num_spec_tokens: int,
    device: torch.device,
    is_pin_memory: bool,
) -> "ThinkingBudgetStateHolder | None":
    """A holder when the model reasons (a ReasoningConfig exists), else None."""
    if reasoning_config is None:
        return None
    return ThinkingBudgetStateHolder(reasoning_config, max_num_seqs, num_spec_tokens, device, is_pin_memory)
# --8<-- [end:factory]


class ThinkingBudgetStateHolder:
    """Per-row thinking-budget state; forces the end sequence when a budget runs out."""

    def __init__(
        self,
        reasoning_config: "ReasoningConfig | None",
        max_num_seqs: int,
        num_spec_tokens: int,
        device: torch.device,
        is_pin_memory: bool,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.num_spec_tokens = num_spec_tokens
        self.in_spec_mode = num_spec_tokens > 0
        self.is_enabled = reasoning_config is not None
        self.think_start_token_ids: list[int] = list(reasoning_config.reasoning_start_token_ids) if reasoning_config else []
        self.think_end_token_ids: list[int] = list(reasoning_config.reasoning_end_token_ids) if reasoning_config else []
        self.device = torch.device(device)
        self._state: dict[int, dict[str, Any]] = {}  # row -> appendix O.1's fields
        self.cu_num_tokens: dict[int, int] = {}
        total = max_num_seqs * (num_spec_tokens + 1)  # N rows at most
        self.mask = torch.zeros(total, dtype=torch.bool, device=self.device)  # [N]
        self.force_token_ids = torch.full((total,), -1, dtype=torch.long, device=self.device)  # [N]

    def has_tracked_requests(self) -> bool:
        return bool(self._state)

    # --8<-- [start:sync]
    def sync_batch(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch: removed -> added -> moved (no token is read here)."""
        if not self.is_enabled or not batch_update:
            return
        for index in batch_update.removed:
            self._state.pop(index, None)
        for index, params, prompt_tok_ids, output_tok_ids in batch_update.added:
            budget = params.thinking_token_budget
            if budget is None:
                self._state.pop(index, None)
                continue
            state = self._init_state_entry(prompt_tok_ids, budget)
            state["output_tok_ids"] = output_tok_ids  # the live list
            self._state[index] = state
        for i1, i2, direction in batch_update.moved:
            state1, state2 = self._state.pop(i1, None), self._state.pop(i2, None)  # NOTE 2
            if state1 is not None:
                self._state[i2] = state1
            if state2 is not None and direction == MoveDirectionality.SWAP:
                self._state[i1] = state2
    # --8<-- [end:sync]

    # --8<-- [start:update_state]
    def update_state(
        self,
        output_token_ids: Sequence[list[int]],
        spec_token_ids: Sequence[Sequence[int]] | None = None,
        repeat_indices: torch.Tensor | None = None,
    ) -> None:
        """Re-read every tracked row's outputs (and drafts) and advance its state machine.

        ``output_token_ids[r]`` is row r's output list; with speculation it ends with the
        row's draft tokens, which are stripped. ``repeat_indices`` (spec mode) maps flattened
        rows to requests: a request's outputs are then its last row's.
        """
        if not self.is_enabled or not self._state:
            return
        spec_lists = spec_token_ids or []
        last_row: dict[int, int] | None = None
        if repeat_indices is not None:
            last_row = {req: row for row, req in enumerate(repeat_indices.cpu().tolist())}
        for index, state in self._state.items():
            row = index if last_row is None else last_row.get(index)
            if row is None or row >= len(output_token_ids):
                continue
            outputs = output_token_ids[row]
            drafts = list(spec_lists[index]) if index < len(spec_lists) else []
            state["spec_token_ids"] = drafts
            state["in_spec_mode"] = self.in_spec_mode
            state["output_tok_ids"] = outputs[: len(outputs) - len(drafts)] if drafts else outputs
            self._update_think_state(state)
    # --8<-- [end:update_state]

    # --8<-- [start:init_state]
    def _init_state_entry(self, prompt_tok_ids: list[int] | None, thinking_token_budget: int) -> dict[str, Any]:
        """A new request's state; a prompt that ends inside a think section counts against the budget."""
        in_think, think_count, start_thinking = False, 0, -1
        if prompt_tok_ids:
            last_start = self._find_last_sequence_index(prompt_tok_ids, self.think_start_token_ids)
            last_end = self._find_last_sequence_index(prompt_tok_ids, self.think_end_token_ids)
            in_think = last_start > last_end
            if in_think:
                think_count = len(prompt_tok_ids) - (last_start + len(self.think_start_token_ids))
                start_thinking = last_start - len(prompt_tok_ids)  # negative: inside the prompt
        in_end = in_think and think_count >= thinking_token_budget
        return {
            "in_think": in_think and not in_end,
            "in_end": in_end,
            "check_count_down": thinking_token_budget - think_count,
            "think_count": think_count,
            "end_count": 0,
            "prompt_tok_ids": prompt_tok_ids,
            "output_tok_ids": [],
            "thinking_token_budget": thinking_token_budget,
            "prev_output_length": 0,
            "spec_token_ids": [],
            "force_index": [0] if in_end else [],
            "start_thinking": start_thinking,
            "end_thinking": -1,
            "in_spec_mode": self.in_spec_mode,
            "bonus_token_forced": False,
            "continue_thinking": in_think,
        }
    # --8<-- [end:init_state]

    # --8<-- [start:machine]
    def _update_think_state(self, state: dict[str, Any]) -> None:
        """Consume the tokens confirmed since the last call, then plan this step's forcing."""
        if state["thinking_token_budget"] == -1:
            return
        if not self.think_end_token_ids:  # nothing could be forced: stop tracking
            state.update(thinking_token_budget=-1, in_end=False, force_index=[])
            return
        outputs = state["output_tok_ids"]
        assert len(outputs) >= state["prev_output_length"], (
            f"confirmed outputs shrank from {state['prev_output_length']} to {len(outputs)}"
        )
        for pos in range(state["prev_output_length"], len(outputs)):
            self._advance(state, outputs, pos)
        state["prev_output_length"] = len(outputs)
        self._plan_forcing(state, len(state["spec_token_ids"]) if self.in_spec_mode else 0)

    def _advance(self, state: dict[str, Any], outputs: list[int], pos: int) -> None:
        """One confirmed token through the state machine of the module header."""
        budget, end = state["thinking_token_budget"], self.think_end_token_ids
        if state["in_end"] and state["think_count"] >= budget:  # forcing
            if outputs[pos] == end[state["end_count"]]:
                state["end_count"] += 1
                if state["end_count"] == len(end):
                    self._close(state, pos - len(end) + 1)
            else:  # the forced token was rolled back: force the sequence again
                state["end_count"] = int(outputs[pos] == end[0])
            return
        if state["in_think"] or state["in_end"]:  # thinking
            if ends_with_sequence(state["prompt_tok_ids"], outputs, pos, end):
                self._close(state, pos - len(end) + 1)  # the model ended the section itself
                return
            state["think_count"] += 1
            if state["think_count"] >= budget:
                state.update(in_think=False, in_end=True, end_count=0)
            return
        if ends_with_sequence(state["prompt_tok_ids"], outputs, pos, self.think_start_token_ids):
            state.update(in_think=True, think_count=0, start_thinking=pos - len(self.think_start_token_ids) + 1)
            if budget == 0:
                state.update(in_think=False, in_end=True, end_count=0)

    @staticmethod
    def _close(state: dict[str, Any], end_pos: int) -> None:
        budget = state["thinking_token_budget"]
        state.update(in_think=False, in_end=False, end_count=0, think_count=0, check_count_down=budget,
                     end_thinking=end_pos, continue_thinking=False)

    @staticmethod
    def _plan_forcing(state: dict[str, Any], spec_len: int) -> None:
        """Set ``force_index`` for this step (and predict the switch to forcing with drafts)."""
        budget, think_count = state["thinking_token_budget"], state["think_count"]
        state["force_index"] = []
        if state["in_end"] and think_count >= budget:
            state["force_index"] = [0]
        elif state["in_think"] or state["in_end"]:
            if budget - think_count <= spec_len:
                state.update(in_think=False, in_end=True, end_count=0,
                             force_index=compute_force_index(budget, think_count, spec_len))
            else:
                state.update(in_think=True, in_end=False)
        thinking = state["in_think"] or state["in_end"]
        state["check_count_down"] = budget - think_count if thinking else budget
    # --8<-- [end:machine]

    # --8<-- [start:rows]
    def apply_to_rows(self, logits: torch.Tensor, rows_per_request: Sequence[int] | None = None) -> torch.Tensor:
        """What the sampler calls (NOTE 4): request r owns ``rows_per_request[r]`` rows of
        ``logits``, back to back (None: one each); with drafts, its drafts' rows, then the
        bonus row. A forcing request's pending end token is forced at its row ``force_index``:
        a draft row, or the bonus row when the budget runs out after every draft (appendix O.3)."""
        if not self.is_enabled or not self._state:
            return logits
        counts = rows_per_request if rows_per_request is not None else [1] * logits.shape[0]
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        forced: list[tuple[int, int]] = []  # (row, end token) of each forced row
        for seq_idx in sorted(self._state):
            state = self._state[seq_idx]
            if seq_idx >= len(counts) or not state["in_end"] or not state["force_index"]:
                continue
            force_idx = state["force_index"][0]
            row = offsets[seq_idx] + force_idx
            if force_idx < counts[seq_idx] and row < self.mask.shape[0]:
                forced.append((row, self.think_end_token_ids[state["end_count"]]))
        return self._force(logits, forced)
    # --8<-- [end:rows]

    def apply_to_logits(
        self,
        logits: torch.Tensor,
        predict_bonus_token: bool = False,
        spec_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Force the pending end token of every row that is in the forcing state."""
        if not self.is_enabled or not self._state:
            return logits
        return self._apply_forcing_to_logits(logits, predict_bonus_token, spec_token_ids or [])

    # --8<-- [start:forcing]
    def _apply_forcing_to_logits(
        self, logits: torch.Tensor, predict_bonus_token: bool, spec_token_ids_for_layout: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Write ``FORCED_LOGIT`` at ``[row, end[end_count]]`` of every forcing request.

        ``logits`` is ``[N, V]``: one row per request, or, with speculation, one row per
        draft (target call) or per request (bonus call, ``predict_bonus_token``).
        """
        forced: list[tuple[int, int]] = []  # (row, end token) of each forced row
        n_layout = max(len(spec_token_ids_for_layout), max(self._state) + 1)
        self.cu_num_tokens = token_row_offsets(n_layout, spec_token_ids_for_layout, self.in_spec_mode, predict_bonus_token)
        for seq_idx in sorted(self._state):
            state = self._state[seq_idx]
            if not state["in_end"] or not state["force_index"]:
                continue
            force_idx = state["force_index"][0]
            if self.in_spec_mode:
                num_drafts = len(state["spec_token_ids"])
                if predict_bonus_token != (force_idx >= num_drafts):
                    continue  # a draft row is forced in the target call, the bonus row in the bonus call
                row = self.cu_num_tokens[seq_idx] + (0 if predict_bonus_token else force_idx)
            else:
                row = self.cu_num_tokens[seq_idx]
            if row < logits.shape[0] and row < self.mask.shape[0]:
                forced.append((row, self.think_end_token_ids[state["end_count"]]))
        return self._force(logits, forced)
    # --8<-- [end:forcing]

    def _force(self, logits: torch.Tensor, forced: list[tuple[int, int]]) -> torch.Tensor:
        """Write ``FORCED_LOGIT`` at each ``(row, token)`` of ``logits``, and keep ``mask`` and
        ``force_token_ids`` saying which rows were forced to what, as the document does."""
        self.mask[:] = False
        if forced:  # the rows from the host list, not mask.nonzero(): no wait for the device (NOTE 3)
            rows, tokens = upload(forced, torch.int64, logits.device).unbind(1)  # [M], [M]
            self.mask.index_fill_(0, rows, True)  # not mask[row] = True, a wait each (NOTE 3)
            self.force_token_ids.index_copy_(0, rows, tokens)
            fill_at(logits, (rows, tokens), FORCED_LOGIT)
        return logits

    @staticmethod
    def _find_last_sequence_index(target_list: Sequence[int], token_ids: Sequence[int]) -> int:
        """Start of the last occurrence of ``token_ids`` in ``target_list``, or -1."""
        n = len(token_ids)
        if n == 0:
            return -1
        target, seq = list(target_list), list(token_ids)
        for i in range(len(target) - n, -1, -1):
            if target[i : i + n] == seq:
                return i
        return -1

    def check_invariants(self) -> None:
        for index, state in self._state.items():
            assert 0 <= index < self.max_num_seqs, f"tracked row {index} outside [0, {self.max_num_seqs})"
            assert not (state["in_think"] and state["in_end"]), f"row {index} both thinking and forcing: {state}"
            assert 0 <= state["end_count"] < max(len(self.think_end_token_ids), 1), f"row {index} end_count {state['end_count']}"
            assert state["think_count"] >= 0, f"row {index} think_count {state['think_count']}"
