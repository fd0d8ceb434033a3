"""Step replies: under async scheduling a step costs each worker process one message and one reply.

Concept: the multiprocess executor (``multiproc_executor.py``) writes a step's launch to every
rank and does not wait; a worker process replies to each message at once, in order, and the
reply to a launch carries the outputs of every step it held but the one just launched (NOTE
1). Launching step N+1 reads step N back inside the runner (``model_runner.py`` NOTE 12), so
step N's output is ready when N+1 is launched: it travels back as the launch's reply, and
``StepFuture.result()`` for step N reads that one reply. The functions below run in the worker
process (``launch_step``, ``sample_step``, ``flush_steps``); ``StepReplies`` is the executor's
book of which reply brings which step's output, and of the outputs received and not yet taken.

Mirrors: ``vllm/v1/executor/multiproc_executor.py`` (a non-blocking ``execute_model`` whose
future reads the step's reply from the response queue, in order) and ``WorkerProc`` (which
sends a step's output once its ``AsyncModelRunnerOutput`` is read).

Invariants: every output reaches the executor exactly once, in launch order, in the reply
``send`` said would bring it; each step's number is given once; after ``drop`` nothing is kept
and no output of an earlier step is ever kept again.

NOTE 1 (what a reply carries): the workers hold the steps ``held_from .. launched - 1``,
launched and not yet sent back. Every step message's reply carries all of them, but for a
launch (or a sampling) the step it adds stays held: its output is not ready. A forward
launched without its sampling (``defer_sampling``) adds no step, so its reply carries every
step held; a flush too. So the executor knows, when it writes a message, which steps its
reply brings, and ``result()`` knows whether any reply owed will bring its step.
NOTE 2 (the flush): when no reply owed brings a step (the engine launched nothing after it:
the queue drains, or a step read back at once), ``result()`` sends ``flush_steps`` and reads
its reply: the one case with a message only to read a step back.
NOTE 3 (why here, not a thread): vLLM's worker process sends a step's output as the reply to
that step's own message, from a thread that waits for it. A worker here serves one message
at a time (``worker_loop``), so the output of step N rides on the reply to the next
message, which the worker sends as soon as it has read N back anyway: no thread, no lock,
and replies stay in message order.
NOTE 4 (a failed step): the engine undoes every step in flight together; the executor then
reads every reply owed (keeping nothing it brings) and ``drop`` forgets the outputs kept, as
each worker forgets its handles (``Worker.recover_from_failed_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from tinyvllm.core.sched_output import GrammarOutput, SchedulerOutput
from tinyvllm.executor.abstract import StepFuture
from tinyvllm.outputs import ModelRunnerOutput

StepMessage = Literal["launch", "forward", "sample", "flush"]


# -- in the worker process ----------------------------------------------------------------


# --8<-- [start:worker_side]
def launch_step(worker: object, scheduler_output: SchedulerOutput, defer_sampling: bool) -> list[ModelRunnerOutput]:
    """Launch a step (its forward only, with ``defer_sampling``); reply with what NOTE 1 says."""
    worker.execute_model_async(scheduler_output, defer_sampling)
    return worker.take_async_outputs(keep_newest=not defer_sampling)


def sample_step(worker: object, grammar_output: GrammarOutput | None) -> list[ModelRunnerOutput]:
    """Sample the step whose forward was launched; reply with every step held but that one."""
    worker.sample_tokens_async(grammar_output)
    return worker.take_async_outputs(keep_newest=True)


def flush_steps(worker: object) -> list[ModelRunnerOutput]:
    """Every step held, read back (NOTE 2)."""
    return worker.take_async_outputs(keep_newest=False)
# --8<-- [end:worker_side]


# -- in the engine's process --------------------------------------------------------------


# --8<-- [start:book]
class StepReplies:
    """Which steps each step message's reply brings (NOTE 1), and the outputs received."""

    def __init__(self) -> None:
        self.launched = 0  # steps given a number so far: the next step's number
        self.held_from = 0  # the workers hold steps held_from .. launched - 1, no message sent to bring them
        self.dropped_below = 0  # a failed step dropped the outputs of every step below (NOTE 4)
        self.outputs: dict[int, ModelRunnerOutput] = {}  # received, not yet taken

    def send(self, message: StepMessage) -> tuple[range, int | None]:
        """A step message is written: the steps its reply brings, and the new step's number
        (None when it adds none: a deferred forward, a flush)."""
        if message not in ("launch", "forward", "sample", "flush"):
            raise ValueError(f"a step message is 'launch', 'forward', 'sample' or 'flush', not {message!r}")
        brings = range(self.held_from, self.launched)
        if message in ("forward", "flush"):
            self.held_from = self.launched
            return brings, None
        step = self.held_from = self.launched
        self.launched += 1
        return brings, step

    def received(self, brings: range, outputs: list[ModelRunnerOutput]) -> None:
        """Keep the outputs a reply carried; those of dropped steps are let go (NOTE 4)."""
        if len(outputs) != len(brings):
            raise RuntimeError(f"a step reply carried {len(outputs)} outputs, not the {len(brings)} of steps {brings}")
        for step, output in zip(brings, outputs):
            if step >= self.dropped_below:
                self.outputs[step] = output

    def needs_flush(self, step: int) -> bool:
        """No reply owed brings ``step``: the workers still hold it (NOTE 2)."""
        return step >= self.held_from

    def drop(self) -> None:
        """Forget every output kept and every step launched so far (NOTE 4)."""
        self.outputs.clear()
        self.held_from = self.dropped_below = self.launched
# --8<-- [end:book]


class StepReply(StepFuture):
    """A step's output, read from the replies when asked; a ``result()`` interrupted (Ctrl-C)
    leaves the reply owed, and asking again reads on."""

    def __init__(self, take: Callable[[int], ModelRunnerOutput], step: int) -> None:
        super().__init__(lambda: take(step))
        self.step = step

    def result(self) -> ModelRunnerOutput:
        if self._read_back is not None:
            self._output = self._read_back()  # kept until it returns
            self._read_back = None
        return self._output
