# --8<-- [start:header]
"""BatchUpdate: what changed in the persistent batch since the last step.

Concept: the persistent batch keeps every running request in a fixed row. Each step a
few requests leave (their row becomes a hole), a few arrive (they fill the lowest hole,
or append), and rows are moved to keep the batch compact. ``BatchUpdateBuilder`` collects
those changes while the batch is edited; ``get_and_reset`` freezes them into one
``BatchUpdate`` that every logits processor reads.

Seed: 001 ch. 7.2-7.3 (MoveDirectionality, BatchUpdate), ch. 8 (BatchUpdateBuilder),
appendix U2 (why ``removed`` is kept in descending order).
Mirrors: ``vllm/v1/sample/logits_processor/interface.py`` and ``.../state.py``.

Invariants:
- a ``BatchUpdate`` is applied removed -> added -> moved;
- once ``removed`` has been read in a step (``removed``, ``peek_removed``,
  ``pop_removed``), ``removed_append`` raises ``RuntimeError`` until the next reset:
  a late append would break the descending order;
- ``pop_removed`` returns the lowest hole: the list is sorted descending, so the lowest
  index is the last element and ``list.pop()`` takes it in O(1).

NOTE 1: ``get_and_reset`` hands its own lists to the BatchUpdate and starts new ones, so
a BatchUpdate is a snapshot that later edits of the builder cannot change.
"""
# --8<-- [end:header]

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from tinyvllm.sampling_params import SamplingParams


# --8<-- [start:types]
class MoveDirectionality(enum.Enum):
    """How a moved row travels: one way (i1 -> i2, i1 becomes empty) or a swap (i1 <-> i2)."""

    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


# The index of a row whose request left the batch.
RemovedRequest = int
# (index, params, prompt_tok_ids, output_tok_ids). output_tok_ids is the request's LIVE
# output list: processors keep the reference and always see the newest tokens.
AddedRequest = tuple[int, "SamplingParams", Union[list[int], None], list[int]]
# (index_1, index_2, direction)
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """The changes of one step, applied in the order removed -> added -> moved.

    Attributes:
        batch_size: rows in use after the step (the logits have this many rows).
        removed: rows whose request left (and that no new request filled).
        added: new requests and the row each one takes.
        moved: rows moved (condensing) or swapped.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]
# --8<-- [end:types]


# --8<-- [start:builder]
class BatchUpdateBuilder:
    """Collects one step's changes of the persistent batch."""

    def __init__(
        self,
        removed: list[RemovedRequest] | None = None,
        added: list[AddedRequest] | None = None,
        moved: list[MovedRequest] | None = None,
    ) -> None:
        self._removed: list[RemovedRequest] = removed or []
        self.added: list[AddedRequest] = added or []
        self.moved: list[MovedRequest] = moved or []
        self._is_removed_sorted = False
        # True once anything changed this step, even if no list records it (pooling models).
        self.batch_changed = False

    # --8<-- [start:builder_removed]
    def removed_append(self, index: int) -> None:
        """Register that the request in row ``index`` left the batch."""
        if self._is_removed_sorted:
            raise RuntimeError(
                f"cannot register removed row {index} after self.removed has been read this step"
            )
        self._removed.append(index)
        self.batch_changed = True

    def _ensure_removed_sorted(self) -> None:
        if not self._is_removed_sorted:
            self._removed.sort(reverse=True)
            self._is_removed_sorted = True

    @property
    def removed(self) -> list[RemovedRequest]:
        """The holes, highest first. Reading it forbids further ``removed_append`` this step."""
        self._ensure_removed_sorted()
        return self._removed

    def has_removed(self) -> bool:
        return bool(self._removed)

    def peek_removed(self) -> int | None:
        """The lowest hole, or None when there is none."""
        if not self.has_removed():
            return None
        self._ensure_removed_sorted()
        return self._removed[-1]

    def pop_removed(self) -> int | None:
        """Take the lowest hole (a new request fills it), or None when there is none."""
        if not self.has_removed():
            return None
        self._ensure_removed_sorted()
        return self._removed.pop()
    # --8<-- [end:builder_removed]

    # --8<-- [start:builder_reset]
    def reset(self) -> bool:
        """Forget this step's changes; return whether anything changed."""
        self._is_removed_sorted = False
        self._removed.clear()
        self.added.clear()
        self.moved.clear()
        changed = self.batch_changed
        self.batch_changed = False
        return changed

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """Freeze this step's changes into a BatchUpdate (None when nothing changed)."""
        self._removed.sort(reverse=True)  # the BatchUpdate's removed is descending too
        self._is_removed_sorted = False
        self.batch_changed = False
        if not (self._removed or self.added or self.moved):
            return None
        update = BatchUpdate(
            batch_size=batch_size, removed=self._removed, added=self.added, moved=self.moved
        )
        self._removed, self.added, self.moved = [], [], []  # NOTE 1
        return update
    # --8<-- [end:builder_reset]
# --8<-- [end:builder]
