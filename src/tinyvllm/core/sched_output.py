"""SchedulerOutput: what one scheduling step hands to the model runner (frozen).

Concept: the complete, immutable description of one step: which requests run, how
many tokens each, which blocks they newly got, and which requests left since the last
step. The runner needs nothing else from the scheduler.

Follows: seed 002 opening (a step is a token count per request; prefills and decodes
mix). Mirrors: ``vllm/v1/core/sched/output.py`` (``NewRequestData``,
``CachedRequestData``, ``SchedulerOutput``).

Invariants: ``total_num_scheduled_tokens == sum(num_scheduled_tokens.values())``; every
scheduled request appears in exactly one of ``scheduled_new_reqs`` and
``scheduled_cached_reqs``; ``num_computed_tokens`` is the count *before* this step, i.e.
the position of the step's first token.

NOTE 1 (a NamedTuple for the per-step record): a ``CachedRequestData`` is built for every
running request in every step. A ``NamedTuple`` is as immutable as a frozen dataclass
and several times cheaper to build (a frozen dataclass sets each field through
``object.__setattr__``), which matters at a few microseconds per request per step.
NOTE 2 (the grammar bitmask): the scheduler leaves it empty; the engine adds it after
``schedule()`` (``structured_output/manager.py``), as vLLM's ``get_grammar_bitmask`` does.
The core never imports torch or numpy: to it the mask is an opaque object. When the mask is
made after the step's forward was launched (async scheduling), it travels on its own, as a
``GrammarOutput`` (vLLM's), to the runner's ``sample_tokens``.
NOTE 3 (placeholder drafts): under async scheduling with speculative decoding the scheduler
schedules a decoding request's drafts before they exist; ``scheduled_spec_decode_tokens``
then holds ``DRAFT_PLACEHOLDER`` ids, and the runner proposes the real drafts (at most as
many) when it launches the step (``core/async_scheduler.py`` NOTE 6).
NOTE 4 (a copy is the same step): the engine sends the runner copies made by
``dataclasses.replace`` (the mask added, the runner's drafts filled in), and the copies come
back to ``update_from_output``. A copy shares the original's read-only maps, so
``same_step`` knows it for the step the scheduler made (``core/async_scheduler.py`` NOTE 5).
NOTE 5 (drafts a grammar refuses, async scheduling with speculative decoding): the runner's
drafts replace the placeholders in the engine's copy (``update_draft_token_ids_in_output``)
and the mask is made over them; no grammar cut them. A refused draft's mask row refuses it,
so the verification rejects it there; ``num_invalid_spec_tokens`` tells the runner to report
only the drafts before it as verified, as the synchronous engine, which cut them, counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple

from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams

DRAFT_PLACEHOLDER = -1  # NOTE 3: a draft the runner proposes when it launches the step


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen before (first admission)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]  # the whole block table: prefix hits then new blocks
    num_computed_tokens: int  # prefix-cache hit tokens, where this step starts
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # the request's bad words, tokenized by the engine
    pooling_params: PoolingParams | None = None  # a pooling request's (``request.py``)


class CachedRequestData(NamedTuple):
    """A request the runner has seen: still running, or resumed after preemption (NOTE 1)."""

    req_id: str
    resumed_from_preemption: bool
    new_block_ids: tuple[int, ...]  # blocks to append; the whole table when resumed
    num_computed_tokens: int  # where this step starts
    # All token ids (prompt + outputs) when resumed: the runner dropped the request at
    # preemption and rebuilds it from these. None for a request that kept running.
    resumed_token_ids: tuple[int, ...] | None = None


# --8<-- [start:scheduler_output]
@dataclass(frozen=True)
class SchedulerOutput:
    """One step: the requests to run and the tokens per request, within the budget."""

    scheduled_new_reqs: tuple[NewRequestData, ...]
    scheduled_cached_reqs: tuple[CachedRequestData, ...]
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: frozenset[str]  # finished (or aborted) since the previous step
    preempted_req_ids: frozenset[str]  # preempted in this step
    # Speculative decoding: each decoding request's drafts to verify this step (its
    # num_scheduled_tokens count them: 1 + len(drafts)); empty without drafts.
    scheduled_spec_decode_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # Structured outputs (NOTE 2): each constrained request's first row in ``grammar_bitmask``
    # (a request verifying k drafts owns k + 1 rows), and the mask, numpy int32 [G, ceil(V / 32)].
    structured_output_request_ids: Mapping[str, int] = field(default_factory=dict)
    grammar_bitmask: object | None = None
    # NOTE 5: per constrained request, how many of its scheduled drafts are not verified (a
    # draft its grammar refused, those after it, and placeholders the runner left unproposed).
    num_invalid_spec_tokens: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        maps = ("structured_output_request_ids", "num_scheduled_tokens", "scheduled_spec_decode_tokens", "num_invalid_spec_tokens")
        for name in maps:
            value = getattr(self, name)
            if not isinstance(value, MappingProxyType):  # a copy keeps the original's (NOTE 4)
                object.__setattr__(self, name, MappingProxyType(dict(value)))
        assert self.total_num_scheduled_tokens == sum(self.num_scheduled_tokens.values()), (
            f"total {self.total_num_scheduled_tokens} != sum {sum(self.num_scheduled_tokens.values())}"
        )

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    def same_step(self, other: SchedulerOutput) -> bool:
        """NOTE 4: ``other`` is this step or a copy of it."""
        return self.num_scheduled_tokens is other.num_scheduled_tokens
# --8<-- [end:scheduler_output]


@dataclass(frozen=True)
class GrammarOutput:
    """A step's grammar mask on its own (NOTE 2): the fields of the ``SchedulerOutput``'s."""

    structured_output_request_ids: Mapping[str, int]
    grammar_bitmask: object | None
    num_invalid_spec_tokens: Mapping[str, int] = field(default_factory=dict)  # NOTE 5

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The step's mask, or None when the step has none."""
        if scheduler_output.grammar_bitmask is None:
            return None
        so = scheduler_output
        return cls(so.structured_output_request_ids, so.grammar_bitmask, dict(so.num_invalid_spec_tokens))
