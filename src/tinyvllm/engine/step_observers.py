"""Step observers: who hears of each engine step, and of a launch no read-back follows.

Concept: ``LLMEngine`` keeps a tuple of observers (``add_observer``, ``remove_observer``).
After every step, a failed one too (after its undo, with the error), each observer's
``on_step(engine, scheduler_output, core_outputs, error)`` is called, in the order they
were added. The trace recorder (``trace/recorder.py``) and a server's metrics
(``entrypoints/metrics.py``: the tokens of each step) are the two in the tree, and they
watch one engine side by side. An observer may also have ``on_launch(engine,
scheduler_output)``: under async scheduling it is called when a step is launched and the
call returns before reading any step back (the first step after the engine was idle), so a
trace can picture that launch (``trace/in_flight.py`` NOTE 3).

Mirrors: nothing in vLLM by name. Its engine core reports each step to its stat loggers
(``vllm/v1/metrics/loggers.py``), one list of them per engine: the nearest counterpart.

Invariants: an observer is in the tuple at most once (added twice, it would hear each step
twice); what an observer raises never replaces the step's own error, never loses the step's
outputs, and never keeps the other observers from their call.

NOTE 1 (a tuple, replaced whole): adding or removing an observer builds a new tuple rather
than changing the one the engine may be looping over, so a thread other than the engine's
(a server's event loop, a test) may add or remove one while the engine steps; an observer
added meanwhile hears of the next step. An unobserved step loops over an empty tuple.
NOTE 2 (what an observer raises): it is logged; if the step itself failed, it is also
attached to the step's error as a note, so the caller sees both and gets the step's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tinyvllm.core.sched_output import SchedulerOutput
    from tinyvllm.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)


class StepObserver(Protocol):
    """Called after each step; ``error`` is set when the step raised and was undone, and then
    ``core_outputs`` is empty. ``on_launch(engine, scheduler_output)`` is optional (module header)."""

    def on_step(
        self, engine: StepObservers, scheduler_output: SchedulerOutput, core_outputs: list[EngineCoreOutput],
        error: BaseException | None,
    ) -> None: ...  # fmt: skip


# --8<-- [start:observers]
class StepObservers:
    """The engine's observers (``LLMEngine`` derives from this)."""

    observers: tuple[StepObserver, ...] = ()  # NOTE 1: replaced whole, never changed in place

    def add_observer(self, observer: StepObserver) -> None:
        """``observer.on_step`` is called after every later step, after those added before it."""
        if not callable(getattr(observer, "on_step", None)):
            raise ValueError(f"an observer needs an on_step method, got {observer!r}")
        if any(o is observer for o in self.observers):
            raise ValueError(f"{observer!r} already observes this engine")
        self.observers = (*self.observers, observer)

    def remove_observer(self, observer: StepObserver) -> None:
        """No later step is told to ``observer``."""
        if not any(o is observer for o in self.observers):
            raise ValueError(f"{observer!r} does not observe this engine")
        self.observers = tuple(o for o in self.observers if o is not observer)

    def _observe(
        self, scheduler_output: SchedulerOutput, core_outputs: list[EngineCoreOutput], error: BaseException | None
    ) -> None:
        """Tell each observer of the step; what one raises is logged (NOTE 2)."""
        for observer in self.observers:  # a tuple: one added meanwhile hears of the next step (NOTE 1)
            try:
                observer.on_step(self, scheduler_output, core_outputs, error)
            except Exception as observer_error:
                logger.exception("the step observer %r raised", observer)
                if error is not None:
                    error.add_note(f"tinyvllm: the step observer {observer!r} also raised {observer_error!r}")

    def _observe_launch(self, scheduler_output: SchedulerOutput) -> None:
        """A step launched that this call does not read back: each observer with an
        ``on_launch`` hears of it (what one raises is logged)."""
        for observer in self.observers:
            if (on_launch := getattr(observer, "on_launch", None)) is not None:
                try:
                    on_launch(self, scheduler_output)
                except Exception:
                    logger.exception("the step observer %r raised at a launch", observer)
# --8<-- [end:observers]
