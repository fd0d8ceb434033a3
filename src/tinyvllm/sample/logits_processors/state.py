# --8<-- [start:header]
"""The LogitsProcessors container and ``process_dict_updates``, the shared state helper.

Concept: (1) ``LogitsProcessors`` holds the built processors split by
``is_argmax_invariant()``, because the sampler runs the two groups at different points;
(2) most processors keep a sparse ``{row: state}`` dict, and ``process_dict_updates``
keeps any such dict in step with a ``BatchUpdate``.

Seed: 001 ch. 9 (container), ch. 10.4 and appendix N (process_dict_updates).
Mirrors: ``vllm/v1/sample/logits_processor/state.py``.

NOTE 1 (order): we apply removed -> added -> moved, the order ``BatchUpdate`` promises
(ch. 7.3). The document's listing handles ``added`` first; with our builder an added row
is never also in ``removed`` (``pop_removed`` takes the hole out), so the two orders agree
on every update our batch produces, and ours stays right on hand-built updates that
list a row in both (appendix R2's scenario): the old request leaves, then the new one
arrives.
NOTE 2: a move pops both entries before writing any, so a SWAP never loses a state.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, TypeVar

from tinyvllm.sample.batch_update import BatchUpdate, MoveDirectionality

if TYPE_CHECKING:
    from tinyvllm.sample.logits_processors.interface import LogitsProcessor
    from tinyvllm.sampling_params import SamplingParams

T = TypeVar("T")


# --8<-- [start:container]
class LogitsProcessors:
    """The built processors, split by whether they can change the argmax."""

    def __init__(self, logitsprocs: Iterable["LogitsProcessor"] | None = None) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs or ():
            group = self.argmax_invariant if proc.is_argmax_invariant() else self.non_argmax_invariant
            group.append(proc)

    @property
    def all(self) -> Iterator["LogitsProcessor"]:
        """Every processor: the argmax-invariant ones first."""
        return chain(self.argmax_invariant, self.non_argmax_invariant)
# --8<-- [end:container]


# --8<-- [start:process_dict_updates]
def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[["SamplingParams", "list[int] | None", list[int]], "T | None"],
) -> bool:
    """Keep a sparse ``{row: state}`` dict in step with ``batch_update``.

    ``new_state(params, prompt_tok_ids, output_tok_ids)`` builds a new request's entry,
    or returns None when the request does not need this processor. Returns True when the
    dict changed (the caller then rebuilds its tensors).
    """
    if not batch_update:
        return False
    updated = False
    for index in batch_update.removed:  # NOTE 1
        if req_entries.pop(index, None) is not None:
            updated = True
    for index, params, prompt_tok_ids, output_tok_ids in batch_update.added:
        state = new_state(params, prompt_tok_ids, output_tok_ids)
        if state is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True  # the row's previous occupant had state; the newcomer has none
    for a_index, b_index, direction in batch_update.moved:
        a_entry = req_entries.pop(a_index, None)  # NOTE 2
        b_entry = req_entries.pop(b_index, None)
        if a_entry is not None:
            req_entries[b_index] = a_entry
            updated = True
        if b_entry is not None:
            updated = True
            if direction == MoveDirectionality.SWAP:
                req_entries[a_index] = b_entry
            # UNIDIRECTIONAL: b's old entry is overwritten; a is left empty.
    return updated
# --8<-- [end:process_dict_updates]
