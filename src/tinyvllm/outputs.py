"""Outputs that cross a boundary: model runner -> scheduler -> engine (all frozen).

Concept: the values one stage hands to the next. ``ModelRunnerOutput`` carries the
sampled tokens of one step; ``EngineCoreOutput`` is what the scheduler reports per
request after a step (new tokens, finish reason).

Mirrors: ``vllm/v1/outputs.py`` (``ModelRunnerOutput``) and ``vllm/v1/engine/__init__.py``
(``EngineCoreOutput``).

NOTE 1: ``EngineCoreOutput`` is built for every request in every step, so it is a
``NamedTuple``: immutable like the frozen dataclasses here, and several times cheaper to
build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Tokens sampled in one step, row ``req_id_to_index[req_id]`` per request.

    A request whose step did not reach the end of its prompt has an empty list.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]

    def __post_init__(self) -> None:
        if len(self.req_ids) != len(self.sampled_token_ids):
            raise ValueError(
                f"{len(self.req_ids)} req_ids but {len(self.sampled_token_ids)} rows of sampled tokens"
            )


class EngineCoreOutput(NamedTuple):
    """One request's result of one step (NOTE 1).

    Attributes:
        request_id: the request.
        new_token_ids: tokens appended this step (empty for a partial prefill).
        finish_reason: "stop", "length" or "abort" once finished, else None.
        stop_reason: the stop token id that ended it, if one did.
        num_cached_tokens: prompt tokens found in the prefix cache at first admission.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock times of one request (seconds, ``time.perf_counter``)."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request: its text, its token ids, and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id, or the stop string, that ended it


@dataclass(frozen=True)
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (names as in vLLM).

    ``LLMEngine.step()`` also returns unfinished ones (``finished=False``) for requests
    whose ``SamplingParams.output_kind`` is DELTA (``outputs[0]`` holds only the new text
    and token ids) or CUMULATIVE (everything so far).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
