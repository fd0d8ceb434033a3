"""The trace schema: one frozen snapshot per engine step, and the trace that holds them.

Concept: everything a picture of one step needs, copied out of the live objects into plain
frozen dataclasses of ints, strs, bools, tuples and None, so that a snapshot can never
change after it was taken and turns into JSON (and back) with no custom encoder. A
``StepSnapshot`` has up to seven parts; a part is empty (or None) when the recorded object
has no such state (a trace of a lone ``KVCacheManager`` has no scheduler decisions, one of
an ``InputBatch`` no blocks):

- the block pool: every block's ``ref_cnt``, content hash and place in the free queue, the
  free queue from head to tail, and the prefix cache map (hash -> block ids, caching order);
- the requests: status, tokens, ``num_computed_tokens``, block table;
- the scheduler's decisions (``SchedulerStep``): who ran, how many tokens, prefill, chunk
  or decode, prefix hits at admission, the token budget, preemptions, the two queues;
- the persistent batch (``BatchState``): its rows before and after, and the step's
  ``BatchUpdate`` (removed, added, moved);
- the CUDA-graph dispatch (``DispatchState``): runtime mode, ``BatchDescriptor``, padding;
- the slots the step wrote (``SlotWrite``: request, position, slot of the paged cache).

Follows: seed 002 §3.2 (the figures: orange block tables, yellow prefix cache, blue free
queue), seed 004 "Duplication", seed 003 "KV cache物理内存分配" (the cache tensor and its
slots), seed 001 appendix U2 (rows and holes), seed 000 (``BatchDescriptor``, padding).
Mirrors: nothing in vLLM (its state is read in a debugger or in logs).

Invariants: every field is a plain value or reads as a tuple of them (the pool, NOTE 3); a
``Trace`` read back with ``Trace.from_json`` equals the one written. What the values must
satisfy among themselves is checked by ``tinyvllm/trace/invariants.py``.

NOTE 1 (hashes as text): a block's ``BlockHash`` is a tuple of a large int, the block's
tokens and extra keys. A snapshot keeps the hash value as 16 hex digits (the low 64 bits,
enough to tell the blocks of a trace apart in a picture) and the tokens separately.
NOTE 2 (``kind``): a step's tokens of one request are a ``"decode"`` (one token past the
prompt), a ``"prefill"`` (the tokens up to the end of what the request has, so a token is
sampled: a whole prompt, the last chunk of one, or a recomputation after preemption) or a
``"chunk"`` (a partial prefill: the step stops inside the prompt and samples nothing,
seed 002's R3). A pooling request's last step is a ``"prefill"`` that made its vector, no token. A decode that verifies speculative drafts schedules them too
(``num_draft_tokens``).
NOTE 3 (plain free blocks are not kept): an engine on a real model has thousands of
blocks, most of them free, uncached and alike: ``ref_cnt`` 0, no hash, and a
``free_position`` that is their place in the free queue. A snapshot keeps only the others
(``PoolBlocks``: indexing or iterating it rebuilds a plain free block from the queue) and
the free queue as runs of consecutive ids (``FreeQueue``; a fresh pool's queue is one
run), so a step costs what is in use or cached, not the pool's size. Both read as tuples
(``len``, indexing, iteration, ``==`` with a tuple); the JSON writes the kept blocks and
the runs ``[first, count]``, and the round trip is exact.
NOTE 4 (async scheduling): a step is recorded when its output is read back, and by then the
next step is on the device. ``StepSnapshot.in_flight`` lists that step's requests (None: no
step in flight, always so without async scheduling) and ``RequestState.num_output_placeholders``
the tokens each waits for; ``launched`` marks a snapshot taken when a step was launched with
nothing read back (the first after idle: its ``in_flight`` is that step). With speculative
decoding too, ``drafts_run`` counts the drafts each row of the runner's step ran in place of its
placeholders. The JSON leaves the four out at their defaults, so a synchronous trace is written
as before (``recorder.py`` NOTE 8).
NOTE 5 (structured outputs): ``ScheduledRequest.num_allowed_tokens`` counts the tokens each of
the request's rows of the step's grammar bitmask allows (``grammar_rows.py``: the sampled
position, and each draft position under speculation); None for an unconstrained request, and
left out of the JSON then, so a trace without constraints is written as before.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

SCHEMA_VERSION = 2  # 2: plain free blocks left out of the JSON (NOTE 3)
PANELS = ("scheduler", "block_tables", "block_pool", "free_queue", "prefix_cache", "batch", "dispatch", "kv_cache")
KINDS = ("prefill", "chunk", "decode")  # NOTE 2


# --8<-- [start:schema]
@dataclass(frozen=True)
class BlockState:
    """One KV-cache block as the pool sees it."""

    block_id: int
    ref_cnt: int
    block_hash: str | None  # 16 hex digits of the content hash (NOTE 1); None: not in the prefix cache
    hash_tokens: tuple[int, ...]  # the tokens the hash covers; () when not cached
    free_position: int | None  # 0 = the head of the free queue (reused first); None: in use


class FreeQueue(Sequence[int]):
    """Block ids, head (reused first) to tail, kept as runs of consecutive ids (NOTE 3)."""

    __slots__ = ("_runs", "_len")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self._runs = tuple(_runs(ids))  # ((first, count), ...)
        self._len = sum(count for _, count in self._runs)

    @classmethod
    def from_runs(cls, runs: Iterable[Sequence[int]]) -> FreeQueue:
        return cls(i for first, count in runs for i in range(first, first + count))

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        return self._runs

    def position(self, block_id: int) -> int | None:
        """Where ``block_id`` is in the queue (0: the head); None when it is not free."""
        offset = 0
        for first, count in self._runs:
            if first <= block_id < first + count:
                return offset + block_id - first
            offset += count
        return None

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for first, count in self._runs:
            yield from range(first, first + count)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self)[index]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"free queue index {index} out of range for {self._len} blocks")
        for first, count in self._runs:
            if index < count:
                return first + index
            index -= count
        raise AssertionError("unreachable")

    def __contains__(self, block_id: object) -> bool:
        return isinstance(block_id, int) and self.position(block_id) is not None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FreeQueue):
            return self._runs == other._runs
        if isinstance(other, (tuple, list)):
            return len(other) == self._len and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class PoolBlocks(Sequence[BlockState]):
    """Every block of a pool of ``num_blocks``, reading as a tuple of ``BlockState``; only the
    blocks that are not plain free are kept, the others are rebuilt from ``free_queue`` (NOTE 3)."""

    __slots__ = ("_num_blocks", "_kept", "_ids", "_free_queue")

    def __init__(self, num_blocks: int, kept: Iterable[BlockState], free_queue: FreeQueue) -> None:
        self._num_blocks = num_blocks
        self._kept = tuple(sorted(kept, key=lambda b: b.block_id))
        self._ids = tuple(b.block_id for b in self._kept)
        self._free_queue = free_queue

    @property
    def kept(self) -> tuple[BlockState, ...]:
        """The blocks in use or cached (or anything but plain free), by id."""
        return self._kept

    def _plain(self, block_id: int, position: int | None) -> BlockState:
        return BlockState(block_id, 0, None, (), position)

    def __len__(self) -> int:
        return self._num_blocks

    def __iter__(self) -> Iterator[BlockState]:
        place: list[int | None] = [None] * self._num_blocks
        for position, block_id in enumerate(self._free_queue):
            if 0 <= block_id < self._num_blocks:
                place[block_id] = position
        kept = dict(zip(self._ids, self._kept))
        for block_id in range(self._num_blocks):
            yield kept.get(block_id) or self._plain(block_id, place[block_id])

    @overload
    def __getitem__(self, index: int) -> BlockState: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[BlockState, ...]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._num_blocks)))
        if index < 0:
            index += self._num_blocks
        if not 0 <= index < self._num_blocks:
            raise IndexError(f"block {index} out of range for a pool of {self._num_blocks}")
        at = bisect.bisect_left(self._ids, index)
        if at < len(self._ids) and self._ids[at] == index:
            return self._kept[at]
        return self._plain(index, self._free_queue.position(index))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PoolBlocks) and (self._kept, self._free_queue) == (other._kept, other._free_queue):
            return self._num_blocks == other._num_blocks
        if isinstance(other, (PoolBlocks, tuple, list)):
            return len(other) == self._num_blocks and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PoolBlocks({self._num_blocks} blocks, kept {self._kept!r})"


@dataclass(frozen=True)
class RequestState:
    """One unfinished request: its tokens, progress and block table."""

    request_id: str
    status: str  # "WAITING", "WAITING_FOR_FSM" (its grammar not claimed yet), "RUNNING" or "PREEMPTED"
    num_prompt_tokens: int
    num_computed_tokens: int
    token_ids: tuple[int, ...]  # prompt + outputs so far
    block_ids: tuple[int, ...]  # the block table, in order
    num_cached_blocks: int  # leading blocks that are in the prefix cache
    num_output_placeholders: int = 0  # tokens sampled by a step still in flight, not yet known (NOTE 4)
    priority: int = 0  # under the priority policy, lower runs sooner (``core/request_queue.py``); 0 is omitted

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ScheduledRequest:
    """What one request did in the step."""

    request_id: str
    start: int  # the position of the step's first token (num_computed_tokens before the step)
    num_tokens: int  # tokens scheduled (speculative drafts included)
    num_draft_tokens: int  # of those, drafts to verify (speculative decoding; 0 without)
    kind: str  # "prefill", "chunk" or "decode" (NOTE 2)
    admitted: str | None  # "new" or "resumed" when it left the waiting queue this step, else None
    num_hit_tokens: int  # prefix-cache tokens found at admission (0 when not admitted this step)
    new_block_ids: tuple[int, ...]  # blocks it got this step (its whole table when admitted)
    new_token_ids: tuple[int, ...]  # tokens sampled and kept this step
    finish_reason: str | None  # "stop", "length" or "abort" when it finished this step
    num_allowed_tokens: tuple[int, ...] | None = None  # per grammar bitmask row; None: unconstrained (NOTE 5)


@dataclass(frozen=True)
class SchedulerStep:
    """The scheduler's decisions in one step, and its queues after it."""

    token_budget: int  # max_num_batched_tokens
    scheduled: tuple[ScheduledRequest, ...]  # in scheduling order: running first, then admitted
    preempted: tuple[str, ...]  # preempted in this step (back to waiting: its front under FCFS)
    finished: tuple[str, ...]  # finished in this step, in any way
    waiting: tuple[str, ...]  # after the step, front first
    running: tuple[str, ...]  # after the step, in order

    @property
    def tokens_used(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True)
class BatchMove:
    """One move of a ``BatchUpdate``: ``src -> dst`` (UNIDIRECTIONAL) or ``src <-> dst`` (SWAP)."""

    src: int
    dst: int
    direction: str  # "UNIDIRECTIONAL" or "SWAP"


@dataclass(frozen=True)
class BatchState:
    """The persistent batch's rows around one step and the step's ``BatchUpdate``."""

    previous_rows: tuple[str, ...]  # row -> request id after the previous step
    rows: tuple[str, ...]  # row -> request id after this step (no holes: condensed)
    removed: tuple[int, ...]  # rows left empty by removals (highest first), as the update says
    added: tuple[tuple[int, str], ...]  # (row, request id) per new arrival
    moved: tuple[BatchMove, ...]
    changed: bool  # False: ``refresh`` found no change (its BatchUpdate was None)

    def rows_before_moves(self) -> tuple[str | None, ...]:
        """The rows once removals and additions are applied, before the moves (None: a hole).
        A removed row that a newcomer filled is not in ``removed``: the newcomer overwrites it."""
        rows: list[str | None] = list(self.previous_rows)
        for row in self.removed:
            if row < len(rows):
                rows[row] = None
        for row, request_id in self.added:
            rows.extend([None] * (row + 1 - len(rows)))
            rows[row] = request_id
        return tuple(rows)

    def replay(self) -> tuple[str | None, ...]:
        """``previous_rows`` with the update applied (removed -> added -> moved), trailing holes
        dropped: equal to ``rows`` for every update the persistent batch makes."""
        rows = list(self.rows_before_moves())
        for move in self.moved:
            if move.direction == "SWAP":
                rows[move.src], rows[move.dst] = rows[move.dst], rows[move.src]
            else:
                rows[move.dst], rows[move.src] = rows[move.src], None
        while rows and rows[-1] is None:
            rows.pop()
        return tuple(rows)


@dataclass(frozen=True)
class DispatchState:
    """How the step ran under CUDA graphs (``ModelRunner.last_dispatch``)."""

    runtime_mode: str  # "NONE", "PIECEWISE" or "FULL"
    num_tokens: int  # real tokens
    num_reqs: int  # real requests
    uniform_decode: bool
    padded_num_tokens: int  # BatchDescriptor.num_tokens
    padded_num_reqs: int | None  # BatchDescriptor.num_reqs (None: the graph ignores it)
    descriptor_uniform: bool  # BatchDescriptor.uniform
    capture_sizes: tuple[int, ...]

    @property
    def num_padding_tokens(self) -> int:
        return self.padded_num_tokens - self.num_tokens


@dataclass(frozen=True)
class SlotWrite:
    """One token's key and value written into the paged cache."""

    request_id: str
    position: int
    slot: int  # block_id * block_size + offset


@dataclass(frozen=True)
class StepSnapshot:
    """Everything drawn for one step (see the module header)."""

    index: int
    label: str
    note: str
    blocks: Sequence[BlockState]  # every block by id: a PoolBlocks or a tuple (NOTE 3)
    free_queue: Sequence[int]  # block ids, head (reused first) -> tail: a FreeQueue or a tuple
    hash_map: tuple[tuple[str, tuple[int, ...]], ...]  # (hash, block ids in caching order)
    requests: tuple[RequestState, ...]
    scheduler: SchedulerStep | None
    batch: BatchState | None
    dispatch: DispatchState | None
    slots: tuple[SlotWrite, ...]
    in_flight: tuple[ScheduledRequest, ...] | None = None  # the next step, on the device (NOTE 4)
    launched: bool = False  # taken at a launch, nothing read back: in_flight is the step just launched (NOTE 4)
    drafts_run: tuple[tuple[str, int], ...] = ()  # (request, drafts its row ran) of rows given placeholders (NOTE 4)

    def request(self, request_id: str) -> RequestState | None:
        return next((r for r in self.requests if r.request_id == request_id), None)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)
# --8<-- [end:schema]


@dataclass(frozen=True)
class Trace:
    """A recorded run: what was recorded, how to draw it, and one snapshot per step."""

    title: str
    description: str
    source: str  # the recorded object's class: "LLMEngine", "Scheduler", "KVCacheManager", "InputBatch"
    block_size: int  # 0: no KV cache was recorded
    num_blocks: int
    panels: tuple[str, ...]  # which parts the pictures draw, in PANELS order
    token_text: tuple[tuple[int, str], ...]  # how to print a token id (ids missing here print as numbers)
    steps: tuple[StepSnapshot, ...]

    def to_dict(self) -> dict[str, Any]:
        data = {"schema": SCHEMA_VERSION, **dataclasses.asdict(dataclasses.replace(self, steps=()))}
        data["steps"] = [_step_dict(step) for step in self.steps]
        return data

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"trace schema {data.get('schema')!r} is not {SCHEMA_VERSION}")
        trace = _build(cls, {**data, "steps": []})
        return dataclasses.replace(trace, steps=tuple(_step_from_dict(step, data["num_blocks"]) for step in data["steps"]))

    @classmethod
    def from_json(cls, text: str) -> Trace:
        return cls.from_dict(json.loads(text))

    def token_label(self, token_id: int) -> str:
        return dict(self.token_text).get(token_id, str(token_id))


# The dataclass of each nested field (and of the items of tuple fields), for from_dict.
_NESTED: dict[str, type] = {
    "steps": StepSnapshot,
    "blocks": BlockState,
    "requests": RequestState,
    "scheduler": SchedulerStep,
    "scheduled": ScheduledRequest,
    "batch": BatchState,
    "moved": BatchMove,
    "dispatch": DispatchState,
    "slots": SlotWrite,
    "in_flight": ScheduledRequest,
}
_OMITTED_AT_DEFAULT = ("in_flight", "launched", "drafts_run", "num_output_placeholders", "num_allowed_tokens", "priority")  # NOTE 4, 5


def step_kind(start: int, num_real: int, num_prompt: int, sampled: tuple[int, ...], pooled: bool = False) -> str:
    """NOTE 2: decode, prefill (reached the end: sampled, or a pooling request's vector made) or chunk."""
    if not sampled and not pooled:
        return "chunk"
    if num_real == 1 and start >= num_prompt:
        return "decode"
    return "prefill"


def _runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """``[3, 4, 5, 9, 1, 2]`` -> ``[(3, 3), (9, 1), (1, 2)]``: runs of consecutive ids (NOTE 3)."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _plain_free(block: BlockState, free_queue: Sequence[int]) -> bool:
    """A free, uncached block that nothing distinguishes (NOTE 3)."""
    position = block.free_position
    return (
        block.ref_cnt == 0 and block.block_hash is None and not block.hash_tokens
        and position is not None and position < len(free_queue) and free_queue[position] == block.block_id
    )  # fmt: skip


def kept_blocks(blocks: Sequence[BlockState], free_queue: Sequence[int]) -> tuple[BlockState, ...]:
    """The blocks of a snapshot that are not plain free (NOTE 3), by id."""
    if isinstance(blocks, PoolBlocks):
        return tuple(b for b in blocks.kept if not _plain_free(b, free_queue))
    return tuple(b for b in blocks if not _plain_free(b, free_queue))


def _step_dict(step: StepSnapshot) -> dict[str, Any]:
    """One step as JSON values: the kept blocks and the free queue's runs (NOTE 3)."""
    data = dataclasses.asdict(dataclasses.replace(step, blocks=(), free_queue=()))
    data["blocks"] = [dataclasses.asdict(b) for b in kept_blocks(step.blocks, step.free_queue)]
    runs = step.free_queue.runs if isinstance(step.free_queue, FreeQueue) else _runs(step.free_queue)
    data["free_queue"] = [list(run) for run in runs]
    if step.in_flight is None:  # NOTE 4
        del data["in_flight"]
    if not step.launched:
        del data["launched"]
    if not step.drafts_run:
        del data["drafts_run"]
    for scheduled in [*(data["scheduler"] or {}).get("scheduled", ()), *(data.get("in_flight") or ())]:
        if scheduled["num_allowed_tokens"] is None:  # NOTE 5
            del scheduled["num_allowed_tokens"]
    for request in data["requests"]:
        for name in ("num_output_placeholders", "priority"):  # a trace without them is written as before
            if not request[name]:
                del request[name]
    return data


def _step_from_dict(data: dict[str, Any], num_blocks: int) -> StepSnapshot:
    free_queue = FreeQueue.from_runs(data["free_queue"])
    blocks = PoolBlocks(num_blocks, (_build(BlockState, b) for b in data["blocks"]), free_queue)
    step = _build(StepSnapshot, {**data, "blocks": [], "free_queue": []})
    return dataclasses.replace(step, blocks=blocks, free_queue=free_queue)


def _tuples(value: Any) -> Any:
    """JSON lists back to (nested) tuples."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _build(cls: type, data: dict[str, Any]) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = data.get(f.name, f.default) if f.name in _OMITTED_AT_DEFAULT else data[f.name]
        nested = _NESTED.get(f.name)
        if nested is not None and value is not None:
            value = tuple(_build(nested, v) for v in value) if isinstance(value, list) else _build(nested, value)
        else:
            value = _tuples(value)
        kwargs[f.name] = value
    return cls(**kwargs)
