"""One request's grammar state: the compile in flight, then the matcher, and its reasoning flag.

Concept: what a ``Request`` carries when it asked for structured outputs
(``request.structured_output_request``). While the grammar compiles (a ``Future`` from the
manager's thread) the request waits in the scheduler's queue with status ``WAITING_FOR_FSM``;
``is_grammar_ready()`` turns the finished compile into this request's own matcher.

Mirrors: ``vllm/v1/structured_output/request.py`` (``StructuredOutputRequest``).

Invariants: ``grammar`` is None until ``is_grammar_ready()`` has returned True once; after that
it is this request's matcher, or None with ``error`` set when the compile failed.

NOTE 1 (a failed compile): the constraint was parsed when the request was added
(``backend_xgrammar.validate``), so a compile that still fails is an internal error of the
backend. The request is then ready with no grammar and ``error`` set: the manager gives its rows
an all-zero mask, the sampler finds no token (``sample/sampler.py`` NOTE 7) and the request ends
with ``finish_reason="error"``; the engine never raises from a step for it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable

from tinyvllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """The grammar of one request (see the module header)."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future, make_matcher: Callable) -> None:
        self.params = params
        self._compiled = compiled  # the manager's compile, shared by every request with the same key
        self._make_matcher = make_matcher
        self.grammar = None  # this request's matcher, once ready
        self.error: str | None = None  # NOTE 1
        self.reasoning_ended: bool | None = None  # None: not decided yet (manager.py NOTE 4)
        self.num_unconstrained_tokens = 0  # output tokens of its think section, never fed to the matcher

    def is_grammar_ready(self) -> bool:
        """True once the compile finished (then ``grammar`` or ``error`` is set); never blocks."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        try:
            self.grammar = self._make_matcher(self._compiled.result())
        except Exception as error:  # NOTE 1
            self.error = str(error)
            logger.error("structured outputs: the grammar %r failed to compile: %s", self.params.key, error)
        return True
