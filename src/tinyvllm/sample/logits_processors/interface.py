# --8<-- [start:header]
"""The LogitsProcessor interface: one object per processor, batch-wide, stateful.

Concept: a logits processor edits the logits of the whole persistent batch at once
(``apply``: ``[R, V] -> [R, V]``) and keeps its per-row state in step with the batch
through ``update_state(BatchUpdate | None)``, called once per step before ``apply``.
``is_argmax_invariant`` tells the sampler whether the processor can change a greedy
request's token: if not (MinP), the sampler may skip it for greedy rows.

Seed: 001 ch. 7.4. Mirrors: ``vllm/v1/sample/logits_processor/interface.py``.

Contract for implementations:
- ``__init__(config, device, is_pin_memory)``: exactly these three arguments, even if
  unused; the batch capacity is ``config.scheduler_config.max_num_seqs``;
- ``update_state(None)`` means "no change to the batch this step" and is still called
  every step (MinTokens re-checks output lengths through its live references);
- ``apply`` may edit ``logits`` in place but must return the result.
"""
# --8<-- [end:header]

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tinyvllm.config import EngineConfig
    from tinyvllm.sample.batch_update import BatchUpdate
    from tinyvllm.sampling_params import SamplingParams


# --8<-- [start:interface]
class LogitsProcessor(ABC):
    """A batch-wide logits processor (see the module header for the contract)."""

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        """Raise ``ValueError`` if this processor cannot serve ``sampling_params``."""
        return None

    @abstractmethod
    def __init__(self, config: "EngineConfig", device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process ``logits`` ``[R, V]`` float32; may work in place; returns the result."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when ``apply`` can never change which token has the largest logit."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: "BatchUpdate | None") -> None:
        """Follow the batch's removals, additions and moves (None: nothing changed)."""
        raise NotImplementedError
# --8<-- [end:interface]
