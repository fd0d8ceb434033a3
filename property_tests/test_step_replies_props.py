"""The multiprocess executor's step messages (``executor/step_replies.py``), as a state machine.

Hypothesis drives the engine's side of async scheduling over a worker model that uses the
worker's own reply functions (``launch_step``, ``sample_step``, ``flush_steps`` and
``Worker.take_async_outputs``): launches (at most two steps in flight), forwards whose
sampling is deferred and their sampling, the oldest step's ``result()``, other calls that
read every reply owed, and failed steps. Replies are read lazily and in order, as
``MultiprocExecutor`` reads them. After every rule:

- every output the book keeps belongs to a step launched and not dropped;
- each step's output is taken once, in launch order, and is that step's own output (the
  book and the workers number the steps alike, failures included);
- a flush is sent only when no reply owed would bring the step.

At the end every step launched since the last failure is taken exactly once.
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

from hypothesis import stateful

from tinyvllm.executor.step_replies import StepReplies, flush_steps, launch_step, sample_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_executor import _Worker  # noqa: E402


class _FailingWorker(_Worker):
    """The executor tests' worker model (``Worker.take_async_outputs`` itself; a step's output
    is its number, counted one per sampling), which also drops its handles on a failure."""

    def recover_from_failed_step(self) -> None:
        self._async_outputs.clear()


class StepMessages(stateful.RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.worker, self.book = _FailingWorker(), StepReplies()
        self.pending: deque[tuple[range | None, list | None]] = deque()  # replies owed, oldest first
        self.in_flight: deque[int] = deque()  # step numbers whose result() the engine will ask
        self.deferred = False  # a forward launched, its sampling not yet
        self.taken: list[int] = []
        self.since_failure = 0  # the first step number after the last failure

    # -- the executor's side, as MultiprocExecutor does it ---------------------------------

    def _send(self, message: str, reply_of) -> int | None:
        brings, step = self.book.send(message)
        self.pending.append((brings, reply_of()))  # the worker answers in order; read later
        return step

    def _read_oldest(self) -> None:
        brings, reply = self.pending.popleft()
        if brings is not None:
            self.book.received(brings, reply)

    def _read_through(self) -> None:
        while self.pending:
            self._read_oldest()

    # -- the engine's moves -------------------------------------------------------------

    @stateful.precondition(lambda self: not self.deferred and len(self.in_flight) < 2)
    @stateful.rule()
    def launch(self) -> None:
        self.in_flight.append(self._send("launch", lambda: launch_step(self.worker, None, False)))

    @stateful.precondition(lambda self: not self.deferred and len(self.in_flight) < 2)
    @stateful.rule()
    def forward(self) -> None:
        assert self._send("forward", lambda: launch_step(self.worker, None, True)) is None
        self.deferred = True

    @stateful.precondition(lambda self: self.deferred)
    @stateful.rule()
    def sample(self) -> None:
        self.in_flight.append(self._send("sample", lambda: sample_step(self.worker, None)))
        self.deferred = False

    @stateful.precondition(lambda self: bool(self.in_flight))
    @stateful.rule()
    def result_of_the_oldest(self) -> None:
        step = self.in_flight.popleft()
        while step not in self.book.outputs:
            if self.book.needs_flush(step):
                brought = [s for brings, _ in self.pending if brings is not None for s in brings]
                assert step not in brought, f"a flush for step {step}, which a reply owed brings"
                self._send("flush", lambda: flush_steps(self.worker))
            assert self.pending, f"step {step}: no reply owed brings it, and no flush was sent"
            self._read_oldest()
        output = self.book.outputs.pop(step)
        assert output == step, f"step {step} got step {output}'s output"
        assert not self.taken or step > self.taken[-1], f"step {step} taken after step {self.taken[-1]}"
        self.taken.append(step)

    @stateful.rule()
    def another_call(self) -> None:
        """``check_invariants``, a recorder's read: its message, then every reply owed read."""
        self.pending.append((None, None))
        self._read_through()

    @stateful.precondition(lambda self: bool(self.in_flight) or self.deferred)
    @stateful.rule()
    def a_step_fails(self) -> None:
        """The engine undoes every step in flight; the executor drops the book, then its
        ``recover_from_failed_step`` call reads every reply owed and the workers drop theirs."""
        self.book.drop()
        self.pending.append((None, self.worker.recover_from_failed_step()))
        self._read_through()
        self.in_flight.clear()
        self.deferred = False
        self.since_failure = self.book.launched

    # -- what must hold ------------------------------------------------------------------

    @stateful.invariant()
    def the_book_keeps_only_live_steps(self) -> None:
        assert all(self.book.dropped_below <= s < self.book.launched for s in self.book.outputs), self.book.outputs
        assert self.book.launched == self.worker.launched, (self.book.launched, self.worker.launched)

    def teardown(self) -> None:
        while self.in_flight and not self.deferred:
            self.result_of_the_oldest()
        if not self.deferred:
            taken_since = [s for s in self.taken if s >= self.since_failure]
            assert taken_since == list(range(self.since_failure, self.book.launched)), (taken_since, self.since_failure)


TestStepMessages = StepMessages.TestCase
