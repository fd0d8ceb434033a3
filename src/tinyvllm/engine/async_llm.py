"""AsyncLLM: many concurrent callers, one engine, ``async for out in engine.generate(...)``.

Concept: an ``asyncio`` front for ``LLMEngine``. Each call of ``generate`` adds one
request and gets its own ``asyncio.Queue``; one background task steps the engine and
puts each ``RequestOutput`` into its request's queue. The engine is not thread-safe and
a step takes milliseconds to seconds, so every engine call (add, abort, step) runs in
ONE worker thread (NOTE 1): the event loop never blocks, and the engine never sees two
calls at once.

Mirrors: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``abort``), whose engine
core runs in another process and talks over ZeroMQ; here it is a thread and a queue.

Invariants: a request id has a queue exactly while its ``generate`` is being iterated;
a request whose consumer stops early (``break``, a closed stream, a cancelled task) is
aborted, so its KV blocks go back to the pool within one step.

NOTE 1 (one worker thread as the command queue): the executor has a single thread and
runs what it is given in order. While a step runs, adds and aborts wait in its queue and
run between that step and the next: the same order a lock or an explicit command queue
would give. Outputs come back to the event loop as the result of the awaited step, so
the queues are fed from the loop's own thread (no ``call_soon_threadsafe`` is needed).
Tokenizing a prompt and rendering a chat template run in that thread too: a Hugging Face
fast tokenizer must not be used by two threads at once.
NOTE 2 (abort on exit): ``generate``'s ``finally`` runs when the consumer stops early
(``GeneratorExit`` from ``aclose()``, ``CancelledError``); it submits the abort without
awaiting it, because a closing async generator should not wait.
NOTE 3 (back-pressure): ``add`` refuses a request with ``TooManyWaitingRequestsError``
when ``max_waiting_requests`` requests already wait in the scheduler, so a flood of
clients costs a fast error (HTTP 503), not unbounded memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.validation import check_int


class TooManyWaitingRequestsError(RuntimeError):
    """The scheduler already holds ``max_waiting_requests`` waiting requests (NOTE 3)."""


class EngineDeadError(RuntimeError):
    """The engine's background task stopped; no request can be served."""


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


class AsyncLLM:
    """Serve one ``LLM``'s engine to concurrent asyncio callers."""

    def __init__(self, llm, max_waiting_requests: int = 256) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.get_tokenizer()
        self.max_waiting_requests = check_int("max_waiting_requests", max_waiting_requests, 1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyvllm-engine")  # NOTE 1
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._dead: BaseException | None = None
        self.stats = self._snapshot()

    # --8<-- [start:generate]
    async def generate(
        self, prompt: str | dict, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its outputs (as ``sampling_params.output_kind`` asks) until it finishes.

        Raises what ``LLM.prepare_request`` raises for a bad request, ``ValueError`` for a
        request id in use, ``TooManyWaitingRequestsError`` past the waiting bound (NOTE 3).
        """
        self._start()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self.run_in_engine_thread(self._add, prompt, sampling_params, request_id)
            self._wake.set()
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            del self._queues[request_id]
            if not finished:  # the consumer stopped early, or the add failed (NOTE 2)
                self._executor.submit(self._abort, request_id)
    # --8<-- [end:generate]

    async def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its ``generate`` ends with no more outputs."""
        await self.run_in_engine_thread(self._abort, request_id)

    async def run_in_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine's thread, between two steps (NOTE 1)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}") from self._dead
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def shutdown(self) -> None:
        """Stop the background task and the worker thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # -- the background task ---------------------------------------------------------

    def _start(self) -> None:
        """Start the stepping task in the running loop, on the first request."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead!r}") from self._dead
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    # --8<-- [start:run_loop]
    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                outputs, failed, busy = await loop.run_in_executor(self._executor, self._step)
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:  # None: its consumer has gone; the abort is on its way
                        queue.put_nowait(out)
                for request_id, error in failed.items():
                    if request_id in self._queues:
                        self._queues[request_id].put_nowait(error)
                if not busy:  # nothing to step: sleep until generate() adds a request
                    await self._wake.wait()
                    self._wake.clear()
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a bug: tell every consumer rather than hang them
            self._dead = error
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(f"the engine stopped: {error!r}"))
            raise
    # --8<-- [end:run_loop]

    # -- what runs in the worker thread (NOTE 1) -------------------------------------

    def _add(self, prompt: str | dict, params: SamplingParams, request_id: str) -> None:
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.max_waiting_requests:  # NOTE 3
            raise TooManyWaitingRequestsError(
                f"{waiting} requests are waiting, the most this server queues (max_waiting_requests); try again later"
            )
        text, ids, params, salt = self.llm.prepare_request(0, prompt, params)
        self.engine.add_request(request_id, ids, params, prompt=text, cache_salt=salt)
        self.stats = self._snapshot()

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self.stats = self._snapshot()

    def _step(self) -> tuple[list[RequestOutput], dict[str, BaseException], bool]:
        """One engine step: ``(outputs, {failed request id: error}, more to do)``."""
        if not self.engine.has_unfinished_requests():
            return [], {}, False
        before = self.engine.unfinished_request_ids()
        try:
            outputs = self.engine.step()
            failed: dict[str, BaseException] = {}
        except Exception as error:  # the engine aborted the step's requests (llm_engine.py NOTE 1)
            outputs, failed = [], dict.fromkeys(before - self.engine.unfinished_request_ids(), error)
        self.stats = self._snapshot()
        return outputs, failed, self.engine.has_unfinished_requests()

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
        )


def with_output_kind(params: SamplingParams, kind) -> SamplingParams:
    """``params`` with another ``output_kind`` (a new frozen instance, checked again)."""
    return params if params.output_kind == kind else dataclasses.replace(params, output_kind=kind)
