"""What the step recorder reads of a model runner, as one call that every worker runs.

Concept: the recorder (``recorder.py``) pictures the persistent batch's rows and the step's
``BatchUpdate``, the CUDA-graph dispatch and the slots the runner wrote. Those live in the
runner, and the runner lives in whichever process holds the worker: this one for one rank,
each rank's own process with ``tensor_parallel_size`` > 1 (``multiproc_executor.py``). So
the recorder never touches a runner: it sends ``runner_state``, a module function (pickled
by its name), through ``engine.model_executor.collective_rpc`` once a step and gets back
one ``RunnerState`` per rank, plain frozen values that travel back over a pipe. One rank or
N, the same call: the one-process executor runs it on its worker in place.

Mirrors: nothing in vLLM (its workers are read in a debugger); the pattern is the engine's
``runner_view`` (``executor/abstract.py`` NOTE 3).

Invariants: ``runner_state`` only reads; a ``RunnerState`` holds ints, strs, tuples, None
and the snapshot's own dataclasses, so it pickles and compares by value.

NOTE 1 (who arrived in a row): a ``BatchUpdate`` names an added request by its row, its
params, its prompt and its live output list, not by its id; the id is the row that now
holds that very list (compared by identity, which only the runner's process can do). So
the lookup happens here, in the worker, and the id travels back.
NOTE 2 (every rank alike): every rank runs the same ``SchedulerOutput`` into the same
batch, so their states must be equal; the recorder compares them (``check=True``) and
pictures rank 0's, the rank whose output the engine keeps.
NOTE 3 (the drafts a row ran): under async scheduling with speculative decoding a step's
drafts are placeholders, and the runner runs those it proposes, at most as many
(``model_runner.py`` NOTE 14); ``drafts`` counts them per request (the runner's
``launched_drafts``), so the invariants check the step's rows exactly. Empty otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinyvllm.trace.snapshot import BatchMove, DispatchState, SlotWrite


@dataclass(frozen=True)
class BatchUpdateState:
    """The step's ``BatchUpdate`` as plain values: rows removed, ``(row, request id)`` added
    (NOTE 1), the moves."""

    removed: tuple[int, ...]
    added: tuple[tuple[int, str], ...]
    moved: tuple[BatchMove, ...]


@dataclass(frozen=True)
class RunnerState:
    """One rank's runner after a step: the batch's rows (holes left out), its last update
    (None: no update since the batch was built), the dispatch, the slots written and the
    drafts each row ran (NOTE 3) (None, () and () when the step ran nothing, or when they
    were not asked for)."""

    rows: tuple[str, ...]
    update: BatchUpdateState | None
    dispatch: DispatchState | None
    slots: tuple[SlotWrite, ...]
    drafts: tuple[tuple[str, int], ...] = ()


def batch_state(batch: Any) -> tuple[tuple[str, ...], BatchUpdateState | None]:
    """An ``InputBatch``'s rows and its ``last_batch_update`` as plain values (NOTE 1)."""
    rows = tuple(r for r in batch.req_ids if r is not None)
    update = batch.last_batch_update
    if update is None:
        return rows, None
    lists = {id(batch.output_token_ids[row]): row for row in range(len(batch.req_ids))}
    added = []
    for row, _params, _prompt, output_ids in update.added:  # who arrived: the row holding its live list
        now = lists.get(id(output_ids))
        added.append((row, batch.req_ids[now] if now is not None else "?"))
    moved = tuple(BatchMove(a, b, direction.name) for a, b, direction in update.moved)
    return rows, BatchUpdateState(tuple(update.removed), tuple(added), moved)


def dispatch_state(runner: Any) -> DispatchState | None:
    """The runner's ``last_dispatch`` and the capture sizes of its mode (none in NONE)."""
    d = runner.last_dispatch
    if d is None:
        return None
    desc = d.batch_descriptor
    sizes = tuple(runner.dispatcher.capture_sizes) if runner.cudagraph_mode.name != "NONE" else ()
    return DispatchState(
        d.runtime_mode.name, d.num_tokens, d.num_reqs, d.uniform_decode, desc.num_tokens, desc.num_reqs,
        desc.uniform, sizes,
    )  # fmt: skip


def slot_writes(runner: Any, rows: tuple[str, ...]) -> tuple[SlotWrite, ...]:
    """The slots the step wrote, from the runner's persistent buffers (``recorder.py`` NOTE 2)."""
    buffers = runner.buffers
    starts = buffers.last_step("query_start_loc")[: len(rows) + 1].tolist()
    positions = buffers.last_step("positions")[: starts[-1]].tolist()
    slots = buffers.last_step("slot_mapping")[: starts[-1]].tolist()
    return tuple(
        SlotWrite(rid, positions[i], slots[i]) for r, rid in enumerate(rows) for i in range(starts[r], starts[r + 1])
    )


# --8<-- [start:runner_state]
def runner_state(worker: Any, ran: bool) -> RunnerState:
    """``worker``'s runner as the recorder pictures it; ``ran``: the step scheduled tokens
    and succeeded, so its dispatch and slots are this step's. Run by ``collective_rpc``."""
    runner = worker.model_runner
    rows, update = batch_state(runner.input_batch)
    if not ran:
        return RunnerState(rows, update, None, ())
    drafts = tuple(sorted(runner.launched_drafts().items()))  # NOTE 3
    return RunnerState(rows, update, dispatch_state(runner), slot_writes(runner, rows), drafts)
# --8<-- [end:runner_state]
