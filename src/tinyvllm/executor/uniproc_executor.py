"""UniProcExecutor: the executor with one worker, in the engine's own process.

Concept: the simplest executor: it builds one ``Worker`` (the "driver worker") in this
process, sets up its device and loads the weights; ``collective_rpc`` calls the named
method on that worker directly and returns its result in a one-element list. A worker's
exception reaches the caller unchanged, as it would from a plain call (``LLMEngine``
undoes a failed step on it).

Mirrors: ``vllm/v1/executor/uniproc_executor.py`` (``UniProcExecutor``: ``_init_executor``,
``collective_rpc``, ``driver_worker``) and ``vllm/v1/serial_utils.py`` (``run_method``).

Invariants: one worker, ``driver_worker``; every call runs in the caller's thread, in order.

``ExecutorWithExternalLauncher`` is the same executor for one rank of a ``torchrun`` job
(``distributed_executor_backend="external_launcher"``, NOTE 2).

NOTE 1 (``driver_worker``): tests, benches and the step recorder read the worker's runner
through it (``LLMEngine.model_runner``); the engine itself calls only the executor.
NOTE 2 (an external launcher): ``torchrun --nproc-per-node N script.py`` starts N processes,
each with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and the rendezvous in its environment;
each builds the same engine and feeds it the same prompts, and its one worker joins the group
as ``RANK`` (``env://``). The ranks must choose the same number of KV blocks, so the bytes
each may take are reduced to their minimum over the group, as vLLM's executor does. Each rank
calls ``shutdown`` (``LLM.shutdown``) when it is done: a barrier, then the group is left, so
no rank tears its connections down while another still talks to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tinyvllm.distributed.parallel_state import get_tp_group
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


class ExecutorWithExternalLauncher(UniProcExecutor):
    """One rank of a ``torchrun`` job: one worker in this process, ranked by ``RANK`` (NOTE 2)."""

    def _init_executor(self) -> None:
        world_size = self.config.parallel_config.world_size
        launched = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
        if None in launched.values():
            raise ValueError(
                "distributed_executor_backend='external_launcher' runs under torchrun (or another launcher that sets "
                f"RANK and WORLD_SIZE); the environment has {launched}"
            )
        if int(launched["WORLD_SIZE"]) != world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} != the launcher's WORLD_SIZE {launched['WORLD_SIZE']}"
            )
        self.driver_worker = Worker(
            self.config, self.eos_token_id, rank=int(launched["RANK"]), distributed_init_method="env://"
        )  # fmt: skip
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def determine_available_memory(self) -> list[int]:
        """This rank's bytes, lowered to the group's minimum (NOTE 2)."""
        mine = torch.tensor([super().determine_available_memory()[0]], dtype=torch.int64, device=self.driver_worker.device)
        group = get_tp_group()
        if group.world_size > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group.group)
        return [int(mine.item())]

    def shutdown(self) -> None:
        """Wait for every rank to finish (NOTE 2), then leave the group; a second call does nothing."""
        if not self.is_closed:
            get_tp_group().barrier()
        super().shutdown()
