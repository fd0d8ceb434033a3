"""The engine requests of one HTTP request, as one stream of outputs.

Concept: a completion with a list of prompts runs one ``AsyncLLM.generate`` per prompt.
``first_outputs`` waits for each one's first output (so a refusal comes before the
answer's status, ``serving.py`` NOTE 1), and ``MergedOutputs`` then yields every later
output of every prompt as it comes, tagged with the prompt's index, feeding each
request's ``RequestTracker`` (``metrics.py``) on the way.

Mirrors: ``vllm/utils.merge_async_iterators``, which ``serving_completion.py`` uses to
merge the generators of a request's prompts.

Invariants: when either ends early (an error, a client that left), every generator it
was given is closed, which aborts its request in the engine (``async_llm.py`` NOTE 2); a
generator is never closed while another task iterates it (the tasks that do are
cancelled and awaited first).

NOTE 1 (cleanup that cancellation cannot interrupt): Starlette cancels a streamed
response whose client left through an anyio cancel scope, which cancels every ``await``
of the cancelled task, those of its ``finally`` blocks too. So the cleanup is
synchronous where it must not be cut short (``MergedOutputs.close``: cancel the pumping
tasks, end the trackers), and what must be awaited (the cancelled tasks, then closing
the generators) runs in a task of its own, ``close_later``, outside the scope.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tinyvllm.entrypoints.metrics import RequestTracker
from tinyvllm.outputs import RequestOutput

_cleanups: set[asyncio.Task] = set()  # close_later's tasks, held until done


def close_later(tasks: list[asyncio.Future], streams: list) -> None:
    """Cancel ``tasks`` now; await them and close ``streams`` in a task of its own (NOTE 1)."""
    for task in tasks:
        task.cancel()

    async def cleanup() -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()

    task = asyncio.ensure_future(cleanup())
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)


async def first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Every stream's first output. If one raises, the others are aborted and the first
    error, in prompt order, is raised."""
    tasks = [asyncio.ensure_future(stream.__anext__()) for stream in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    except BaseException:
        close_later(tasks, streams)
        raise


# --8<-- [start:merged]
class MergedOutputs:
    """``(prompt index, output)`` of every stream as they come, the first outputs first; the
    trackers see each one. ``close`` aborts what is unfinished (a client that left)."""

    def __init__(self, firsts: list[RequestOutput], streams: list, trackers: list[RequestTracker]) -> None:
        self.firsts, self.streams, self.trackers = firsts, streams, trackers
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(i, streams[i])) for i, out in enumerate(firsts) if not out.finished]
        self.closed = False

    async def _pump(self, index: int, stream) -> None:
        try:
            async for out in stream:
                self.queue.put_nowait((index, out))
        except Exception as error:  # the step's error: raised to the consumer
            self.queue.put_nowait((index, error))
        finally:
            self.queue.put_nowait((index, None))

    async def __aiter__(self):
        for index, out in enumerate(self.firsts):
            self.trackers[index].output(out)
            yield index, out
        remaining = len(self.tasks)
        while remaining:
            index, item = await self.queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                self.trackers[index].output(item)
                yield index, item

    def close(self) -> None:
        """Synchronous (NOTE 1): the finished streams end as they are, the others are aborted."""
        if self.closed:
            return
        self.closed = True
        close_later(self.tasks, self.streams)
        for tracker in self.trackers:
            tracker.end()  # a no-op for the finished; the rest count as aborted
# --8<-- [end:merged]
