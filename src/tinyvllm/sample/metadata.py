# --8<-- [start:header]
"""SamplingMetadata: everything the sampler may know about one step's batch, frozen.

Concept: the sampler needs, per row, a temperature, optional top-p / top-k limits and
(for seeded requests) a private random generator, plus the two stateful helpers that edit
logits (the logits processors and the thinking-budget holder). This frozen record carries
exactly that from the worker to the sampler, and nothing else.

Seed: 001 ch. 9.2 (the sampler's order of operations reads these fields), ch. 13.9 (the
thinking budget forces tokens inside the sampler).
Mirrors: ``vllm/v1/sample/metadata.py`` (``SamplingMetadata``); vLLM builds it in
``InputBatch._make_sampling_metadata`` (``vllm/v1/worker/gpu_input_batch.py``), ours is
``InputBatch.make_sampling_metadata``.

Invariants:
- every per-row tensor has ``num_reqs`` rows, row ``i`` being row ``i`` of the logits;
- ``all_greedy`` is True exactly when every temperature is 0, ``all_random`` exactly when
  none is (both hold only for an empty batch);
- ``top_p`` is None exactly when no row has ``top_p < 1``, ``top_k`` exactly when no row
  has ``top_k > 0``: a None tells the sampler to skip the sort over the vocabulary;
- ``generators`` is a read-only view; its keys are rows ``< num_reqs``.

NOTE 1 (why it exists): the sampler knows nothing of the worker. The persistent
``InputBatch`` builds this record after ``refresh()`` has handed the step's
``BatchUpdate`` to the processors (and hands the same record out again while the batch
does not change), so ``sample/`` never imports ``worker/``.
NOTE 2 (frozen at the top level only): the fields cannot be reassigned, but the logits
processors, the thinking-budget holder and the generators are live, stateful objects
shared with the batch: sampling advances a seeded request's generator, and the model
runner relies on that object identity to restore it after a partial prefill.
Left out: logprobs, penalties (presence / frequency / repetition and the token counts
they need), allowed-token masks, bad words, speculative decoding's draft tokens.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from tinyvllm.sample.logits_processors.state import LogitsProcessors
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder


# --8<-- [start:metadata]
@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    """The sampler's read-only view of one step's batch (see the module header)."""

    temperature: torch.Tensor  # [R] float32, 0 = greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [R] float32; None when no row uses top-p (1.0 = off)
    top_k: torch.Tensor | None  # [R] int64; None when no row uses top-k (0 = off)
    generators: Mapping[int, torch.Generator]  # row -> that request's own generator (seeded requests)
    logitsprocs: LogitsProcessors
    thinking_budget: ThinkingBudgetStateHolder | None

    def __post_init__(self) -> None:
        if self.temperature.dim() != 1:
            raise ValueError(f"temperature must have shape [R], got {tuple(self.temperature.shape)}")
        for name in ("top_p", "top_k"):
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != (self.num_reqs,):
                raise ValueError(f"{name} must have shape [{self.num_reqs}], got {tuple(tensor.shape)}")
        outside = sorted(row for row in self.generators if not 0 <= row < self.num_reqs)
        if outside:
            raise ValueError(f"generators name rows {outside}, outside 0 .. {self.num_reqs - 1}")
        if not isinstance(self.generators, MappingProxyType):
            # A private copy behind a read-only view: later edits of the caller's dict cannot leak in.
            object.__setattr__(self, "generators", MappingProxyType(dict(self.generators)))

    @property
    def num_reqs(self) -> int:
        """R: the number of requests (rows of the logits) this step."""
        return self.temperature.shape[0]
# --8<-- [end:metadata]
