# --8<-- [start:header]
"""The three built-in logits processors: MinTokens, LogitBias, MinP.

Concept: each keeps per-row state in step with the persistent batch and edits the whole
batch's logits ``[R, V]`` with one or two tensor operations.
- MinP (argmax-invariant): drop tokens whose probability is below ``min_p * max_prob``.
  Dense per-row values in a CPU buffer, mirrored to the device (double buffer) when the
  device is not the CPU; an active count lets ``apply`` return at once when no row uses it.
- LogitBias: sparse ``{row: {token: bias}}``, flattened into index tensors and added with
  one indexed add.
- MinTokens: ``{row: (min_tokens, live output list, stop ids)}``; stop tokens get -inf
  while the output is shorter than ``min_tokens``.

Seed: 001 ch. 10.1-10.3, appendices R2 and S2. Mirrors: ``vllm/v1/sample/logits_processor/builtin.py``.

Invariant (MinP, checked by ``check_invariants``): ``min_p_count`` equals the number of
rows with a non-zero min_p, and every row at or past ``batch_size`` is zero.
NOTE 1 (MinP count): every write to a row goes through ``_set_row``, which adjusts the
count by comparing the row's old and new value. The document's listing adjusts the count
case by case inside the move branch and skips rows whose values compare equal; appendix
R2 walks an update where the count ends up wrong. One write path, no case analysis.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from tinyvllm.device_syncs import upload
from tinyvllm.sample.batch_update import BatchUpdate, MoveDirectionality
from tinyvllm.sample.logits_processors.interface import LogitsProcessor
from tinyvllm.sample.logits_processors.state import process_dict_updates

if TYPE_CHECKING:
    from tinyvllm.config import EngineConfig
    from tinyvllm.sampling_params import SamplingParams


# --8<-- [start:minp]
class MinPLogitsProcessor(LogitsProcessor):
    """Min-p filtering; argmax-invariant (the most likely token always survives)."""

    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        max_num_reqs = config.scheduler_config.max_num_seqs
        self.min_p_count = 0
        self.min_p_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.float32, pin_memory=is_pin_memory)  # [R]
        self.min_p_cpu = self.min_p_cpu_tensor.numpy()  # shares memory with the tensor
        self.use_double_tensor = torch.device(device).type != "cpu"
        if self.use_double_tensor:
            self.min_p_device = torch.empty(max_num_reqs, dtype=torch.float32, device=device)  # [R]
        else:
            self.min_p_device = self.min_p_cpu_tensor
        self.min_p = self.min_p_device[:0].unsqueeze(1)  # [R, 1], the rows in use
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return True

    # --8<-- [start:minp_update]
    def _set_row(self, index: int, value: float) -> bool:
        """Write one row and keep ``min_p_count`` exact (NOTE 1). Returns True if it changed."""
        before = float(self.min_p_cpu[index])
        if before == value:
            return False
        self.min_p_count += int(value != 0) - int(before != 0)
        self.min_p_cpu[index] = value
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        changed = False
        for index in batch_update.removed:
            changed |= self._set_row(index, 0.0)
        for index, params, _, _ in batch_update.added:
            changed |= self._set_row(index, float(params.min_p))
        for a_index, b_index, direction in batch_update.moved:
            a_value, b_value = float(self.min_p_cpu[a_index]), float(self.min_p_cpu[b_index])
            changed |= self._set_row(b_index, a_value)
            a_new = b_value if direction == MoveDirectionality.SWAP else 0.0
            changed |= self._set_row(a_index, a_new)
        size = batch_update.batch_size
        if changed or self.batch_size != size:
            self.batch_size = size
            if self.use_double_tensor:
                self.min_p_device[:size].copy_(self.min_p_cpu_tensor[:size], non_blocking=True)
            self.min_p = self.min_p_device[:size].unsqueeze(1)  # [R, 1]
    # --8<-- [end:minp_update]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.min_p_count:
            return logits
        probs = torch.softmax(logits, dim=-1)  # [R, V]
        threshold = probs.amax(dim=-1, keepdim=True) * self.min_p  # [R, 1]
        logits.masked_fill_(probs < threshold, float("-inf"))
        return logits

    def check_invariants(self) -> None:
        nonzero = int(np.count_nonzero(self.min_p_cpu))
        assert self.min_p_count == nonzero, f"min_p_count {self.min_p_count} != {nonzero} non-zero rows"
        tail = int(np.count_nonzero(self.min_p_cpu[self.batch_size :]))
        assert tail == 0, f"{tail} non-zero min_p rows at or past batch_size {self.batch_size}"
# --8<-- [end:minp]


# --8<-- [start:logit_bias]
class LogitBiasLogitsProcessor(LogitsProcessor):
    """Adds per-request ``{token: bias}`` in one indexed add over the whole batch."""

    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.biases: dict[int, dict[int, float]] = {}
        self.bias_tensor = torch.zeros(0, dtype=torch.float32, device=self.device)  # [K] K = biased entries
        self.logits_slice = (self._tensor([], torch.int64), self._tensor([], torch.int64))  # rows [K], tokens [K]

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return upload(data, dtype, self.device)  # the document's _device_tensor: pinned, non_blocking

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not process_dict_updates(self.biases, batch_update, lambda params, _p, _o: params.logit_bias or None):
            return
        rows: list[int] = []
        tok_ids: list[int] = []
        values: list[float] = []
        for row, bias in self.biases.items():
            rows.extend([row] * len(bias))
            tok_ids.extend(bias.keys())
            values.extend(bias.values())
        self.bias_tensor = self._tensor(values, torch.float32)
        self.logits_slice = (self._tensor(rows, torch.int64), self._tensor(tok_ids, torch.int64))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            logits.index_put_(self.logits_slice, self.bias_tensor, accumulate=True)
        return logits
# --8<-- [end:logit_bias]


# --8<-- [start:min_tokens]
class MinTokensLogitsProcessor(LogitsProcessor):
    """Masks stop tokens (-inf) while a request's output is shorter than ``min_tokens``."""

    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        # row -> (min_tokens, the request's LIVE output list, stop token ids)
        self.min_toks: dict[int, tuple[int, Sequence[int], frozenset[int]]] = {}
        self.logits_slice = (self._tensor([], torch.int64), self._tensor([], torch.int64))
        self.neg_inf_tensor = torch.tensor(float("-inf"), dtype=torch.float32, device=self.device)

    def _tensor(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return upload(data, dtype, self.device)  # the document's _device_tensor: pinned, non_blocking

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def add_request(
        params: "SamplingParams", _prompt_tok_ids: "list[int] | None", output_tok_ids: list[int]
    ) -> tuple[int, Sequence[int], frozenset[int]] | None:
        """The entry of a request that needs masking, or None."""
        if params.min_tokens and len(output_tok_ids) < params.min_tokens and params.stop_token_ids:
            return params.min_tokens, output_tok_ids, frozenset(params.stop_token_ids)
        return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        needs_update = process_dict_updates(self.min_toks, batch_update, self.add_request)
        # The output lists are live: a request that reached min_tokens drops out.
        done = [row for row, (min_tok, out, _) in self.min_toks.items() if len(out) >= min_tok]
        for row in done:
            del self.min_toks[row]
        if not (needs_update or done):
            return
        rows: list[int] = []
        tok_ids: list[int] = []
        for row, (_, _, stop_ids) in self.min_toks.items():
            rows.extend([row] * len(stop_ids))
            tok_ids.extend(sorted(stop_ids))
        self.logits_slice = (self._tensor(rows, torch.int64), self._tensor(tok_ids, torch.int64))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_toks:
            logits.index_put_(self.logits_slice, self.neg_inf_tensor)
        return logits

    # --8<-- [start:min_tokens_spec]
    def apply_with_spec_decode(self, logits: torch.Tensor, num_draft_tokens: list[int]) -> torch.Tensor:
        """Mask stop tokens in the first draft rows that still fall short of ``min_tokens``.

        ``logits`` is ``[N, V]`` with ``num_draft_tokens[r]`` rows per request ``r``, back to
        back: with ``[2, 3, 1]`` request 0 owns rows 0-1, request 1 rows 2-4, request 2 row 5.
        Draft position ``j`` of a request with ``n`` outputs would be output ``n + j``, so the
        first ``min_tokens - n`` positions are masked.
        """
        if not self.min_toks:
            return logits
        drafts = np.asarray(num_draft_tokens, dtype=np.int64)  # [R]
        starts = np.concatenate([[0], np.cumsum(drafts)])  # [R + 1]
        rows: list[np.ndarray] = []
        toks: list[np.ndarray] = []
        for row, (min_tok, out, stop_ids) in self.min_toks.items():
            n_mask = int(min(max(min_tok - len(out), 0), drafts[row]))
            if n_mask == 0:
                continue
            stop = np.array(sorted(stop_ids), dtype=np.int64)
            positions = np.arange(starts[row], starts[row] + n_mask, dtype=np.int64)
            rows.append(np.repeat(positions, len(stop)))
            toks.append(np.tile(stop, n_mask))
        if rows:
            # pinned and non_blocking, as the document's (a plain .to() would wait for the device)
            index = self._tensor(np.stack([np.concatenate(rows), np.concatenate(toks)]), torch.int64).unbind(0)
            logits.index_put_(index, self.neg_inf_tensor)
        return logits
    # --8<-- [end:min_tokens_spec]
# --8<-- [end:min_tokens]


BUILTIN_LOGITS_PROCESSORS: list[type[LogitsProcessor]] = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
]
