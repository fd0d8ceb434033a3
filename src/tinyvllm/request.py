"""Request and RequestStatus: one generation request as the scheduler tracks it.

Concept: the mutable record of a request's tokens and progress. The scheduler and the
KV cache manager read it; only the scheduler (and ``append_output_token_ids``) changes it.

Mirrors: ``vllm/v1/request.py``.

Seed 002 (opening): there are no prefill and decode phases; a request only has
``num_tokens`` (prompt + output so far) and ``num_computed_tokens`` (how many of them
have their KV in the cache). A step schedules some of the difference.

Invariants:
- ``all_token_ids == prompt_token_ids + output_token_ids`` at all times;
- ``output_token_ids`` is one list object for the request's whole life (logits
  processors keep a reference to it and read it live);
- ``0 <= num_computed_tokens <= num_tokens + num_output_placeholders`` (placeholders: async
  scheduling's tokens not yet back from the device; 0 otherwise).

Checks nothing a user gave: the input processor (``engine/input_processor.py``) has checked
the id, the prompt and ``cache_salt`` once, before the request is built; the constructor
only asserts what it relies on (a non-empty str id, a non-empty prompt of ints >= 0,
``SamplingParams``, a non-empty ``cache_salt`` or None).

A pooling request (``pooling_params`` set, ``docs/pooling.md``) is one prefill: its
``sampling_params`` ask for one token (``max_tokens=1``, as vLLM's pooling ``Request``), so
every rule of the scheduler holds for it, and it finishes when the runner sends its vector.

Left out: multimodal inputs.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every FINISHED_* status compares above PREEMPTED."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its grammar is still compiling (structured outputs; vLLM's name)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its row had no token left to sample (vLLM's FINISHED_ERROR)

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        """The OpenAI-style finish reason of a finished status, None otherwise."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One request: its prompt, its outputs so far, and how many tokens are computed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        # Checked by the input processor (module header); assertions only.
        prompt = list(prompt_token_ids)
        assert isinstance(request_id, str) and request_id, f"request_id must be a non-empty str, got {request_id!r}"
        assert prompt, f"request {request_id!r}: the prompt is empty (prompt_token_ids={prompt!r})"
        assert all(type(t) is int and t >= 0 for t in prompt), f"request {request_id!r}: prompt_token_ids {prompt!r}"
        assert isinstance(sampling_params, SamplingParams), f"request {request_id!r}: sampling_params {sampling_params!r}"
        assert cache_salt is None or (isinstance(cache_salt, str) and cache_salt), f"cache_salt {cache_salt!r}"
        assert type(priority) is int, f"request {request_id!r}: priority {priority!r}"
        assert pooling_params is None or isinstance(pooling_params, PoolingParams), f"pooling_params {pooling_params!r}"
        self.request_id = request_id
        self.prompt_token_ids: list[int] = prompt
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params  # None: a generation request
        self.eos_token_id = eos_token_id
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        # The priority policy's order (``core/request_queue.py``): lower priority first, then
        # earlier arrival. The engine's clock (``time.monotonic``) unless the caller gives one.
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Its bad words as token sequences: made by the input processor, which has the
        # tokenizer (``sample/bad_words.py`` NOTE 1), set by LLMEngine; they travel to the persistent batch.
        self.bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache at this request's first admission.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # The stop token that finished the request, if one did.
        self.stop_reason: int | None = None
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt)
        # Speculative decoding: the drafts proposed for the next step (not part of the
        # sequence until the target model keeps them; ``LLMEngine`` sets them after a step).
        self.spec_token_ids: list[int] = []
        # Async scheduling (``core/async_scheduler.py``): tokens sampled by steps still on the
        # device, scheduled past (their positions computed next) before their values are known.
        self.num_output_placeholders = 0
        # Structured outputs (``structured_output/request.py``): its grammar, set by the engine
        # when ``sampling_params.structured_outputs`` asks for one.
        self.structured_output_request = None

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Every prompt position must be computed (vLLM's name): for its prompt logprobs, or
        for a pooling that reads more than the last position (``pooling_params.py`` NOTE 4).
        Its blocks are still cached for others."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (pooling is not None and pooling.skip_reading_prefix_cache)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs, one list kept in step with ``output_token_ids``. Do not mutate."""
        return self._all_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + outputs (what the n-gram proposer's table reads)."""
        return self._all_token_ids[start:end]

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Append one sampled token or several, keeping both token lists in step."""
        if isinstance(token_ids, int):  # the common case: one token per step
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            return
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
