# --8<-- [start:header]
"""AdapterLogitsProcessor: run per-request (V0-style) callables as one batch processor.

Concept: a per-request processor is a plain callable that edits one row of logits
``[V]`` given the request's token history: ``f(output_ids, logits)`` or
``f(prompt_ids, output_ids, logits)``. A subclass says which callable (if any) a request
gets (``new_req_logits_processor``); the adapter finds the arity with
``inspect.signature``, binds the history with ``functools.partial`` (the output list is
the request's LIVE list, so the partial always sees the newest tokens), keeps the
partials per row with ``process_dict_updates``, and applies them row by row.

Seed: 001 ch. 12, appendix P. Mirrors: ``vllm/v1/sample/logits_processor/__init__.py``
(``AdapterLogitsProcessor`` is defined there, beside ``build_logitsprocs``).

NOTE 1: a callable may edit the row in place (it is a view of the batch's logits) or
return a new tensor; in the second case the adapter writes it back.
NOTE 2: row-by-row costs one call per request using it; acceptable because such
processors are rare and cannot be batched (each may do anything).
"""
# --8<-- [end:header]

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from tinyvllm.sample.batch_update import BatchUpdate
from tinyvllm.sample.logits_processors.interface import LogitsProcessor
from tinyvllm.sample.logits_processors.state import process_dict_updates

if TYPE_CHECKING:
    from tinyvllm.config import EngineConfig
    from tinyvllm.sampling_params import SamplingParams

# (output_ids, logits) -> logits, or (prompt_ids, output_ids, logits) -> logits
RequestLogitsProcessor = Callable[..., torch.Tensor]


# --8<-- [start:adapter]
class AdapterLogitsProcessor(LogitsProcessor):
    """Wraps per-request callables; subclasses implement ``new_req_logits_processor``."""

    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, partial[torch.Tensor]] = {}  # row -> bound callable

    @abstractmethod
    def new_req_logits_processor(self, params: "SamplingParams") -> RequestLogitsProcessor | None:
        """The callable for a request with these params, or None if it needs none."""
        raise NotImplementedError

    def _new_state(
        self, params: "SamplingParams", prompt_ids: "list[int] | None", output_ids: list[int]
    ) -> "partial[torch.Tensor] | None":
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        if len(inspect.signature(req_lp).parameters) == 3:
            if prompt_ids is None:
                raise ValueError(f"{req_lp!r} takes prompt token ids, but the request has none")
            return partial(req_lp, prompt_ids, output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, req_lp in self.req_info.items():
            row_logits = logits[row]  # [V], a view
            new_logits = req_lp(row_logits)
            if new_logits is not row_logits:  # NOTE 1
                logits[row] = new_logits
        return logits
# --8<-- [end:adapter]
