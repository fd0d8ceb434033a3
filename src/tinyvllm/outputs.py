"""Outputs that cross a boundary: model runner -> scheduler -> engine (all frozen).

Concept: the values one stage hands to the next. ``ModelRunnerOutput`` carries the
sampled tokens of one step; ``EngineCoreOutput`` is what the scheduler reports per
request after a step (new tokens, finish reason).

Mirrors: ``vllm/v1/outputs.py`` (``ModelRunnerOutput``) and ``vllm/v1/engine/__init__.py``
(``EngineCoreOutput``).

NOTE 1: ``EngineCoreOutput`` is built for every request in every step, so it is a
``NamedTuple``: immutable like the frozen dataclasses here, and several times cheaper to
build.
NOTE 2 (pooling, ``docs/pooling.md``): a pooling request's vector travels as a CPU float32
tensor from the runner (``pooler_output``) through the scheduler (``pooling_output``), which
never looks inside it (the core imports no torch), to ``PoolingRequestOutput``; a
``TaskRequestOutput`` reads it for its task: ``EmbeddingRequestOutput`` as a list of floats
(``LLM.embed``), ``ClassificationRequestOutput`` as label scores (``LLM.classify``);
``ScoringRequestOutput`` is one pair's score, what ``LLM.score`` returns (``engine/scoring.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    import torch


# One position's logprobs as plain values: (token ids, logprobs, the chosen token's rank),
# the chosen token first, then the top k (``sample/logprobs.py``). This is what crosses from
# the runner through the scheduler to the engine, which turns it into ``PositionLogprobs``.
LogprobEntry = tuple[list[int], list[float], int]


@dataclass(frozen=True)
class DraftTokenIds:
    """The drafts a launched step runs, per request with drafts scheduled: what the runner
    proposed in place of the placeholders (async scheduling with speculative decoding), taken
    by the engine before it makes the step's grammar mask (``engine/llm_engine.py`` NOTE 10)."""

    req_ids: tuple[str, ...]
    draft_token_ids: tuple[tuple[int, ...], ...]  # [len(req_ids)] each at most k


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Tokens sampled in one step, row ``req_id_to_index[req_id]`` per request.

    A request whose step did not reach the end of its prompt has an empty list.
    ``logprobs[req_id]`` has one entry per sampled token of a request that asked;
    ``prompt_logprobs[req_id]`` one per prompt token after the first, sent once, in the
    step that finishes the prompt. ``no_token_req_ids``: requests whose row had no token left
    to sample (every logit ``-inf`` or not a number); they get none and end with an error.
    ``pooler_output[req_id]``: a pooling request's vector ([dims] float32, CPU), in the step
    that finishes its prompt (NOTE 2). ``draft_token_ids[req_id]``: the drafts the runner proposed
    and verified in place of the scheduler's placeholders (async scheduling with speculative
    decoding, ``core/sched_output.py`` NOTE 3); at most as many as were scheduled, and only those
    before a draft the grammar refused (``SchedulerOutput.num_invalid_spec_tokens``).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    no_token_req_ids: frozenset[str] = frozenset()
    pooler_output: dict[str, Any] = field(default_factory=dict)  # req_id -> torch.Tensor (NOTE 2)
    draft_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)

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
        finish_reason: "stop", "length", "abort" or "error" once finished, else None.
        stop_reason: the stop token id that ended it, if one did.
        num_cached_tokens: prompt tokens found in the prefix cache at first admission.
        new_logprobs: one entry per new token, when the request asked for logprobs.
        prompt_logprobs: one entry per prompt token after the first, once.
        pooling_output: a pooling request's vector, when it finishes (NOTE 2).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry] | None = None
    pooling_output: Any = None  # torch.Tensor (NOTE 2)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Wall-clock times of one request (seconds, ``time.perf_counter``).

    ``scheduled_time``: when a step first scheduled it (vLLM's ``scheduled_ts``), which
    splits the time to the first token into queueing and prefill; None where the engine
    does not record it.
    """

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    scheduled_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


# --8<-- [start:logprob]
@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``): from the model's raw
    logits, its rank among all tokens (1 = the most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: the sampled (or prompt) token's, plus the top k, by token id.
PositionLogprobs = dict[int, Logprob]
# --8<-- [end:logprob]


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request: its text, its token ids, and why it ended.

    ``logprobs`` (when ``SamplingParams.logprobs`` is set) holds one ``PositionLogprobs`` per
    token of ``token_ids``; ``cumulative_logprob`` is the sum of the sampled tokens' logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id, or the stop string, that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (names as in vLLM).

    ``LLMEngine.step()`` also returns unfinished ones (``finished=False``) for requests
    whose ``SamplingParams.output_kind`` is DELTA (``outputs[0]`` holds only the new text
    and token ids) or CUMULATIVE (everything so far). With ``SamplingParams.n`` > 1,
    ``outputs`` holds the n completions, ordered by ``index``. ``prompt_logprobs`` (when
    ``SamplingParams.prompt_logprobs`` is set) has one entry per prompt token, the first None
    (nothing predicts the first token).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None


# --8<-- [start:pooling_outputs]
@dataclass(frozen=True)
class PoolingOutput:
    """A pooling request's vector (vLLM's ``PoolingOutput``): ``data`` [dims] float32, CPU."""

    data: torch.Tensor


@dataclass(frozen=True)
class PoolingRequestOutput:
    """What ``LLM.encode`` returns per prompt (vLLM's names); finished when returned.
    ``outputs`` is None only for a request aborted before its vector was made."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool = True


@dataclass(frozen=True)
class EmbeddingOutput:
    """A prompt's embedding as floats (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class TaskRequestOutput:
    """A ``PoolingRequestOutput`` read for its task (vLLM's ``PoolingRequestOutput[T]``): the
    same request, ``outputs`` the task's view of the tensor (``wrap``, named ``what``)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool = True
    wrap: ClassVar[Callable[[list[float]], Any]]
    what: ClassVar[str]

    @classmethod
    def from_base(cls, output: PoolingRequestOutput):
        if output.outputs is None:
            raise ValueError(f"request {output.request_id!r} was aborted before its vector was made: no {cls.what}")
        return cls(output.request_id, cls.wrap(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.num_cached_tokens, output.finished)  # fmt: skip


@dataclass(frozen=True)
class EmbeddingRequestOutput(TaskRequestOutput):
    """What ``LLM.embed`` returns per prompt (vLLM's names): ``outputs`` an ``EmbeddingOutput``."""

    wrap = EmbeddingOutput
    what = "embedding"
# --8<-- [end:pooling_outputs]


# --8<-- [start:classification_outputs]
@dataclass(frozen=True)
class ClassificationOutput:
    """A prompt's label scores (vLLM's ``ClassificationOutput``): ``probs[i]`` for label ``i``,
    after the model's activation (raw logits with ``use_activation=False``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class ClassificationRequestOutput(TaskRequestOutput):
    """What ``LLM.classify`` returns per prompt (vLLM's names): ``outputs`` a ``ClassificationOutput``."""

    wrap = ClassificationOutput
    what = "probs"
# --8<-- [end:classification_outputs]


# --8<-- [start:scoring_outputs]
@dataclass(frozen=True)
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``): the cosine of its two embeddings, or a
    cross-encoder's score of the pair read as one prompt."""

    score: float


@dataclass(frozen=True)
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's names): from embeddings, ``request_id`` joins
    the two requests' ids with ``_`` and ``prompt_token_ids`` holds both prompts' ids, one after
    the other; from a cross-encoder, the pair's one request and its ids."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
# --8<-- [end:scoring_outputs]
