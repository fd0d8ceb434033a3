"""Prompt logprobs: the logprob of every prompt token after the first, gathered as the prefill runs.

Concept: prompt token ``p + 1`` gets its logprob from the logits of position ``p``, which the
prefill computes anyway; a chunked prefill computes them in pieces. Each step, for every
request that asks (``SamplingParams.prompt_logprobs``), the runner queues the logprobs of
the prompt positions the step computed (``queue_prompt_logprobs``), before the step waits
for its sampled ids; after that one wait it reads them to the host and writes them into
the request's list by position (``collect_prompt_logprobs``). The step that reaches the end
of the prompt sends the whole list, once.

Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``_get_prompt_logprobs_dict``,
``num_prompt_logprobs``, ``in_progress_prompt_logprobs_cpu``).

Invariants: a request's ``prompt_logprobs`` list has one entry per prompt token after the
first, ``None`` until computed; ``prompt_logprobs_sent`` turns True once, when the list goes
out, and nothing is queued for that request again (a later preemption sends nothing).

NOTE 1 (no prefix-cache hit): such a request takes no prefix-cache hit, as in vLLM: a cached
block's positions would never be computed, so their logprobs could not be reported.
NOTE 2 (one wait): the logprobs are queued with the forward and read after the step's one
wait for its sampled ids (``tinyvllm/device_syncs.py``), so they add no wait of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tinyvllm.device_syncs import upload
from tinyvllm.outputs import LogprobEntry
from tinyvllm.sample import logprobs as logprob_ops
from tinyvllm.sample.logprobs import LogprobsTensors
from tinyvllm.sampling_params import SamplingParams


class PromptLogprobsState(Protocol):
    """What is read and written of a request's state (the runner's ``RunnerRequestState``)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt_logprobs: list[LogprobEntry | None] | None  # position p: prompt token p + 1's
    prompt_logprobs_sent: bool


# --8<-- [start:prompt_logprobs]
@dataclass(frozen=True)
class PendingPromptLogprobs:
    """One request's prompt logprobs of this step, queued on the device (NOTE 2)."""

    state: PromptLogprobsState
    start: int  # positions start .. end - 1 predict prompt tokens start + 1 .. end
    end: int
    k: int  # the top logprobs kept per position
    tensors: LogprobsTensors | None  # None: this step computed no such position
    prompt_done: bool  # the step reaches the end of the prompt: the whole list goes out


def queue_prompt_logprobs(
    model: torch.nn.Module,
    states: list[PromptLogprobsState],
    computed: list[int],
    num_sched: list[int],
    hidden: torch.Tensor,
) -> list[PendingPromptLogprobs]:
    """First half, before the step waits for its tokens: queue the logprobs of the prompt
    tokens this step computed, for the requests that ask (NOTE 2). ``hidden``: [N, hidden],
    the step's tokens row by row."""
    pending: list[PendingPromptLogprobs] = []
    start = 0  # where the request's tokens begin in ``hidden`` (the tokens lie row by row)
    for state, c, n in zip(states, computed, num_sched):
        first, start = start, start + n
        k = state.sampling_params.prompt_logprobs
        if k is None or state.prompt_logprobs_sent:
            continue
        num_prompt = len(state.prompt_token_ids)
        end = min(c + n, num_prompt - 1)  # positions c .. end - 1 predict prompt tokens c + 1 .. end
        tensors = None
        if end > c:
            logprobs = logprob_ops.compute_logprobs(model.compute_logits(hidden[first : first + end - c]))  # [end - c, V]
            k = logprob_ops.num_top(k, logprobs.shape[-1])
            targets = upload(state.prompt_token_ids[c + 1 : end + 1], torch.int64, logprobs.device)  # [end - c]
            tensors = logprob_ops.gather_logprobs(logprobs, targets, k)
        pending.append(PendingPromptLogprobs(state, c, end, k, tensors, c + n >= num_prompt))
    return pending


def collect_prompt_logprobs(pending: list[PendingPromptLogprobs]) -> dict[str, list[LogprobEntry]]:
    """Second half, after the wait: the queued logprobs on the host; a request's whole list
    once its prompt is done, and only once."""
    finished: dict[str, list[LogprobEntry]] = {}
    for p in pending:
        if p.tensors is not None:
            p.state.prompt_logprobs[p.start : p.end] = logprob_ops.row_entries(p.tensors, [p.k] * (p.end - p.start))
        if p.prompt_done:
            finished[p.state.req_id] = list(p.state.prompt_logprobs)
            p.state.prompt_logprobs_sent = True
    return finished
# --8<-- [end:prompt_logprobs]
