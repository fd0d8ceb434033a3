"""Executor: the one door from the engine to the device, whatever number of workers is behind it.

Concept: the engine calls an executor, never a worker or a runner: ``determine_available_memory``,
``initialize_kv_cache``, ``execute_model`` each step, ``recover_from_failed_step`` after a
failed one, ``check_invariants`` between steps, ``check_health`` and ``shutdown``. Each is
written on the one general call, ``collective_rpc(method, args, kwargs)``: run ``method``
(a worker method's name, or a function taking the worker first) on every worker and return
their results in a list, in worker order. An executor with one worker in this process
(``uniproc_executor.py``) implements just that call; one with a worker per device would
send it to each (the tensor-parallel issue plugs in here). ``initialize_kv_caches`` is the
engine's side of start-up written on this interface (NOTE 1).

Mirrors: ``vllm/v1/executor/abstract.py`` (``Executor``) and ``vllm/v1/engine/core.py``
(``EngineCore._initialize_kv_caches``).

Invariants: after ``shutdown`` every call but ``shutdown`` raises ``RuntimeError``;
``execute_model`` returns the first (driver) worker's output; ``initialize_kv_caches``
returns the config with ``cache_config.num_gpu_blocks`` filled, the number of blocks every
worker allocated.

NOTE 1 (the number of KV blocks): every worker says how many bytes its KV cache may take;
the smallest answer decides, as in vLLM, so that every worker holds the same blocks. The
bytes become blocks (``worker/kv_cache.py``: capped at ``max_num_seqs`` requests of
``max_model_len`` tokens, at least one such request); ``num_gpu_blocks_override`` fixes the
number instead. Whatever decided it, the pool must fit in the memory the device has free
(``kv_cache.py`` NOTE 3) before any block is allocated.
NOTE 3 (reading the workers): what the engine reads of its workers after start-up (each
rank's ``StartupReport``, each rank's runner state for ``LLMEngine.check_invariants``)
travels as a call too, a module function run on every worker, so it works whether the
workers live in this process or in others (``multiproc_executor.py``). So do the bytes of a
block (a rank's cache holds only its KV heads) and the memory free on each device: the
engine's process never touches a GPU for them.
NOTE 4 (a step in flight): under async scheduling the engine launches a step before it reads
the last one back. ``execute_model(..., non_block=True)`` asks every worker to launch it
(the worker keeps the handle: ``worker.py`` NOTE 6) and returns a ``StepFuture``; its
``result()`` asks the workers for the oldest step's output. Two calls, so any executor
that can call its workers can run steps in flight; one whose calls cross a process
boundary makes it one message (``step_replies.py``). A step whose grammar mask needs the
tokens of the step before it is launched with ``defer_sampling``: its forward runs while the
engine reads that step back and makes the mask, then ``sample_tokens`` samples it (vLLM's
``execute_model`` and ``sample_tokens``).
NOTE 2 (the EOS id): the tokenizer's EOS travels to the worker's persistent batch
(``worker.py`` NOTE 3), beside the config: it is the tokenizer's, not the config's.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.core.sched_output import GrammarOutput, SchedulerOutput
from tinyvllm.outputs import DraftTokenIds, ModelRunnerOutput
from tinyvllm.worker.kv_cache import (
    available_memory_bytes,
    check_fits_one_request,
    check_kv_cache_fits,
    num_blocks_from_budget,
)
from tinyvllm.worker.startup_report import StartupReport


def worker_attribute(worker: object, name: str) -> Any:
    """``worker.name``, as a call every worker runs (NOTE 3; a module function pickles by name)."""
    return getattr(worker, name)


def device_free_bytes(worker: object) -> int | None:
    """The bytes free on the worker's device (``kv_cache.py`` NOTE 3), asked in its process."""
    return available_memory_bytes(worker.device)


@dataclasses.dataclass(frozen=True)
class RunnerView:
    """What ``LLMEngine.check_invariants`` compares with its scheduler (NOTE 3): for each
    request the runner holds, ``(block ids, output token ids)``; the ids in its batch."""

    requests: dict[str, tuple[list[int], list[int]]]
    batch_req_ids: tuple[str, ...]


def runner_view(worker: object) -> RunnerView:
    """The worker's ``RunnerView``, as a call every worker runs (NOTE 3)."""
    runner = worker.model_runner
    states = runner.requests
    return RunnerView(
        {rid: (list(s.block_ids), list(s.output_token_ids)) for rid, s in states.items()},
        tuple(runner.input_batch.req_id_to_index),
    )


class StepFuture:
    """A launched step's output, read back when asked, once (vLLM's ``Future[ModelRunnerOutput]``)."""

    def __init__(self, read_back: Callable[[], ModelRunnerOutput]) -> None:
        self._read_back: Callable[[], ModelRunnerOutput] | None = read_back
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._read_back is not None:
            read_back, self._read_back = self._read_back, None
            self._output = read_back()
        return self._output


class Executor(ABC):
    """The engine's door to its worker(s); subclasses implement ``_init_executor`` and
    ``collective_rpc`` (module header)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None = None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id  # NOTE 2
        self.is_closed = False
        self._init_executor()  # the worker(s): init_device, load_model

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the worker(s), set up each device and load the weights."""

    @abstractmethod
    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run ``method`` on every worker; their results, in worker order."""

    # --8<-- [start:interface]
    def determine_available_memory(self) -> list[int]:
        """Each worker's bytes for the KV cache."""
        return self.collective_rpc("determine_available_memory")

    def initialize_kv_cache(self, config: EngineConfig) -> None:
        """Allocate ``config.cache_config.num_gpu_blocks`` blocks, build the runner, capture."""
        self.collective_rpc("initialize_from_config", args=(config,))
        self.collective_rpc("compile_or_warm_up_model")

    # --8<-- [start:execute_model]
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False, defer_sampling: bool = False
    ) -> ModelRunnerOutput | StepFuture | None:
        """Run one step; with ``non_block`` (async scheduling) launch it and return a
        ``StepFuture`` whose ``result()`` reads it back, oldest step first (NOTE 4). With
        ``defer_sampling`` too, launch its forward only and return None: ``sample_tokens``."""
        if not non_block:
            return self.collective_rpc("execute_model", args=(scheduler_output,))[0]
        self.collective_rpc("execute_model_async", args=(scheduler_output, defer_sampling))
        return None if defer_sampling else StepFuture(lambda: self.collective_rpc("take_async_output")[0])

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts of the step whose forward waits for ``sample_tokens``, as rank 0's runner
        proposed them (every rank proposes the same; ``model_runner.py`` NOTE 14)."""
        return self.collective_rpc("take_draft_token_ids")[0]

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> StepFuture:
        """Sample the step whose forward ``execute_model(..., defer_sampling=True)`` launched,
        under ``grammar_output``'s mask (NOTE 4); its ``StepFuture``."""
        self.collective_rpc("sample_tokens_async", args=(grammar_output,))
        return StepFuture(lambda: self.collective_rpc("take_async_output")[0])
    # --8<-- [end:execute_model]

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        self.collective_rpc("recover_from_failed_step", args=(failed_req_ids,))

    def check_invariants(self) -> None:
        self.collective_rpc("check_invariants")

    def startup_reports(self) -> list[StartupReport]:
        """Each rank's start-up report, in rank order (NOTE 3)."""
        return self.collective_rpc(worker_attribute, args=("startup_report",))

    def check_health(self) -> None:
        """Raise ``RuntimeError`` when the executor cannot serve a step."""
        if self.is_closed:
            raise RuntimeError("the executor is shut down")

    def shutdown(self) -> None:
        """Release the worker(s); a second call does nothing."""
        if not self.is_closed:
            self.collective_rpc("shutdown")
            self.is_closed = True
    # --8<-- [end:interface]


# --8<-- [start:initialize_kv_caches]
def initialize_kv_caches(executor: Executor, config: EngineConfig) -> EngineConfig:
    """Size the KV cache from what the workers say they can hold (NOTE 1), have every worker
    allocate it, build its runner and capture; the config with ``num_gpu_blocks`` filled."""
    device, cache, scheduler = config.device_config, config.cache_config, config.scheduler_config
    per_block = max(executor.collective_rpc("kv_bytes_per_block"))  # a rank's block: its KV heads only (NOTE 3)
    available = min(executor.determine_available_memory())
    if device.num_gpu_blocks_override is not None:
        num_blocks = device.num_gpu_blocks_override
    else:
        num_blocks = num_blocks_from_budget(
            available, per_block, cache.block_size, scheduler.max_model_len, scheduler.max_num_seqs
        )  # fmt: skip
        check_fits_one_request(num_blocks, cache.block_size, scheduler.max_model_len)
    free = [b for b in executor.collective_rpc(device_free_bytes) if b is not None]  # asked where the devices are
    check_kv_cache_fits(num_blocks, per_block, min(free) if free else None)
    config = dataclasses.replace(config, cache_config=dataclasses.replace(cache, num_gpu_blocks=num_blocks))
    executor.initialize_kv_cache(config)
    return config
# --8<-- [end:initialize_kv_caches]
