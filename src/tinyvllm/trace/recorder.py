"""The step recorder: copy the engine's state into a frozen snapshot after every step.

Concept: ``record(target)`` returns a ``Recorder`` for an ``LLM`` or ``LLMEngine`` (one of
the engine's step observers) or for one component that a worked example drives by hand: a
``Scheduler``, a ``KVCacheManager`` or an ``InputBatch`` (then the example calls ``capture``
where it wants a picture). Either way a snapshot only reads: the block pool and its free
queue, the prefix cache map, every unfinished request and its block table, the step's
``SchedulerOutput`` and outputs, the persistent batch's rows and ``last_batch_update``, the
runner's ``last_dispatch``, its slot mapping, and the tokens each grammar bitmask row allows
(``grammar_rows.py``). ``check_snapshot`` runs on every snapshot (``check=True``). The
snapshots, with how to draw them, make a ``Trace``.

    with tinyvllm.trace.record(llm) as t:
        llm.generate(prompts, params)
    t.save_html("trace.html")

Follows: issue 26 ("pictures of every engine step"); the figures of seed 002 §3.2,
seed 004 "Duplication", seed 003 (the KV tensor and its slots), seed 001 appendix U2.
Mirrors: nothing in vLLM.

Invariants: recording never changes the recorded objects (the agreement test compares
every snapshot with the live engine); an engine records only inside ``record``'s block.

NOTE 1 (what the engine pays): a loop over its tuple of observers, empty when nothing records
(``engine/step_observers.py``; the docs page "Tracing" measures it and a recorded step's copy).
NOTE 2 (slots): for an engine the slots are read from what the runner wrote (the
``slot_mapping``, ``positions`` and ``query_start_loc`` of its input buffers), so the
picture shows the real writes; for a scheduler or a manager driven by hand they are
computed from the block tables, as the runner would (``slot_for_position``).
NOTE 3 (sizes): a snapshot holds every unfinished request's tokens and the blocks in use
or cached (NOTE 6), so a trace is for runs of up to hundreds of steps, not for serving;
``max_steps`` caps what the engine's hook records (one warning when it is reached).
NOTE 4 (a failed step): the undo empties the persistent batch, and its ``BatchUpdate`` is
relative to the rows the failed step had half built (a request already removed, rows
already moved), which no snapshot saw. The snapshot says what the undo did to the rows
the previous snapshot showed: every one of them removed.
NOTE 5 (the recorder never raises into the engine): an exception of ``on_step`` (its own
copy, ``label_token``, a snapshot failing ``check_snapshot``) is kept in ``error``, warned
about once, and ends the recording; the engine's step returns or raises as unrecorded.
NOTE 6 (memory a step): a pool's plain free blocks are not kept (``snapshot.py`` NOTE 3),
and a block, a free queue, a prefix cache entry or a request's tokens equal to the last
snapshot's is that snapshot's own object: a step keeps what it changed (a request that got
a token, its tokens whole) and a pointer per block in use or cached, whatever the pool's size.
NOTE 7 (the runner, wherever it lives): an engine's runner is read through its executor, one
``collective_rpc(runner_state)`` a step (``runner_state.py``), so one rank or a process per
rank (``tensor_parallel_size`` > 1) is the same path; the ranks' states must be equal, rank
0's is pictured. With N > 1 the description gets a line per rank: its weights, KV heads and
cache (the start-up reports); the steps are N = 1's.
NOTE 8 (async scheduling): a step is recorded at its read-back, the next in flight (``in_flight.py``);
a step launched with no read-back in the same call (the first after idle) also at its launch
(``on_launch``, labelled "step N: launched"), so every launch's runner parts reach a picture.
With speculative decoding too, a step's drafts are placeholders: the runner runs those it proposes,
from where the drafts kept end, and counts them (``runner_state.py`` NOTE 3; ``invariants.py`` NOTE 4).

Left out: the draft token ids themselves (a snapshot counts a step's drafts, keeps the tokens
kept). A served engine is recorded through its ``AsyncLLM``, read only in the engine's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.prefix_hash import HASH_VALUE, TOKEN_IDS
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.trace.grammar_rows import allowed_token_counts
from tinyvllm.trace.in_flight import (
    LAUNCHED_NOTE, BatchSince, in_flight_output, in_flight_step, since_last_snapshot, step_number,
)
from tinyvllm.trace.invariants import check_snapshot
from tinyvllm.trace.runner_state import RunnerState, batch_state, runner_state
from tinyvllm.trace.snapshot import (
    PANELS,
    BatchState,
    BlockState,
    FreeQueue,
    PoolBlocks,
    RequestState,
    ScheduledRequest,
    SchedulerStep,
    SlotWrite,
    StepSnapshot,
    Trace,
    step_kind,
)
from tinyvllm.worker.startup_report import format_bytes

HASH_MASK = (1 << 64) - 1  # snapshot.py NOTE 1: 16 hex digits


class Recorder:
    """Collects one ``StepSnapshot`` per step (or per ``capture``) of ``target``."""

    def __init__(
        self,
        target: Any,
        *,
        title: str | None = None,
        description: str = "",
        panels: Iterable[str] | None = None,
        label_token: Callable[[int], str] | None = None,
        check: bool = True,
        max_steps: int | None = None,
    ) -> None:
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        self.engine = self.scheduler = self.kv = self.batch = self.executor = None
        self._resolve(target)
        self.source = type(target).__name__ if self.engine is None else type(self.engine).__name__
        self.title = title if title is not None else f"A trace of {self.source}"
        self.description = description
        self.panels = self._panels(panels)
        self.check = check
        self.max_steps = max_steps  # NOTE 3: the engine's hook records at most this many steps
        self.num_unrecorded = 0  # steps the engine ran past max_steps
        self.error: Exception | None = None  # what stopped the recording (NOTE 5)
        self.steps: list[StepSnapshot] = []
        self._label_token = label_token or self._default_label()
        self._token_text: dict[int, str] = {}
        self._order: dict[str, int] = {}  # request id -> first seen, the order pictures list them in
        self._prompt_lens: dict[str, int] = {}
        self._tables: dict[str, list[int]] = {}  # the runner's view of the block tables (NOTE 2)
        self._last_pool: tuple | None = None  # the last snapshot's pool parts, to share (NOTE 6)
        self._kept: dict[int, BlockState] = {}
        self._hash_entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._last_requests: dict[str, RequestState] = {}
        self._saw_in_flight = False  # the last snapshot had a step in flight (NOTE 8)
        runner = self._runner_now(None, failed=False)
        self._rows = runner.rows if runner is not None else ()
        ranks = self._rank_lines()
        if len(ranks) > 1:  # each rank's share, after what the run is (NOTE 7)
            self.description = "\n".join([description, *ranks]) if description else "\n".join(ranks)

    # -- what is recorded ------------------------------------------------------------------

    def _resolve(self, target: Any) -> None:
        engine = getattr(target, "engine", None)  # an LLM
        if engine is not None and hasattr(engine, "scheduler"):
            target = engine
        if hasattr(target, "scheduler") and hasattr(target, "model_executor"):  # an LLMEngine
            self.engine, self.scheduler, self.executor = target, target.scheduler, target.model_executor
            self.kv = self.scheduler.kv_cache_manager
        elif isinstance(target, Scheduler):
            self.scheduler, self.kv = target, target.kv_cache_manager
        elif isinstance(target, KVCacheManager):
            self.kv = target
        elif hasattr(target, "batch_update_builder") and hasattr(target, "req_ids"):  # an InputBatch
            self.batch = target
        else:
            raise TypeError(
                f"record() takes an LLM, LLMEngine, AsyncLLM, Scheduler, KVCacheManager or InputBatch, got {type(target).__name__}"
            )

    def _panels(self, panels: Iterable[str] | None) -> tuple[str, ...]:
        available = set()
        if self.scheduler is not None:
            available.add("scheduler")
        if self.kv is not None:
            available |= {"block_tables", "block_pool", "free_queue", "prefix_cache", "kv_cache"}
        if self.batch is not None or self.executor is not None:
            available.add("batch")
        if self.executor is not None:
            available.add("dispatch")
        if panels is None:
            return tuple(p for p in PANELS if p in available)
        chosen = tuple(panels)
        unknown = [p for p in chosen if p not in available]
        if unknown:
            raise ValueError(f"panels {unknown} have nothing to draw for a {self.source}; choose from {sorted(available)}")
        return tuple(p for p in PANELS if p in chosen)

    def _rank_lines(self) -> list[str]:
        """One line per rank of the engine's start-up reports: its weights, KV heads and cache."""
        return [
            f"rank {r.rank} of {r.tensor_parallel_size}: weights {format_bytes(r.weight_bytes)}, KV heads "
            f"{r.num_kv_heads} of {r.total_num_kv_heads}, KV cache {r.num_kv_blocks} blocks ({format_bytes(r.kv_cache_bytes)})"
            for r in getattr(self.engine, "startup_reports", ())
        ]  # fmt: skip

    def _runner(self, ran: bool) -> list[RunnerState]:
        """Every rank's ``RunnerState``, in one call through the executor (NOTE 7)."""
        return self.executor.collective_rpc(runner_state, args=(ran,))

    def _default_label(self) -> Callable[[int], str]:
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            return str
        return lambda token_id: tokenizer.decode([token_id]).replace("\n", "\u23ce") or "\u2205"

    # -- the engine's hook ------------------------------------------------------------------

    # --8<-- [start:on_step]
    def on_step(self, engine, scheduler_output, core_outputs, error: BaseException | None) -> None:
        """An ``LLMEngine`` observer: one snapshot per step; an error of its own stops it (NOTE 5)."""
        if error is None:
            self._record(lambda: self.capture(scheduler_output=scheduler_output, core_outputs=core_outputs))
            return
        note = f"the step raised {type(error).__name__}: {error}; the engine undid it (its requests were aborted)"
        self._record(lambda: self.capture(f"step {self._step_number()}: failed", note, scheduler_output=scheduler_output,
                                          failed=True))  # fmt: skip

    def on_launch(self, engine, scheduler_output) -> None:
        """A step launched that no read-back follows in the same call: its own snapshot (NOTE 8)."""
        self._record(lambda: self.capture(f"step {self._step_number()}: launched", LAUNCHED_NOTE, launched=scheduler_output))

    def _record(self, take: Callable[[], object]) -> None:
        """A snapshot unless the recording stopped or is full (NOTE 3); never raises (NOTE 5)."""
        if self.error is not None:
            return
        if self.max_steps is not None and len(self.steps) >= self.max_steps:  # NOTE 3
            self.num_unrecorded += 1
            if self.num_unrecorded == 1:
                self._warn(f"recorded max_steps={self.max_steps} steps; the later steps are not recorded")
            return
        try:
            take()
        except Exception as own:  # NOTE 5: what the engine raises (or returns) stays the engine's
            self.error, n = own, len(self.steps)
            self._warn(f"recording stopped at step {n}: the recorder raised {type(own).__name__}: {own} "
                       f"(the engine's step is unaffected; the trace keeps the {n} steps before)")  # fmt: skip

    def _step_number(self) -> int:  # the engine step of the next snapshot: launch snapshots take no number
        return step_number(self.steps, len(self.steps))

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(f"tinyvllm.trace: {message}", RuntimeWarning, stacklevel=4)  # _record's caller's caller: the engine
    # --8<-- [end:on_step]

    # -- one snapshot -------------------------------------------------------------------------

    def capture(
        self,
        label: str | None = None,
        note: str = "",
        *,
        scheduler_output=None,
        core_outputs=(),
        requests: Iterable[Any] = (),
        scheduled: Mapping[str, int] | None = None,
        failed: bool = False,
        launched=None,
    ) -> StepSnapshot:
        """Snapshot the recorded objects now. ``scheduler_output`` and ``core_outputs``: the
        step's (a scheduler's trace). ``requests``: the ``Request`` objects of a manager
        driven by hand; ``scheduled``: the tokens each computed in this step, ending at its
        ``num_computed_tokens`` (for the slots). ``launched``: the ``SchedulerOutput`` of a step
        launched with nothing read back yet (``on_launch``)."""
        index, label = len(self.steps), label if label is not None else f"step {self._step_number()}"
        if scheduler_output is not None:
            self._follow_tables(scheduler_output)
        blocks, free_queue, hash_map = self._pool()
        request_states = self._requests(requests)
        computed = {r.request_id: r.num_computed_tokens for r in request_states}
        in_flight = in_flight_output(self.engine) if self.engine is not None and not failed else None  # NOTE 8
        newest, batch_since, launch_note = since_last_snapshot(in_flight, scheduler_output, self._saw_in_flight, launched)
        runner, self._saw_in_flight = self._runner_now(newest, failed), in_flight is not None
        snapshot = StepSnapshot(
            index=index,
            label=label,
            note=note or launch_note,
            blocks=blocks,
            free_queue=free_queue,
            hash_map=hash_map,
            requests=request_states,
            scheduler=self._scheduler_step(scheduler_output, core_outputs, failed, launched is not None),
            batch=self._batch(runner, failed, batch_since),
            dispatch=runner.dispatch if runner is not None else None,
            slots=self._slots(runner, scheduler_output, scheduled, computed, failed),
            in_flight=None if in_flight is None else in_flight_step(in_flight, self.scheduler.requests, self._prompt_lens),
            launched=launched is not None,
            drafts_run=runner.drafts if runner is not None else (),
        )
        if self.check:  # with the snapshot before it (invariants.py NOTE 4)
            kv = (self.kv.block_size, self.kv.num_gpu_blocks) if self.kv else (0, 0)
            check_snapshot(snapshot, *kv, self.steps[-1] if self.steps else None)
        self.steps.append(snapshot)
        for rid in snapshot.scheduler.finished if scheduler_output is not None else ():
            self._tables.pop(rid, None)
        return snapshot

    def _pool(self) -> tuple[PoolBlocks | tuple, FreeQueue | tuple, tuple[tuple[str, tuple[int, ...]], ...]]:
        """The pool's blocks, free queue and prefix cache map; the unchanged shared (NOTE 6)."""
        if self.kv is None:
            return (), (), ()
        pool, last = self.kv.block_pool, self._last_pool
        ids, place = [], {}
        for position, b in enumerate(pool.free_block_queue):
            ids.append(b.block_id)
            if b.ref_cnt or b.block_hash is not None:  # not plain: kept with its place
                place[b.block_id] = position
        free_queue = FreeQueue(ids)
        if last is not None and free_queue == last[1]:
            free_queue = last[1]
        previous = self._kept
        kept = []
        for b in pool.blocks:
            h = b.block_hash
            if not b.ref_cnt and h is None:  # plain free, rebuilt from the queue (snapshot.py NOTE 3)
                continue
            position, hex_hash, tokens = place.get(b.block_id), _hex(h), h[TOKEN_IDS] if h is not None else ()
            state = previous.get(b.block_id)
            if state is None or (state.ref_cnt, state.block_hash, state.hash_tokens, state.free_position) != (
                b.ref_cnt, hex_hash, tokens, position
            ):  # fmt: skip
                self._label_tokens(tokens)
                state = BlockState(b.block_id, b.ref_cnt, hex_hash, tuple(tokens), position)
            kept.append(state)
        self._kept = {b.block_id: b for b in kept}
        if last is not None and free_queue is last[1] and _same(kept, last[0].kept):
            blocks = last[0]
        else:
            blocks = PoolBlocks(len(pool.blocks), kept, free_queue)
        entries = self._hash_entries
        hash_map = []
        for h, by_id in pool.cached_block_hash_to_block.items():
            hex_hash, ids_now = _hex(h), tuple(by_id)
            entry = entries.get(hex_hash)
            if entry is None or entry[1] != ids_now:
                entry = entries[hex_hash] = (hex_hash, ids_now)
            hash_map.append(entry)
        for gone in set(entries) - {e[0] for e in hash_map}:
            del entries[gone]
        hash_map = last[2] if last is not None and _same(hash_map, last[2]) else tuple(hash_map)
        self._last_pool = (blocks, free_queue, hash_map)
        return blocks, free_queue, hash_map

    def _requests(self, given: Iterable[Any]) -> tuple[RequestState, ...]:
        if self.kv is None:
            return ()
        if self.scheduler is not None:
            live = list(self.scheduler.running) + list(self.scheduler.waiting)
        else:
            live = list(given)
            missing = set(self.kv.req_to_blocks) - {r.request_id for r in live}
            if missing:
                raise ValueError(f"capture(requests=...) must list every request holding blocks; missing {sorted(missing)}")
        for r in live:
            self._order.setdefault(r.request_id, len(self._order))
            self._prompt_lens.setdefault(r.request_id, r.num_prompt_tokens)
            self._label_tokens(r.all_token_ids)
        live.sort(key=lambda r: self._order[r.request_id])
        states, previous = [], self._last_requests
        for r in live:
            state = RequestState(
                r.request_id, r.status.name, r.num_prompt_tokens, r.num_computed_tokens, tuple(r.all_token_ids),
                tuple(self.kv.get_block_ids(r.request_id)), self.kv.num_cached_block.get(r.request_id, 0),
                getattr(r, "num_output_placeholders", 0), getattr(r, "priority", 0),
            )  # fmt: skip
            before = previous.get(r.request_id)
            if before is not None:  # NOTE 6: share what did not change
                if before == state:
                    state = before
                elif before.token_ids == state.token_ids or before.block_ids == state.block_ids:
                    state = dataclasses.replace(
                        state,
                        token_ids=before.token_ids if before.token_ids == state.token_ids else state.token_ids,
                        block_ids=before.block_ids if before.block_ids == state.block_ids else state.block_ids,
                    )  # fmt: skip
            states.append(state)
        self._last_requests = {state.request_id: state for state in states}
        return tuple(states)

    def _scheduler_step(self, out, core_outputs, failed: bool, launched: bool = False) -> SchedulerStep | None:
        if (out is None and not launched) or self.scheduler is None:
            return None
        s = self.scheduler
        finished = tuple(sorted(s.finished_req_ids))
        queues = dict(waiting=tuple(r.request_id for r in s.waiting), running=tuple(r.request_id for r in s.running))
        budget = s.scheduler_config.max_num_batched_tokens
        if launched:  # nothing read back yet: the queues only (the step's decisions come with its read-back)
            return SchedulerStep(budget, (), (), (), **queues)
        if failed:  # nothing ran: the step's requests were aborted
            return SchedulerStep(budget, (), tuple(sorted(out.preempted_req_ids)), finished, **queues)
        starts = {d.req_id: (d.num_computed_tokens, d.block_ids, "new") for d in out.scheduled_new_reqs}
        for d in out.scheduled_cached_reqs:
            starts[d.req_id] = (d.num_computed_tokens, d.new_block_ids, "resumed" if d.resumed_from_preemption else None)
        for d in out.scheduled_new_reqs:
            self._prompt_lens[d.req_id] = len(d.prompt_token_ids)
        results = {o.request_id: o for o in core_outputs}
        drafts = getattr(out, "scheduled_spec_decode_tokens", {})
        allowed = allowed_token_counts(out, getattr(getattr(self.engine, "structured_output_manager", None), "vocab_size", 0))
        scheduled = []
        for rid, n in out.num_scheduled_tokens.items():
            start, new_blocks, admitted = starts[rid]
            result = results.get(rid)
            tokens = tuple(result.new_token_ids) if result is not None else ()
            self._label_tokens(tokens)
            num_drafts = len(drafts.get(rid, ()))
            reason, pooled = (None, False) if result is None else (result.finish_reason, result.pooling_output is not None)
            if reason is None and rid in finished:
                reason = "stop"  # a stop string, found by the engine after the scheduler's update
            scheduled.append(ScheduledRequest(
                rid, start, n, num_drafts, step_kind(start, n - num_drafts, self._prompt_lens.get(rid, 0), tokens, pooled),
                admitted, start if admitted else 0, tuple(new_blocks), tokens, reason, allowed.get(rid),
            ))  # fmt: skip
        return SchedulerStep(budget, tuple(scheduled), tuple(sorted(out.preempted_req_ids)), finished, **queues)

    def _runner_now(self, out, failed: bool) -> RunnerState | None:
        """The runner's state after this step: rank 0's, every rank's equal to it (NOTE 7)."""
        if self.executor is None:
            return None if self.batch is None else RunnerState(*batch_state(self.batch), None, ())
        views = self._runner(ran=out is not None and not failed and bool(out.total_num_scheduled_tokens))
        differ = [rank for rank, view in enumerate(views) if view != views[0]]
        if differ and self.check:
            raise ValueError(f"the runners of ranks {differ} differ from rank 0's: {views[differ[0]]} != {views[0]}")
        return views[0]

    def _batch(self, runner: RunnerState | None, failed: bool, since: BatchSince | None) -> BatchState | None:
        if runner is None:
            return None
        rows, update, previous, self._rows = runner.rows, runner.update, self._rows, runner.rows
        if failed:  # NOTE 4: the undo emptied the batch; its update is relative to rows never seen
            removed = tuple(range(len(previous) - 1, -1, -1))
            return BatchState(previous, rows, removed, (), (), changed=bool(previous))
        if since is not None:  # in_flight.py NOTE 3 and 4: the runner's update does not apply
            return since(previous, rows)
        if update is None:
            return BatchState(previous, rows, (), (), (), changed=False)
        return BatchState(previous, rows, update.removed, update.added, update.moved, changed=True)

    def _slots(
        self, runner: RunnerState | None, out, scheduled: Mapping[str, int] | None, computed: Mapping[str, int],
        failed: bool,
    ) -> tuple[SlotWrite, ...]:  # fmt: skip
        if self.kv is None or failed:
            return ()
        if self.executor is not None:  # NOTE 2: what the runner wrote (read only when the step ran)
            return runner.slots
        if out is not None:  # a scheduler: the tables the runner would hold
            tables = self._tables
            spans = {rid: (self._start(out, rid), n) for rid, n in out.num_scheduled_tokens.items()}
        else:  # a manager driven by hand: the tokens each request just computed
            tables = {rid: self.kv.get_block_ids(rid) for rid in self.kv.req_to_blocks}
            spans = {rid: (computed[rid] - n, n) for rid, n in (scheduled or {}).items()}
        bs = self.kv.block_size
        return tuple(
            SlotWrite(rid, p, tables[rid][p // bs] * bs + p % bs)
            for rid, (start, n) in spans.items()
            for p in range(start, start + n)
        )

    # -- helpers ----------------------------------------------------------------------------

    def _follow_tables(self, out) -> None:
        """Keep each request's block ids as the runner does: whole at admission, appended after."""
        for rid in out.finished_req_ids:
            self._tables.pop(rid, None)
        for d in out.scheduled_new_reqs:
            self._tables[d.req_id] = list(d.block_ids)
        for d in out.scheduled_cached_reqs:
            if d.resumed_from_preemption:
                self._tables[d.req_id] = list(d.new_block_ids)
            else:
                self._tables.setdefault(d.req_id, []).extend(d.new_block_ids)

    @staticmethod
    def _start(out, rid: str) -> int:
        return next(d.num_computed_tokens for d in (*out.scheduled_new_reqs, *out.scheduled_cached_reqs) if d.req_id == rid)

    def _label_tokens(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            if t not in self._token_text:
                self._token_text[t] = self._label_token(t)

    # -- the result -------------------------------------------------------------------------

    @property
    def trace(self) -> Trace:
        """The frozen trace of every snapshot so far."""
        token_text = tuple(sorted((t, s) for t, s in self._token_text.items() if s != str(t)))
        kv = (self.kv.block_size, self.kv.num_gpu_blocks) if self.kv else (0, 0)
        return Trace(title=self.title, description=self.description, source=self.source, block_size=kv[0],
                     num_blocks=kv[1], panels=self.panels, token_text=token_text, steps=tuple(self.steps))  # fmt: skip

    def save_html(self, path: str | Path) -> Path:
        """Write the viewer (one self-contained HTML file) of the trace so far."""
        from tinyvllm.trace.viewer import write_html

        return write_html(self.trace, path)

    def save_svgs(self, folder: str | Path) -> list[Path]:
        """Write ``step-NN.svg``, one still per step, into ``folder``."""
        from tinyvllm.trace.viewer import write_svgs

        return write_svgs(self.trace, folder)


def _same(a, b) -> bool:
    """The same objects, in the same order (what NOTE 6 shares)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _hex(block_hash) -> str | None:
    return None if block_hash is None else format(block_hash[HASH_VALUE] & HASH_MASK, "016x")


# --8<-- [start:record]
@contextlib.contextmanager
def record(target: Any, **options: Any) -> Iterator[Recorder]:
    """Record ``target`` (an ``LLM``, ``LLMEngine``, ``AsyncLLM``, ``Scheduler``,
    ``KVCacheManager`` or ``InputBatch``) inside the block; ``options`` go to ``Recorder``. An
    engine is observed only inside the block; a component is snapshotted by ``capture``. An
    ``AsyncLLM``'s recorder is built, added and removed in its engine's thread, between steps."""
    in_engine_thread = getattr(target, "call_in_engine_thread", None) or (lambda fn: fn())
    recorder = in_engine_thread(lambda: Recorder(target, **options))
    engine = recorder.engine
    if engine is not None:
        in_engine_thread(lambda: engine.add_observer(recorder))  # beside any other (a server's metrics)
    try:
        yield recorder
    finally:
        if engine is not None:
            in_engine_thread(lambda: engine.remove_observer(recorder))
# --8<-- [end:record]
