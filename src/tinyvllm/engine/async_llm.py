"""AsyncLLM: many concurrent callers, one engine, ``async for out in engine.generate(...)``.

Concept: an ``asyncio`` front for ``LLMEngine``, built on the engine and its input and output
processors (``LLMEngine.from_engine_args``), not on ``LLM``. Each call of ``generate`` adds one
request and gets its own ``asyncio.Queue``; one background task steps the engine and puts
each ``RequestOutput`` into its request's queue. The engine is not thread-safe and a step
takes milliseconds to seconds, so every engine call (add, abort, step) runs in ONE worker
thread (NOTE 1): the event loop never blocks, and the engine never sees two calls at once.

Mirrors: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``abort``), whose engine
core runs in another process and talks over ZeroMQ; here it is a thread and a queue.

Invariants: a request id has a queue exactly while its ``generate`` is being iterated; a
request whose consumer stops early (``break``, a closed stream, a cancelled task) is aborted,
so its KV blocks go back to the pool within one step; every ``generate`` ends: with its
finished output, the abort output, the failed step's exception, or ``EngineDeadError``.

NOTE 1 (one worker thread as the command queue): the executor has a single thread and runs
what it is given in order. While a step runs, adds and aborts wait in its queue and run
between that step and the next: the same order a lock or an explicit command queue would
give. Outputs come back to the event loop as the result of the awaited step, so the queues
are fed from the loop's own thread (no ``call_soon_threadsafe`` is needed). Tokenizing a
prompt and rendering a chat template do NOT run there (NOTE 7).
NOTE 2 (abort on exit): ``generate``'s ``finally`` runs when the consumer stops early
(``GeneratorExit`` from ``aclose()``, ``CancelledError``); it submits the abort without
awaiting it, because a closing async generator should not wait.
NOTE 3 (back-pressure): ``add`` refuses a request with ``TooManyWaitingRequestsError`` when
its ``n`` sequences would take the scheduler's waiting queue past ``max_waiting_requests``,
so a flood of clients costs a fast error (HTTP 503), not unbounded memory; an ``n`` past
the bound could never wait, and is a ``ValueError``.
NOTE 4 (outputs are routed in the engine thread): a request id may be used again as soon as
its consumer has gone, while the old request's step may still run; routing by id on the
event loop would hand that step's outputs to the new consumer. So ``_routes`` (engine request
to queue) lives in the engine thread: ``_add`` enters it, an abort or a finished output
removes it, ``_step`` pairs each output with its queue there; the old request's go to its old one.
NOTE 5 (an event loop of its own): the stepping task and its wake-up event belong to the
loop that created them. ``_start`` makes a new pair when the task is done (an
``asyncio.run`` returned and cancelled it) or its loop is closed; consumers of a closed loop
can never read again, so their requests are aborted. A second loop that is still open
while the first one steps is refused: the engine serves one loop at a time.
NOTE 6 (shutdown and a dead engine): ``shutdown`` stops the task, aborts in the engine
thread every request this front added (after any step in flight), stops the thread, and
ends every live consumer with ``EngineDeadError``; every later call raises it. A bug in the
stepping task ends the consumers the same way, and so does an executor whose worker
processes died (``multiproc_executor.py`` NOTE 3), as vLLM's ``generate`` raises it when its
engine core dies; an aborted request's stream ends with ``finish_reason="abort"``, as vLLM's.
NOTE 7 (tokenizing off the engine's thread): a text prompt is tokenized by a
``PromptTokenizer`` (``engine/prompt_tokenizer.py``), a copy of the tokenizer on a thread of
its own, so a 10 MB prompt never stops the other requests' steps: the engine thread gets at
most ``max_model_len`` ids. The server renders chat templates with that copy (``self.tokenizer``).
NOTE 8 (beam search, vLLM's ``EngineClient.beam_search`` in ``vllm/engine/protocol.py``):
``LLM.beam_search`` for one prompt, from the same pieces (``beam_search.py``): every check
first, then each step runs the live beams' one-token requests concurrently through
``generate`` (ids ``<request_id>-beam-<step>-<i>``); one final output, a completion per
beam. A consumer that leaves cancels the step's tasks; each ``generate`` aborts (NOTE 2).
NOTE 9 (pooling, vLLM's ``AsyncLLM.encode``): on a pooling engine (``docs/pooling.md``) ``encode``
is ``generate``'s path with ``PoolingParams``: the same queue, tokenizer thread, waiting bound
and abort; it yields one finished ``PoolingRequestOutput``. The input processor refuses a kind
of params the engine does not run (``input_processor.py`` NOTE 8).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tinyvllm.beam_search import (
    BeamSearchInstance, BeamSearchParams, BeamSearchSequence, advance_all, beam_step_params, candidates, check_room, completion_outputs,
    live_beams, search_outputs, token_prompt,
)  # fmt: skip
from tinyvllm.engine.engine_args import EngineArgs
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.engine.prompt_tokenizer import PromptTokenizer
from tinyvllm.exceptions import EngineDeadError  # re-exported: it lived here first
from tinyvllm.outputs import PoolingRequestOutput, RequestMetrics, RequestOutput
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.validation import check_int

ENGINE_THREAD = "tinyvllm-engine"  # the engine thread's name prefix (NOTE 1)


class TooManyWaitingRequestsError(RuntimeError):
    """The scheduler already holds ``max_waiting_requests`` waiting requests (NOTE 3)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine, taken in the worker thread after every engine call."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of the pool's blocks in use, in [0, 1]
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    spec_num_drafts: int = 0  # speculative decoding since start (Scheduler.spec_stats)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()


class AsyncLLM:
    """Serve one engine to concurrent asyncio callers (an ``LLM``'s too: ``AsyncLLM(llm.engine)``)."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 256) -> None:
        self.engine = engine
        self._owns_engine = False  # an engine handed in stays its owner's to shut down
        self.input_processor = engine.input_processor  # prompts to checked requests (input_processor.py)
        self.max_model_len = self.input_processor.max_model_len
        self.prompt_tokenizer = PromptTokenizer(engine.tokenizer, self.max_model_len)  # NOTE 7
        self.tokenizer = self.prompt_tokenizer.tokenizer  # the tokenizer thread's copy
        self.max_waiting_requests = check_int("max_waiting_requests", max_waiting_requests, 1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=ENGINE_THREAD)  # NOTE 1
        self._queues: dict[str, asyncio.Queue] = {}  # the event loop's side: ids with a live consumer
        self._routes: dict[str, asyncio.Queue] = {}  # the engine thread's side: engine request -> queue (NOTE 4)
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._dead: BaseException | None = None  # why no request can be served any more (NOTE 6)
        self.stats = self._snapshot()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, max_waiting_requests: int = 256) -> AsyncLLM:
        """Build the engine from the arguments (``LLMEngine.from_engine_args``) and serve it."""
        async_llm = cls(LLMEngine.from_engine_args(engine_args), max_waiting_requests)
        async_llm._owns_engine = True  # built here, so shutdown() stops its workers too
        return async_llm

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (``engine_args.py`` NOTE 5), as ``LLM``'s."""
        return SamplingParams(**self.input_processor.generation_defaults)

    # --8<-- [start:generate]
    async def generate(
        self, prompt: str | dict, sampling_params: SamplingParams | PoolingParams, request_id: str, *, priority: int = 0
    ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Add the request and yield its outputs (as ``sampling_params.output_kind`` asks) until it finishes.

        It ends after the output with ``finished=True``: the last one of a finished request,
        or the ``finish_reason="abort"`` one after ``abort(request_id)``. Raises what
        the input processor raises for a bad request, ``ValueError`` for a request id in
        use, ``TooManyWaitingRequestsError`` past the waiting bound (NOTE 3), the step's own
        exception when a step fails, ``EngineDeadError`` after ``shutdown`` (NOTE 6). A
        ``priority`` other than 0 needs ``scheduling_policy="priority"`` (lower runs sooner).
        """
        self._start()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            prompt = await self._tokenized(prompt)  # NOTE 7: off the engine's thread
            await self.run_in_engine_thread(self._add, prompt, sampling_params, request_id, queue, priority)
            self._wake.set()
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if self._queues.get(request_id) is queue:
                del self._queues[request_id]
            if not finished and self._dead is None:  # stopped early, or the add failed (NOTE 2)
                self._executor.submit(self._abort_route, request_id, queue)
    # --8<-- [end:generate]

    # --8<-- [start:encode]
    async def encode(
        self, prompt: str | dict, pooling_params: PoolingParams, request_id: str, *, priority: int = 0
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Add a pooling request and yield its one ``PoolingRequestOutput`` (NOTE 9), on an engine
        built with ``runner="pooling"``. Raises as ``generate`` does; ``TypeError`` for params
        that are not ``PoolingParams``, ``ValueError`` from a generating engine."""
        if not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {pooling_params!r}")
        async with contextlib.aclosing(self.generate(prompt, pooling_params, request_id, priority=priority)) as outputs:
            async for out in outputs:  # aclosing: a consumer that leaves closes generate, which aborts (NOTE 2)
                yield out
    # --8<-- [end:encode]

    # --8<-- [start:beam_search]
    async def beam_search(self, prompt: str | dict, request_id: str, params: BeamSearchParams) -> AsyncIterator[RequestOutput]:
        """Yield one finished output: the ``params.beam_width`` best beams of ``prompt``, best
        first, one completion each (NOTE 8). Everything is checked before the first step
        (``ValueError``/``TypeError`` as ``LLM.beam_search`` raises them); its metrics are the
        search's arrival and end and the first step's scheduling and first token."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {params!r}")
        self._start()
        processor = self.input_processor
        step_params = beam_step_params(params, processor.max_logprobs)
        arrival = time.perf_counter()
        prompt = await self._tokenized(prompt)  # NOTE 7
        request = processor.process_inputs(f"{request_id}-beam", prompt, step_params, 0, "params")
        instance = check_room(0, request.prompt_token_ids, request.cache_salt, processor.max_model_len)
        eos = frozenset() if params.ignore_eos else processor.eos_token_ids
        first: RequestMetrics | None = None
        for step in range(params.max_tokens):
            if not (beams := live_beams([instance])):
                break
            outputs = await self._beam_step(beams, instance, step_params, f"{request_id}-beam-{step}")
            first = first or _earliest_times(outputs)
            advance_all([instance], [candidates(out) for out in outputs], params, eos, processor.max_model_len)
        decode = lambda ids, skip: self.tokenizer.decode(list(ids), skip_special_tokens=skip)  # noqa: E731
        (output,) = await self.run_in_tokenizer_thread(search_outputs, [instance], params, eos, decode)
        metrics = RequestMetrics(arrival, first and first.first_token_time, time.perf_counter(), first and first.scheduled_time)
        yield RequestOutput(request_id, request.prompt, list(request.prompt_token_ids), completion_outputs(output),
                            finished=True, num_cached_tokens=0, metrics=metrics)  # fmt: skip

    async def _beam_step(
        self, beams: list[BeamSearchSequence], instance: BeamSearchInstance, params: SamplingParams, prefix: str
    ) -> list[RequestOutput]:
        """One step's requests, one per live beam, run concurrently; if this is cancelled or
        one of them fails, the others are cancelled, so none is left in the engine (NOTE 8)."""

        async def last(prompt: dict, request_id: str) -> RequestOutput:
            async for out in self.generate(prompt, params, request_id):
                final = out
            return final

        tasks = [asyncio.ensure_future(last(token_prompt(beam, instance.cache_salt), f"{prefix}-{i}"))
                 for i, beam in enumerate(beams)]  # fmt: skip
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # each generate's finally aborts its request (NOTE 2)
                task.cancel()
            raise
    # --8<-- [end:beam_search]

    async def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its ``generate`` yields a last output with
        ``finish_reason="abort"`` and ends. An unknown or finished id is ignored."""
        self._deliver(await self.run_in_engine_thread(self._abort, request_id))

    async def run_in_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine's thread, between two steps (NOTE 1)."""
        if self._dead is not None:
            raise self._dead_error()
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def call_in_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine's thread, between two steps, and wait for it: for a
        caller outside the event loop (a trace of the served engine, a notebook). Not from the
        engine's own thread, which would wait for itself."""
        if threading.current_thread().name.startswith(ENGINE_THREAD):
            raise RuntimeError(f"call_in_engine_thread({fn!r}) from the engine's own thread would wait for itself")
        if self._dead is not None:
            raise self._dead_error()
        return self._executor.submit(fn, *args).result()

    async def run_in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the tokenizer's thread (NOTE 7), where ``self.tokenizer`` may be used."""
        if self._dead is not None:
            raise self._dead_error()
        return await self.prompt_tokenizer.run(fn, *args)

    # --8<-- [start:tokenized]
    async def _tokenized(self, prompt: str | dict) -> str | dict:
        """The prompt with its token ids, tokenized on the tokenizer's thread (NOTE 7); a prompt of
        more than ``max_model_len`` ids is refused here. Anything else is left to the input processor."""
        tokenizer = self.prompt_tokenizer
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": await self.run_in_tokenizer_thread(tokenizer.encode, prompt)}
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            ids = await self.run_in_tokenizer_thread(tokenizer.encode, prompt["prompt"])
            return {**prompt, "prompt_token_ids": ids}
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), (list, tuple)):
            tokenizer.check_length(len(prompt["prompt_token_ids"]))
        return prompt
    # --8<-- [end:tokenized]

    # --8<-- [start:shutdown]
    async def shutdown(self) -> None:
        """Stop serving (NOTE 6): the stepping task stops, the requests this front added are
        aborted (the engine is left with none of them), every live ``generate`` raises
        ``EngineDeadError``, and so does every later call. Calling it again does nothing."""
        if self._dead is not None and self._executor is None:
            return
        if self._dead is None:
            self._dead = EngineDeadError("AsyncLLM.shutdown() was called")
        task, loop = self._loop_task, asyncio.get_running_loop()
        if task is not None and not task.done() and task.get_loop() is loop:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.prompt_tokenizer.shutdown()
        executor, self._executor = self._executor, None
        await loop.run_in_executor(executor, self._abort_all)  # after any step still in flight
        executor.shutdown(wait=True)
        if self._owns_engine:
            self.engine.shutdown()
        self._end_consumers()
    # --8<-- [end:shutdown]

    # -- the background task ---------------------------------------------------------

    # --8<-- [start:start]
    def _start(self) -> None:
        """Make sure the stepping task runs in the running loop (NOTE 5)."""
        if self._dead is not None:
            raise self._dead_error()
        loop = asyncio.get_running_loop()
        task = self._loop_task
        if task is not None and not task.done():
            if task.get_loop() is loop:
                return
            if not task.get_loop().is_closed():
                raise RuntimeError("this AsyncLLM is serving another event loop, which is still open")
        if self._queues:  # consumers of a loop that is gone can never read again: abort them
            self._queues.clear()
            self._executor.submit(self._abort_all)
        self._wake = asyncio.Event()
        self._loop_task = loop.create_task(self._run_loop())
    # --8<-- [end:start]

    # --8<-- [start:run_loop]
    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                deliveries, busy = await loop.run_in_executor(self._executor, self._step)
                self._deliver(deliveries)
                if not busy:  # nothing to step: sleep until generate() adds a request
                    await self._wake.wait()
                    self._wake.clear()
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a bug: tell every consumer rather than hang them
            self._dead = error
            self._end_consumers()
            if not isinstance(error, EngineDeadError):  # a dead executor is no bug of this task
                raise
    # --8<-- [end:run_loop]

    @staticmethod
    def _deliver(deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
        """Hand outputs to their consumers' queues, on the event loop's thread (NOTE 1)."""
        for queue, item in deliveries:
            queue.put_nowait(item)

    def _end_consumers(self) -> None:
        for queue in self._queues.values():
            queue.put_nowait(self._dead_error())

    def _dead_error(self) -> EngineDeadError:
        if isinstance(self._dead, EngineDeadError):
            return EngineDeadError(*self._dead.args)
        error = EngineDeadError(f"the engine stopped: {self._dead!r}")
        error.__cause__ = self._dead
        return error

    # -- what runs in the worker thread (NOTE 1) -------------------------------------

    def _add(
        self, prompt: str | dict, params: SamplingParams | PoolingParams, request_id: str, queue: asyncio.Queue, priority: int = 0
    ) -> None:
        request = self.input_processor.process_inputs(request_id, prompt, params, priority=priority)
        params = request.sampling_params
        bound, waiting = self.max_waiting_requests, len(self.engine.scheduler.waiting)
        if params.n > bound:  # NOTE 3: it could never be queued, so not "try again later"
            raise ValueError(f"n={params.n} sequences can never wait together: max_waiting_requests {bound}")
        if waiting + params.n > bound:  # NOTE 3
            raise TooManyWaitingRequestsError(
                f"{waiting} requests are waiting, the most this server queues is {bound} (max_waiting_requests)"
                f"{'' if params.n == 1 else f' and this one adds n={params.n}'}; try again later"
            )
        self.engine.add_core_request(request)
        self._routes[request_id] = queue
        self.stats = self._snapshot()

    def _abort(self, request_id: str) -> list[tuple[asyncio.Queue, RequestOutput]]:
        """An explicit abort: the consumer gets the request's final output."""
        queue = self._routes.pop(request_id, None)
        outputs = self.engine.abort_request(request_id)
        self.stats = self._snapshot()
        return [(queue, out) for out in outputs if queue is not None]

    def _abort_route(self, request_id: str, queue: asyncio.Queue) -> None:
        """A consumer stopped early: abort its request, unless the id now belongs to a newer one."""
        if self._routes.get(request_id) is queue:
            del self._routes[request_id]
            self.engine.abort_request(request_id)
            self.stats = self._snapshot()

    def _abort_all(self) -> None:
        self.engine.abort_request(list(self._routes))
        self._routes.clear()
        self.stats = self._snapshot()

    # --8<-- [start:step]
    def _step(self) -> tuple[list[tuple[asyncio.Queue, RequestOutput | BaseException]], bool]:
        """One engine step: ``([(queue, output or the step's error)], more to do)``."""
        if not self.engine.has_unfinished_requests():
            return [], False
        before = self.engine.unfinished_request_ids()
        deliveries: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []
        try:
            for out in self.engine.step():
                queue = self._routes.pop(out.request_id, None) if out.finished else self._routes.get(out.request_id)
                if queue is not None:  # None: not added here, or its consumer has gone
                    deliveries.append((queue, out))
        except EngineDeadError:  # no step can run again: the run loop ends every consumer (NOTE 6)
            raise
        except Exception as error:  # the engine aborted the step's requests (llm_engine.py NOTE 1)
            for request_id in before - self.engine.unfinished_request_ids():
                queue = self._routes.pop(request_id, None)
                if queue is not None:
                    deliveries.append((queue, error))
        self.stats = self._snapshot()
        return deliveries, self.engine.has_unfinished_requests()
    # --8<-- [end:step]

    def _snapshot(self) -> EngineStats:
        scheduler = self.engine.scheduler
        manager = scheduler.kv_cache_manager
        prefix = manager.prefix_cache_stats
        return EngineStats(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            kv_cache_usage=manager.usage,
            num_free_blocks=manager.block_pool.get_num_free_blocks(),
            num_blocks=manager.num_gpu_blocks,
            prefix_cache_queries=prefix.queries if prefix is not None else 0,
            prefix_cache_hits=prefix.hits if prefix is not None else 0,
            num_preemptions=scheduler.num_preemptions,
            spec_num_drafts=scheduler.spec_stats.num_drafts,
            spec_num_draft_tokens=scheduler.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=scheduler.spec_stats.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=tuple(scheduler.spec_stats.num_accepted_tokens_per_pos),
        )


def _earliest_times(outputs: list[RequestOutput]) -> RequestMetrics:
    """The earliest first-token and scheduling times of one step's outputs (NOTE 8)."""
    firsts = [t for out in outputs if (t := out.metrics.first_token_time) is not None]
    scheduled = [t for out in outputs if (t := out.metrics.scheduled_time) is not None]
    return RequestMetrics(0.0, min(firsts, default=None), None, min(scheduled, default=None))


def with_output_kind(params: SamplingParams, kind) -> SamplingParams:
    """``params`` with another ``output_kind`` (a new frozen instance, checked again)."""
    return params if params.output_kind == kind else dataclasses.replace(params, output_kind=kind)
