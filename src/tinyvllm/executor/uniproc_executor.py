"""UniProcExecutor: the executor with one worker, in the engine's own process.

Concept: the simplest executor: it builds one ``Worker`` (the "driver worker") in this
process, sets up its device and loads the weights; ``collective_rpc`` calls the named
method on that worker directly and returns its result in a one-element list. A worker's
exception reaches the caller unchanged, as it would from a plain call (``LLMEngine``
undoes a failed step on it).

Mirrors: ``vllm/v1/executor/uniproc_executor.py`` (``UniProcExecutor``: ``_init_executor``,
``collective_rpc``, ``driver_worker``) and ``vllm/v1/serial_utils.py`` (``run_method``).

Invariants: one worker, ``driver_worker``; every call runs in the caller's thread, in order.

NOTE 1 (``driver_worker``): tests, benches and the step recorder read the worker's runner
through it (``LLMEngine.model_runner``); the engine itself calls only the executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tinyvllm.executor.abstract import Executor
from tinyvllm.worker.worker import Worker


def run_method(obj: object, method: str | Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """``obj.method(*args, **kwargs)`` for a name, ``method(obj, *args, **kwargs)`` for a function."""
    func = getattr(obj, method) if isinstance(method, str) else (lambda *a, **k: method(obj, *a, **k))
    return func(*args, **kwargs)


class UniProcExecutor(Executor):
    """One worker in this process (module header)."""

    def _init_executor(self) -> None:
        self.driver_worker = Worker(self.config, self.eos_token_id)  # NOTE 1
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if self.is_closed:
            raise RuntimeError("the executor is shut down")
        return [run_method(self.driver_worker, method, args, kwargs or {})]
