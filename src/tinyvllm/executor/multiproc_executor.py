"""MultiprocExecutor: a worker process per tensor-parallel rank, driven from the engine's process.

Concept: with ``tensor_parallel_size`` N > 1 (``distributed_executor_backend="mp"``) the
engine's process holds no model: it spawns N processes (NOTE 1), rank r builds
``Worker(config, eos, rank=r, distributed_init_method="tcp://127.0.0.1:<port>")`` and runs
``worker_loop``: receive a call, run it (``run_method``), send back its result or its
exception. ``collective_rpc`` pickles a call once and writes that one message to every
rank's pipe (NOTE 2), then reads the replies in rank order; a step keeps rank 0's
``ModelRunnerOutput`` (the other ranks send ``None``: vLLM's ``output_rank``), and an async
step is one message, not waited for, read back with one reply (NOTE 7). Every rank runs
every step on the same ``SchedulerOutput`` with the same seed, so all sample alike.

Mirrors: ``vllm/v1/executor/multiproc_executor.py`` (``MultiprocExecutor``, ``WorkerProc``,
``worker_busy_loop``, ``start_worker_monitor``) and ``vllm/distributed/device_communicators/
shm_broadcast.py`` (the broadcast of each call, here a pipe per rank, NOTE 2).

Invariants: ``collective_rpc`` returns one result per rank, in rank order, or raises; each
rank sends exactly one reply per message, and replies are read in message order (NOTE 5);
step outputs come back in launch order, each once; after a failed step none is kept; once a
worker died or failed, every call raises ``EngineDeadError``; after ``shutdown`` no worker
process is left.

NOTE 1 (spawn): workers start with ``multiprocessing``'s "spawn" (a fresh interpreter: no
forked CUDA state, no copied threads), as vLLM does; a script that builds an engine with N >
1 therefore needs an ``if __name__ == "__main__":`` guard, since spawn imports the main module.
NOTE 2 (the step's message): one ``pickle.dumps`` per call, its bytes written to each rank's
pipe: N writes of some kilobytes per step (``bench/tensor_parallel.py --part message``
measures it at 1 / 32 / 256 decoding requests). vLLM broadcasts through a shared-memory ring
buffer, which saves the N - 1 extra writes; at two ranks and these sizes a pipe is enough.
``SchedulerOutput`` keeps its maps read-only (``MappingProxyType``), which pickle refuses:
this module teaches pickle to send one as the dict it shows (``copyreg``).
NOTE 3 (the monitor): a thread waits on the worker processes' sentinels; a worker that exits
(killed, out of memory, a crash) marks the executor dead and kills the other ranks, which
would otherwise wait in a collective for the group's timeout (``parallel_state.py`` NOTE 2).
A reply that carries an exception does the same (a rank that failed mid-step leaves the
others' state unknown); the caller gets ``EngineDeadError`` from a step, the rank's own
exception (noted with the rank and its traceback) from any other call. The caller waiting on replies wakes on the dead pipe and raises
``EngineDeadError`` within seconds: no hang.
NOTE 4 (no orphans): ``shutdown`` asks every rank to release its worker, sends the empty
message that ends ``worker_loop``, waits, then terminates and kills what is left; a
``weakref.finalize`` runs the same stop when the executor is collected or the interpreter
exits. Workers ignore SIGINT (Ctrl-C reaches the parent, which shuts them down), watch a pipe
from the parent and exit on its EOF (the parent was killed), and on Linux ask the kernel
for SIGKILL when the parent dies (``PR_SET_PDEATHSIG``; only when the executor is built on
the main thread, since the signal follows the thread that started the process).
NOTE 5 (Ctrl-C mid-call): a ``KeyboardInterrupt`` while replies are awaited leaves them
owed (with those a rank already sent); the next call reads them first, in order, keeping
any step outputs they carry, so a step's ``result()`` can be asked again and the engine can
undo a step (``llm_engine.py`` NOTE 1) and go on. SIGINT is held back while a message is
written, so it reaches every rank or none (one left out would wait in the collectives).
NOTE 6 (a device per rank): with NCCL each rank takes its own GPU, rank r ``cuda:r`` (the
engine refused more ranks than GPUs, ``engine_args.py`` NOTE 10); with gloo, ranks share the
device the engine was given (two ranks on one GPU: a correctness check, not a speed-up). On
the CPU, N ranks with torch's own thread count each would ask N times the cores there are:
a rank given no ``torch_threads`` takes an N-th of this process's.
NOTE 7 (async steps): ``execute_model(..., non_block=True)`` writes ``launch_step`` and
returns; the reply to step N+1's launch carries step N's output, kept until its
``result()`` takes it (``step_replies.py``); any call reads past owed replies the same way.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from types import MappingProxyType
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.core.sched_output import GrammarOutput, SchedulerOutput
from tinyvllm.distributed.parallel_state import default_backend
from tinyvllm.exceptions import EngineDeadError
from tinyvllm.executor.abstract import Executor, StepFuture
from tinyvllm.executor.step_replies import StepMessage, StepReplies, StepReply, flush_steps, launch_step, sample_step
from tinyvllm.executor.uniproc_executor import run_method
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.worker.worker import Worker

SHUTDOWN_TIMEOUT_S = 10.0  # a rank's time to release its worker before it is terminated


STEP_CALLS = (
    "execute_model", "execute_model_async", "sample_tokens_async", "take_async_output", "take_draft_token_ids",
    "launch_step", "sample_step", "flush_steps",  # step_replies.py
)  # fmt: skip  a failure there: EngineDeadError


def read_only(mapping: dict) -> MappingProxyType:
    """What a pickled ``MappingProxyType`` is rebuilt with (NOTE 2)."""
    return MappingProxyType(mapping)


copyreg.pickle(MappingProxyType, lambda proxy: (read_only, (dict(proxy),)))  # NOTE 2


def rank_config(config: EngineConfig, rank: int, backend: str) -> EngineConfig:
    """The config rank ``rank`` builds its worker from (NOTE 6): its own GPU under NCCL; on
    the CPU, with no thread count given, an equal share of this process's torch threads."""
    device_config = config.device_config
    if backend == "nccl" and device_config.device.startswith("cuda"):
        device_config = dataclasses.replace(device_config, device=f"cuda:{rank}")
    elif device_config.device == "cpu" and device_config.torch_threads is None:
        import torch

        share = max(1, torch.get_num_threads() // config.parallel_config.world_size)
        device_config = dataclasses.replace(device_config, torch_threads=share)
    return config if device_config == config.device_config else dataclasses.replace(config, device_config=device_config)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now, for the group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the worker process ----------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (NOTE 4)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _exit_on_eof(death_pipe: Connection) -> None:
    """Block until the parent's end of ``death_pipe`` closes, then leave at once (NOTE 4)."""
    try:
        death_pipe.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _failure(error: BaseException) -> tuple:
    """A reply carrying ``error``: pickled when it can be, always its repr and traceback."""
    text = "".join(traceback.format_exception(error))
    try:
        blob = pickle.dumps(error)
    except Exception:
        blob = None
    return (False, blob, repr(error), text)


def worker_main(
    rank: int, config: EngineConfig, eos_token_id: int | None, init_method: str,
    calls: Connection, replies: Connection, death_pipe: Connection, parent_pid: int, pdeathsig: bool,
) -> None:  # fmt: skip
    """A worker process's body: the guards (NOTE 4), the ``Worker``, then ``worker_loop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if pdeathsig:
        _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the guard was set
        os._exit(1)
    threading.Thread(target=_exit_on_eof, args=(death_pipe,), daemon=True, name="tinyvllm-parent-watch").start()
    try:
        worker = Worker(config, eos_token_id, rank=rank, distributed_init_method=init_method)
    except BaseException as error:
        replies.send(_failure(error))
        return
    replies.send((True, None))
    worker_loop(worker, rank, calls, replies)


# --8<-- [start:worker_loop]
def worker_loop(worker: object, rank: int, calls: Connection, replies: Connection) -> None:
    """Serve calls until the empty message or the parent's end closes: each message is one
    pickled ``(method, args, kwargs, output_rank)``; each gets exactly one reply."""
    while True:
        try:
            message = calls.recv_bytes()
        except EOFError:  # the parent has gone
            return
        if not message:  # shutdown's last message (NOTE 4)
            return
        method, args, kwargs, output_rank = pickle.loads(message)
        try:
            result = run_method(worker, method, args, kwargs)
        except BaseException as error:  # the parent decides what it means (NOTE 3)
            replies.send(_failure(error))
            continue
        if output_rank is not None and output_rank != rank:
            result = None  # only the output rank's result travels back
        try:
            replies.send((True, result))
        except Exception as error:  # a result that cannot be pickled
            replies.send(_failure(error))
# --8<-- [end:worker_loop]


# -- the engine's side -------------------------------------------------------------------


def _stop_workers(procs: list, calls: list[Connection], death_pipes: list[Connection]) -> None:
    """End every worker process (NOTE 4): the empty message, a wait, then terminate and kill.
    Takes no executor, so ``weakref.finalize`` can run it after the executor is gone."""
    for conn in calls:
        try:
            conn.send_bytes(b"")
        except OSError:
            pass  # that worker is gone already
    for proc in procs:
        proc.join(SHUTDOWN_TIMEOUT_S)
    for pipe in death_pipes:
        pipe.close()  # a worker stuck anywhere sees EOF and leaves
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in calls:
        conn.close()


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C waits until the block ends (NOTE 5): Python's SIGINT handler, which runs on the
    main thread, is swapped for one that notes the signal, then put back and called."""
    if threading.current_thread() is not threading.main_thread():
        yield  # SIGINT's handler runs on the main thread only: nothing to hold here
        return
    caught: list[tuple] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])  # KeyboardInterrupt, now that every rank has the message
        elif caught and previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


# --8<-- [start:monitor]
def _monitor_workers(executor_ref: weakref.ref, procs: list) -> None:
    """The monitor thread (NOTE 3): wait until any worker process exits; unless the executor
    is shutting down (or gone), mark it dead, which kills the other ranks."""
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    ready = wait(list(sentinels))
    executor = executor_ref()
    if executor is None or executor.is_closed or executor._stopping:
        return
    rank = sentinels[ready[0]]
    proc = procs[rank]
    proc.join(1.0)
    executor._declare_dead(f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
# --8<-- [end:monitor]


class MultiprocExecutor(Executor):
    """A worker process per rank (module header)."""

    def _init_executor(self) -> None:
        world_size = self.config.parallel_config.world_size
        context = multiprocessing.get_context("spawn")  # NOTE 1
        init_method = f"tcp://127.0.0.1:{free_port()}"
        pdeathsig = threading.current_thread() is threading.main_thread()  # NOTE 4
        backend = default_backend(self.config.device_config.device.split(":")[0])
        self._stopping = False
        self._dead_reason: str | None = None
        self._procs, self._calls, self._replies, death_pipes = [], [], [], []
        # every message sent whose replies are not all read, oldest first: its name, and for a
        # step message the steps its reply brings (NOTE 7); the replies read to the oldest, by rank
        self._pending: deque[tuple[str, range | None]] = deque()
        self._head: dict[int, Any] = {}
        self._steps = StepReplies()  # NOTE 7
        self.messages_sent = [0] * world_size  # per rank, for tests and the bench
        self.replies_read = [0] * world_size
        for rank in range(world_size):
            call_out, call_in = context.Pipe(duplex=False)
            reply_out, reply_in = context.Pipe(duplex=False)
            death_out, death_in = context.Pipe(duplex=False)
            proc = context.Process(
                target=worker_main, name=f"tinyvllm-worker-{rank}", daemon=True,
                args=(rank, rank_config(self.config, rank, backend), self.eos_token_id, init_method, call_out, reply_in, death_out, os.getpid(), pdeathsig),
            )  # fmt: skip
            proc.start()
            for child_end in (call_out, reply_in, death_out):
                child_end.close()  # the child's copies only: EOF then means the child has gone
            self._procs.append(proc)
            self._calls.append(call_in)
            self._replies.append(reply_out)
            death_pipes.append(death_in)
        self._pending.append(("__init__", None))  # each rank's "ready" reply
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._calls, death_pipes)
        monitor = threading.Thread(
            target=_monitor_workers, args=(weakref.ref(self), self._procs), daemon=True, name="tinyvllm-worker-monitor"
        )  # fmt: skip
        monitor.start()
        try:
            self._read_through()  # every rank built its Worker
            self.collective_rpc("init_device")  # joins the process group
            self.collective_rpc("load_model")
        except BaseException:
            self._stopping = True
            self._finalizer()
            raise

    # --8<-- [start:collective_rpc]
    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None,
        output_rank: int | None = None,
    ) -> list[Any]:  # fmt: skip
        """Run ``method`` on every rank: one pickled message written to each rank's pipe
        (NOTE 2), then every reply owed read, in order (a step's output kept, NOTE 7), this
        call's last; with ``output_rank`` only that rank's result comes back (the others' None)."""
        self._send(method, args, kwargs, output_rank)
        return self._read_through()
    # --8<-- [end:collective_rpc]

    def _send(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None,
        output_rank: int | None = None, step: StepMessage | None = None,
    ) -> int | None:  # fmt: skip
        """Write one message to every rank and owe its replies; a step message's number (NOTE 7)."""
        self._check_alive()
        message = pickle.dumps((method, args, kwargs or {}, output_rank), protocol=pickle.HIGHEST_PROTOCOL)
        with _sigint_held():  # NOTE 5: every rank gets the message, or none
            for rank, conn in enumerate(self._calls):
                try:
                    conn.send_bytes(message)
                except OSError as error:  # its process has gone
                    raise self._declare_dead(f"worker rank {rank} cannot be reached ({error!r})") from error
                self.messages_sent[rank] += 1
            brings, number = self._steps.send(step) if step is not None else (None, None)
            self._pending.append((method if isinstance(method, str) else getattr(method, "__name__", repr(method)), brings))
        return number

    def _read_through(self) -> list[Any]:
        """Read every reply owed (NOTE 5); the results of the last message, in rank order."""
        results: list[Any] = []
        while self._pending:
            results = self._read_oldest()
        return results

    def _read_oldest(self) -> list[Any]:
        """Every rank's reply to the oldest message owed, in rank order, a step's outputs kept
        (NOTE 7); ``EngineDeadError`` when a rank dies or fails (NOTE 3)."""
        what, brings = self._pending[0]
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while len(self._head) < len(self._replies):
            waiting = {self._replies[rank]: rank for rank in range(len(self._replies)) if rank not in self._head}
            ready = wait([*waiting, *sentinels])
            for rank in sorted(waiting[c] for c in ready if c in waiting):  # the first failure seen wins
                try:
                    reply = self._replies[rank].recv()
                except (EOFError, OSError):
                    raise self._declare_dead(f"worker rank {rank} exited during {what}") from None
                self.replies_read[rank] += 1
                if not reply[0]:
                    raise self._failed(rank, what, reply)
                self._head[rank] = reply[1]
            for rank in (sentinels[s] for s in ready if s in sentinels):
                if rank not in self._head and self._replies[rank] not in ready:
                    self._procs[rank].join(1.0)  # reaped, so its exit code is known
                    raise self._declare_dead(f"worker rank {rank} exited with code {self._procs[rank].exitcode} during {what}")
            self._check_alive()  # the monitor may have declared it dead meanwhile
        self._pending.popleft()
        results = [self._head.pop(rank) for rank in range(len(self._replies))]
        if brings is not None:
            try:
                self._steps.received(brings, results[0])
            except RuntimeError as error:
                raise self._declare_dead(f"worker rank 0 answered {what} with the wrong outputs: {error}") from error
        return results

    def _failed(self, rank: int, what: str, reply: tuple) -> BaseException:
        """A rank raised: the executor is dead (NOTE 3). The error to raise: ``EngineDeadError``
        from it for a step, else the rank's own (a bad config at start-up reads as itself)."""
        _, blob, text, remote_traceback = reply
        try:
            error = pickle.loads(blob) if blob is not None else RuntimeError(text)
        except Exception:
            error = RuntimeError(text)
        error.add_note(f"tinyvllm: raised in worker rank {rank} during {what}:\n{remote_traceback}")
        dead = self._declare_dead(f"worker rank {rank} raised {text} during {what}")
        if what not in STEP_CALLS:
            return error
        dead.__cause__ = error
        return dead

    def _declare_dead(self, reason: str) -> EngineDeadError:
        """Mark the executor dead (the first reason stays) and kill every rank still running,
        so none waits in a collective (NOTE 3); the error every later call raises."""
        if self._dead_reason is None:
            self._dead_reason = reason
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        return EngineDeadError(f"the engine's worker processes are gone: {self._dead_reason}")

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(f"the engine's worker processes are gone: {self._dead_reason}")
        if self.is_closed:
            raise RuntimeError("the executor is shut down")

    # --8<-- [start:async_steps]
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False, defer_sampling: bool = False
    ) -> ModelRunnerOutput | StepFuture | None:
        """As ``Executor.execute_model`` (its NOTE 4), with only rank 0's output pickled back;
        with ``non_block`` one message, not waited for (NOTE 7)."""
        if not non_block:
            return self.collective_rpc("execute_model", args=(scheduler_output,), output_rank=0)[0]
        message = "forward" if defer_sampling else "launch"
        step = self._send(launch_step, (scheduler_output, defer_sampling), output_rank=0, step=message)
        return None if defer_sampling else StepReply(self._step_output, step)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> StepFuture:
        """As ``Executor.sample_tokens``: one message, not waited for (NOTE 7)."""
        return StepReply(self._step_output, self._send(sample_step, (grammar_output,), output_rank=0, step="sample"))

    def _step_output(self, step: int) -> ModelRunnerOutput:
        """Step ``step``'s output: read from the replies owed, in order, until it came; when no
        reply owed brings it, a flush brings it (NOTE 7)."""
        steps = self._steps
        self._check_alive()  # a dead executor fails every step in flight, outputs kept or not
        while step not in steps.outputs:
            if step < steps.dropped_below:
                raise RuntimeError(f"step {step}'s output was dropped: a failed step took the steps in flight down")
            if steps.needs_flush(step):
                self._send(flush_steps, output_rank=0, step="flush")
            elif not self._pending:
                raise RuntimeError(f"step {step}'s output was taken already")
            self._read_oldest()
        return steps.outputs.pop(step)

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        """The steps in flight failed together: their outputs, kept or owed, are dropped (NOTE 7)."""
        self._steps.drop()
        if self._dead_reason is None:  # a dead executor has nothing to undo
            super().recover_from_failed_step(failed_req_ids)  # reads every reply owed first
    # --8<-- [end:async_steps]

    def check_health(self) -> None:
        self._check_alive()

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' ids, rank order (tests check that none outlives the engine)."""
        return [proc.pid for proc in self._procs]

    # --8<-- [start:shutdown]
    def shutdown(self) -> None:
        """Release every rank's worker, then stop the processes (NOTE 4); a second call does nothing."""
        if self.is_closed:
            return
        if self._dead_reason is None:
            try:
                self.collective_rpc("shutdown")  # each rank leaves the process group
            except (EngineDeadError, OSError):
                pass  # a rank died meanwhile: it is stopped below all the same
        self._stopping = self.is_closed = True
        self._finalizer()
    # --8<-- [end:shutdown]
