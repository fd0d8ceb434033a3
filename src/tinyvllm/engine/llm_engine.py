"""LLMEngine: requests in, one step at a time, finished outputs out.

Concept: the loop that ties the pieces together. ``add_request`` hands a tokenized
prompt to the scheduler; ``step()`` schedules, runs the model, feeds the sampled tokens
back to the scheduler and turns finished requests into ``RequestOutput``s. It holds no
logic of its own beyond that bookkeeping (detokenising, timing).

Follows: the docs page "The model runner" (one engine step: schedule, execute, update);
``step()`` reads top to bottom in a dozen lines.
Mirrors: ``vllm/v1/engine/llm_engine.py`` and ``vllm/v1/engine/core.py`` (``EngineCore.step``)
with the output processor folded in; nano-vllm's ``LLMEngine.step``.

Invariants: every request added is either unfinished in the scheduler or has been
returned exactly once as a finished ``RequestOutput`` (or aborted).

NOTE 1 (a step that raises): if the forward, the sampler, a logits processor or the
output update raises anything (``KeyboardInterrupt`` included), the step's requests are
aborted and their blocks freed, the blocks the step cached leave the prefix cache (their
KV was never written), the runner empties its persistent batch, and the exception goes
on to the caller. Requests the step did not schedule carry on. vLLM's engine instead
reports itself dead; an offline engine can do better, because nothing else shares it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tinyvllm.config import ReasoningConfig
from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.outputs import CompletionOutput, EngineCoreOutput, RequestMetrics, RequestOutput
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.validation import check_request_against_model, check_token_ids
from tinyvllm.worker.model_runner import ModelRunner


@dataclass
class _Tracked:
    """What the engine remembers of a request until it is returned."""

    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    num_cached_tokens: int = 0


class LLMEngine:
    """Schedule -> execute -> update, one step at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_runner: ModelRunner,
        tokenizer=None,
        eos_token_id: int | None = None,
        *,
        vocab_size: int | None = None,
        reasoning_config: ReasoningConfig | None = None,
    ):
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size  # None: unknown, token ids are not checked against a vocabulary
        self.reasoning_config = reasoning_config  # None: thinking_token_budget is refused
        self._tracked: dict[str, _Tracked] = {}

    # --8<-- [start:add_request]
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; TypeError or ValueError (nothing queued) on a bad one.

        Checked against the model here, so that a bad request fails now and never inside
        ``step()``: token ids (the prompt's, ``logit_bias``'s, ``stop_token_ids``) must lie in
        ``[0, vocab_size)`` when the engine was given ``vocab_size``, and
        ``thinking_token_budget`` needs the engine's ``reasoning_config``. Requests with
        different ``cache_salt``s never share a cached block (``core/prefix_hash.py``).
        """
        request = Request(request_id, prompt_token_ids, sampling_params, eos_token_id=self.eos_token_id, cache_salt=cache_salt)
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"request {request_id!r}: prompt must be a str or None, got {prompt!r}")
        label = f"request {request_id!r}"
        check_token_ids(f"{label}: prompt_token_ids", request.prompt_token_ids, self.vocab_size)
        check_request_against_model(f"{label}: sampling_params", sampling_params, self.vocab_size, self.reasoning_config is not None)
        self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(prompt, list(request.prompt_token_ids), time.perf_counter())
    # --8<-- [end:add_request]

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their blocks; they produce no output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self._tracked.pop(rid, None)

    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.model_runner.execute_model(scheduler_output)
            core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        except BaseException:  # KeyboardInterrupt too: the engine must stay usable (NOTE 1)
            self._abort_failed_step(scheduler_output)
            raise
        now = time.perf_counter()
        finished = []
        for out in core_outputs:
            tracked = self._tracked[out.request_id]
            if out.new_token_ids and tracked.first_token_time is None:
                tracked.first_token_time = now
                tracked.num_cached_tokens = out.num_cached_tokens
            tracked.token_ids.extend(out.new_token_ids)
            if out.finished:
                finished.append(self._make_output(out, self._tracked.pop(out.request_id), now))
        return finished
    # --8<-- [end:step]

    # --8<-- [start:abort_failed_step]
    def _abort_failed_step(self, scheduler_output: SchedulerOutput) -> None:
        """NOTE 1: as if the failed step's requests had never been added."""
        failed = self.scheduler.abort_failed_step(scheduler_output)
        self.model_runner.recover_from_failed_step(failed)
        for rid in failed:
            self._tracked.pop(rid, None)
    # --8<-- [end:abort_failed_step]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _make_output(self, out: EngineCoreOutput, tracked: _Tracked, now: float) -> RequestOutput:
        text = self.tokenizer.decode(tracked.token_ids, skip_special_tokens=True) if self.tokenizer else ""
        completion = CompletionOutput(0, text, tracked.token_ids, out.finish_reason, out.stop_reason)
        return RequestOutput(
            request_id=out.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=[completion],
            finished=True,
            num_cached_tokens=tracked.num_cached_tokens,
            metrics=RequestMetrics(tracked.arrival_time, tracked.first_token_time, now),
        )
