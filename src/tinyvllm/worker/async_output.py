"""A step in flight: what the runner launched and reads back one step later (async scheduling).

Concept: under async scheduling the runner launches step N+1 before anyone has read step N's
sampled ids on the host. Three pieces make that work without a wait in between:
``placeholder_feed`` says which input positions of step N+1 hold a token only the device
knows yet (step N's), and where in step N's sampled ids it is, so the forward reads it from
there; ``HostIds`` starts the copy of a step's sampled ids to the host as soon as they are
sampled, and waits for it only when read; ``AsyncModelRunnerOutput`` is the handle the worker
keeps per step, whose ``get_output()`` reads the ids once (the step's one wait) and builds the
``ModelRunnerOutput``.

Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``AsyncGPUModelRunnerOutput``, the input ids
taken from ``prev_sampled_token_ids`` in ``_prepare_input_ids``) and ``vllm/v1/outputs.py``
(``AsyncModelRunnerOutput``).

Invariants: a row of step N+1 has at most one token not yet on the host, the first it
computes, and step N sampled it for the same request; ``get_output()`` builds the output
once and returns the same object after; the runner reads step N back before it hands step
N+1's rows to the logits processors, so they see every token sampled so far.

NOTE 1 (the copy starts early): for a step read back later, on CUDA, ``non_blocking`` copies
into pinned host memory (the ids, the logprobs, the prompt logprobs) are queued right behind
the sampler, and an event after them; reading waits for that event only, not for the step
launched since (a plain ``.tolist()`` would wait for the whole stream, the next forward
included). That wait is explicit, so CUDA's sync debug mode does not report it. On the CPU
host and device are one memory: the ids are read when asked, through ``sampled_to_host``,
so the device-sync counter sees the one wait where it happens. A step read back at once
(synchronous scheduling) reads them as before, with one blocking read.
NOTE 2 (sampling deferred): the runner keeps a launched step as a ``StepInFlight`` until it is
read back. A step whose grammar mask needs the tokens of the step before it is launched in two
calls, as vLLM's ``execute_model`` and ``sample_tokens``: the forward (a ``ForwardInFlight``: the
rows, the hidden states, what the sampler needs), then, once the engine has read the step
before back and made the mask, the sampling. The forward reads the step before's id on the
device as any step does, and the device runs it while the host reads back and makes the mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinyvllm.outputs import LogprobEntry, ModelRunnerOutput
from tinyvllm.sample.logprobs import LogprobsTensors
from tinyvllm.sample.sampler import SamplerOutput, ids_for_host, sampled_to_host, split_host_ids

if TYPE_CHECKING:
    from tinyvllm.attention.metadata import AttentionMetadata
    from tinyvllm.core.sched_output import SchedulerOutput
    from tinyvllm.sample.metadata import SamplingMetadata
    from tinyvllm.worker.prompt_logprobs import PendingPromptLogprobs


# --8<-- [start:feed]
@dataclass(frozen=True)
class PlaceholderFeed:
    """Input positions whose token is still on the device: ``positions[i]`` (an index into
    the step's flat token ids) takes the previous step's sampled id of row ``prev_rows[i]``."""

    positions: tuple[int, ...]
    prev_rows: tuple[int, ...]


def placeholder_feed(
    req_ids: Sequence[str],
    num_computed: Sequence[int],
    num_scheduled: Sequence[int],
    num_known: Sequence[int],
    prev_rows: Mapping[str, int],
) -> PlaceholderFeed:
    """Which scheduled positions lie past the tokens the host knows (``num_known`` per row):
    at most one per row, the row's first, sampled by the previous step for that request."""
    positions, rows = [], []
    start = 0
    for req_id, computed, scheduled, known in zip(req_ids, num_computed, num_scheduled, num_known):
        missing = computed + scheduled - max(computed, known)
        if missing > 0:
            if missing != 1 or computed != known or req_id not in prev_rows:
                raise RuntimeError(
                    f"request {req_id!r}: positions {computed}..{computed + scheduled - 1} scheduled, "
                    f"{known} tokens known: only the last step's one token may be missing"
                )
            positions.append(start)
            rows.append(prev_rows[req_id])
        start += scheduled
    return PlaceholderFeed(tuple(positions), tuple(rows))
# --8<-- [end:feed]


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values queued for a copy into pinned host memory; read them after an event
    recorded behind the copy (NOTE 1)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True).copy_(t, non_blocking=True)


def logprobs_to_host_early(tensors: LogprobsTensors | None) -> LogprobsTensors | None:
    """A step's logprobs copied up behind the sampler on CUDA, so reading them later waits
    for no step launched since (NOTE 1); as they are elsewhere."""
    if tensors is None or tensors.token_ids.device.type != "cuda":
        return tensors
    return LogprobsTensors(pinned_copy(tensors.token_ids), pinned_copy(tensors.logprobs), pinned_copy(tensors.ranks))


class HostIds:
    """A step's sampled ids and no-token verdicts on their way to the host (NOTE 1). With
    ``early`` on CUDA (a step read back later) the copy starts now, with an event behind it
    and everything queued before; otherwise reading them is the usual blocking read."""

    def __init__(self, tokens: torch.Tensor, no_token: torch.Tensor, early: bool,
                 host_ids: torch.Tensor | None = None) -> None:  # [R] int64, [R] bool; [R] int64 if made (sampler NOTE 8)  # fmt: skip
        self.tokens, self.no_token, self.host_ids = tokens, no_token, host_ids
        self._host: torch.Tensor | None = None
        self._event = None
        if early and tokens.device.type == "cuda":
            self._host = pinned_copy(ids_for_host(tokens, no_token) if host_ids is None else host_ids)  # [R]
            self._event = torch.cuda.Event()
            self._event.record()

    def get(self) -> tuple[list[int], list[bool]]:
        """Each row's token and verdict: the step's one wait."""
        if self._host is None:  # the usual blocking read; of the sampler's ids where it made them
            return sampled_to_host(self.tokens, self.no_token, self.host_ids)
        self._event.synchronize()
        return split_host_ids(self._host.tolist())


class AsyncModelRunnerOutput:
    """The worker's handle on one launched step; ``get_output()`` reads it back, once."""

    def __init__(self, finish: Callable[[], ModelRunnerOutput]) -> None:
        self._finish: Callable[[], ModelRunnerOutput] | None = finish
        self._output: ModelRunnerOutput | None = None

    @property
    def done(self) -> bool:
        """Whether the output was read back already."""
        return self._finish is None

    def get_output(self) -> ModelRunnerOutput:
        if self._finish is not None:
            self._output, self._finish = self._finish(), None
        return self._output


@dataclass
class StepInFlight:
    """A launched step, until it is read back (the runner's ``_read_back``): its rows and what the
    sampler left on the device (plain sampling, or drafts to decide on)."""

    req_ids: list[str]
    states: list  # the runner's RunnerRequestState of each row (model_runner.py imports this module)
    num_sched: list[int]
    drafts: list[tuple[int, ...]]  # the drafts each row verifies
    req_id_to_index: dict[str, int]
    scheduled_drafts: list[int]  # the drafts the scheduler counted (placeholders: model_runner.py NOTE 14)
    num_invalid_drafts: Mapping[str, int] = dataclasses.field(default_factory=dict)  # sched_output.py NOTE 5
    complete: list[bool] = dataclasses.field(default_factory=list)
    pending_prompt_logprobs: list[PendingPromptLogprobs] = dataclasses.field(default_factory=list)
    host_ids: HostIds | None = None  # plain sampling: the ids on their way up (async_output.py)
    sampler_output: SamplerOutput | None = None
    sampling_metadata: SamplingMetadata | None = None
    tokens: list[list[int] | None] | None = None  # a pooling engine's: no token
    logprobs: dict[str, list[LogprobEntry]] = dataclasses.field(default_factory=dict)
    verification: object | None = None  # drafts: a draft_verification.PendingVerification, decided when read
    handle: AsyncModelRunnerOutput | None = None
    pooled: list | None = None  # a pooling engine's: each row's vector, or None (model_runner.py NOTE 13)


@dataclass
class ForwardInFlight:
    """A step whose forward is launched and whose sampling waits (the runner's ``sample_tokens``,
    once the engine has the step's grammar mask): the rows, and what the sampler will need."""

    step: StepInFlight
    hidden: torch.Tensor | None  # [T, hidden_size]; None for a step without rows
    metadata: AttentionMetadata | None
    computed: list[int]  # each row's computed tokens before the step
    scheduler_output: SchedulerOutput
    logits: torch.Tensor | None = None  # [R_pad, V] when the forward ran the LM head (cudagraph_capture.py NOTE 4)
