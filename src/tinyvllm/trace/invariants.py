"""What every snapshot of a trace must satisfy, checked the way ``check_invariants()`` is.

Concept: a snapshot is a copy of the engine's state, so the engine's own invariants hold
in it, and the parts must agree with one another: the free queue with the blocks'
``free_position``, each block's ``ref_cnt`` with the block tables that hold it, the
prefix cache map with the blocks' hashes, the scheduler's decisions with the requests'
progress, the persistent batch's update with its rows, the dispatch's padding with the
capture sizes, and every slot written with the block table of its request. The recorder
runs ``check_snapshot`` on every snapshot it takes (``Recorder(check=True)``, the default);
a broken one raises ``AssertionError`` naming the step and the values involved.

Follows: the invariants stated in ``core/block_pool.py``, ``core/kv_cache_manager.py``,
``core/scheduler.py``, ``worker/input_batch.py``, ``worker/cudagraph_dispatcher.py`` and
``worker/attention_metadata.py`` (slots), restated over the snapshot's plain values.
Mirrors: nothing in vLLM.

NOTE 1 (what is not checked): a request's status is only checked when the trace has
scheduler decisions: a trace that drives the KV cache manager by hand (seed 002 §3.2)
never moves its requests out of WAITING. A finished request has left the snapshot, so the
slots it wrote in its last step are checked against the slot arithmetic only.
NOTE 2 (a pool of thousands of blocks): a snapshot keeps only the blocks that are not plain
free (``snapshot.py`` NOTE 3), and the pool is checked through them: each kept block as
before, and the counts prove that every other block is in the free queue and in no block
table, so a step's check costs what is in use or cached, not the pool's size.
NOTE 3 (a step in flight, async scheduling): a snapshot taken at step N's read-back holds
step N+1's advance (``in_flight.py``), and the checks account for it exactly: a request N+1
runs has computed N+1's end, which starts at N's end, less the drafts N rejected; it holds
``1 + drafts`` placeholders when N+1 reaches the end of its known tokens, none otherwise;
a request N+1 runs is running, or finished in step N (its N+1 token will be dropped); a
request step N preempted may have left already (step N-1's read-back, after N's schedule,
gave it its last token); and the batch, the dispatch and the slots are compared with N+1.
NOTE 4 (placeholder drafts, async scheduling with speculative decoding): the scheduler's starts
are optimistic: it schedules N+1 before it reads N back, so N+1 starts at N's end less the
drafts N-1 rejected (taken back between the two schedules; the snapshot before holds them).
The runner reads N back before it launches N+1, so a row of N+1 starts where N's kept tokens
end, N's rejected drafts earlier than scheduled, and runs the drafts the runner proposed
(``drafts_run``, at most its placeholders): the dispatch and the slots are checked against
those exactly. Only a request that step N finished is checked within bounds: a stop may have
cut the tokens it kept, so its rejected drafts are not known.
"""

from __future__ import annotations

from tinyvllm.trace.snapshot import KINDS, PoolBlocks, ScheduledRequest, StepSnapshot, Trace

RUNTIME_MODES = ("NONE", "PIECEWISE", "FULL")


def check_trace(trace: Trace) -> None:
    """Every snapshot's invariants, and step indices 0, 1, 2, ..."""
    for index, snapshot in enumerate(trace.steps):
        assert snapshot.index == index, f"step {index} carries index {snapshot.index}"
        check_snapshot(snapshot, trace.block_size, trace.num_blocks, trace.steps[index - 1] if index else None)


def check_snapshot(snapshot: StepSnapshot, block_size: int, num_blocks: int, previous: StepSnapshot | None = None) -> None:
    """Assert the invariants of one snapshot (module header); AssertionError names the step.
    ``previous``: the snapshot taken just before it, if any (NOTE 4)."""
    where = f"step {snapshot.index} ({snapshot.label!r})"
    _check_pool(snapshot, block_size, num_blocks, where)
    _check_requests(snapshot, block_size, where)
    if snapshot.scheduler is not None:
        _check_scheduler(snapshot, block_size, where, previous)
    _check_in_flight(snapshot, block_size, where)
    _check_drafts_run(snapshot, where)
    if snapshot.batch is not None:
        _check_batch(snapshot, where)
    if snapshot.dispatch is not None:
        _check_dispatch(snapshot, where)
    _check_slots(snapshot, block_size, num_blocks, where)


def _check_pool(s: StepSnapshot, block_size: int, num_blocks: int, where: str) -> None:
    assert len(s.blocks) == num_blocks, f"{where}: {len(s.blocks)} blocks in a pool of {num_blocks}"
    queue = tuple(s.free_queue)
    assert len(set(queue)) == len(queue), f"{where}: a block is twice in the free queue {s.free_queue}"
    assert not queue or 0 <= min(queue) <= max(queue) < num_blocks, f"{where}: the free queue {s.free_queue} leaves the pool"
    if isinstance(s.blocks, PoolBlocks):  # NOTE 2: the kept blocks; the others are plain free ones
        blocks = s.blocks.kept
        ids = [b.block_id for b in blocks]
        assert ids == sorted(set(ids)) and all(0 <= i < num_blocks for i in ids), f"{where}: kept block ids {ids}"
    else:
        blocks = tuple(s.blocks)
        assert [b.block_id for b in blocks] == list(range(num_blocks)), f"{where}: block ids are not 0..{num_blocks - 1}"
    place = {block_id: i for i, block_id in enumerate(queue)}
    for block in blocks:
        free = block.free_position is not None
        assert block.ref_cnt >= 0, f"{where}: block {block.block_id} has ref_cnt {block.ref_cnt}"
        assert free == (block.ref_cnt == 0), (
            f"{where}: block {block.block_id} has ref_cnt {block.ref_cnt} and free_position {block.free_position}"
        )
        assert place.get(block.block_id) == block.free_position, (
            f"{where}: block {block.block_id} says free_position {block.free_position}, the queue is {s.free_queue}"
        )
        assert (block.block_hash is None) == (not block.hash_tokens), f"{where}: block {block.block_id}: hash without tokens"
        if block.hash_tokens:
            assert len(block.hash_tokens) == block_size, (
                f"{where}: block {block.block_id} is cached with {len(block.hash_tokens)} tokens, not {block_size}"
            )
    num_free = sum(b.free_position is not None for b in blocks) + num_blocks - len(blocks)  # plain ones are free
    assert len(queue) == num_free, f"{where}: the free queue has {len(queue)} blocks, {num_free} have ref_cnt 0"
    listed: dict[int, str] = {}
    assert len({h for h, _ in s.hash_map}) == len(s.hash_map), f"{where}: a hash is listed twice in the map"
    for block_hash, ids in s.hash_map:
        assert ids, f"{where}: hash {block_hash} maps to no block"
        for block_id in ids:
            assert block_id not in listed, f"{where}: block {block_id} is listed under two hashes"
            listed[block_id] = block_hash
            assert s.blocks[block_id].block_hash == block_hash, (
                f"{where}: the map lists block {block_id} under {block_hash}, it carries {s.blocks[block_id].block_hash}"
            )
    orphans = [b.block_id for b in blocks if b.block_hash is not None and b.block_id not in listed]
    assert not orphans, f"{where}: blocks {orphans} carry a hash the map does not list"
    holders: dict[int, int] = {}
    for request in s.requests:
        for block_id in request.block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), (
            f"{where}: block {block.block_id} has ref_cnt {block.ref_cnt} but "
            f"{holders.get(block.block_id, 0)} block tables hold it"
        )
    plain = sorted(set(holders) - {b.block_id for b in blocks})
    assert not plain, f"{where}: blocks {plain} have ref_cnt 0 but block tables hold them"


def _check_requests(s: StepSnapshot, block_size: int, where: str) -> None:
    ids = [r.request_id for r in s.requests]
    assert len(ids) == len(set(ids)), f"{where}: a request is listed twice: {ids}"
    for r in s.requests:
        label = f"{where}: request {r.request_id!r}"
        known = r.num_tokens + r.num_output_placeholders  # NOTE 3: placeholders count as computed ahead
        assert 0 <= r.num_computed_tokens <= known, f"{label}: {r.num_computed_tokens} of {r.num_tokens} computed"
        assert 0 < r.num_prompt_tokens <= r.num_tokens, f"{label}: prompt of {r.num_prompt_tokens} of {r.num_tokens} tokens"
        assert len(set(r.block_ids)) == len(r.block_ids), f"{label}: a block twice in its table {r.block_ids}"
        if block_size:
            assert len(r.block_ids) * block_size >= r.num_computed_tokens, (
                f"{label}: {len(r.block_ids)} blocks of {block_size} hold {r.num_computed_tokens} computed tokens"
            )
        assert 0 <= r.num_cached_blocks <= len(r.block_ids), f"{label}: {r.num_cached_blocks} cached of {len(r.block_ids)}"
        for block_id in r.block_ids[: r.num_cached_blocks]:
            assert s.blocks[block_id].block_hash is not None, f"{label}: cached block {block_id} carries no hash"


def _check_scheduler(s: StepSnapshot, block_size: int, where: str, previous: StepSnapshot | None) -> None:
    d = s.scheduler
    assert d.tokens_used <= d.token_budget, f"{where}: {d.tokens_used} tokens scheduled > budget {d.token_budget}"
    scheduled = [x.request_id for x in d.scheduled]
    assert len(scheduled) == len(set(scheduled)), f"{where}: a request is scheduled twice: {scheduled}"
    assert not set(d.waiting) & set(d.running), f"{where}: in both queues: {set(d.waiting) & set(d.running)}"
    queued = set(d.waiting) | set(d.running)
    assert queued == {r.request_id for r in s.requests}, (
        f"{where}: queued {sorted(queued)} != unfinished {sorted(r.request_id for r in s.requests)}"
    )
    assert not set(d.preempted) & set(scheduled), f"{where}: preempted and scheduled: {set(d.preempted) & set(scheduled)}"
    later = {x.request_id: x for x in s.in_flight or ()}  # NOTE 3
    resumed = {rid for rid, x in later.items() if x.admitted}  # preempted in step N, admitted again by N+1
    # NOTE 3: async, step N preempted it before step N-1 was read back, and that read-back finished it
    left = {rid for rid in d.preempted if s.request(rid) is None and rid not in later and rid not in scheduled}
    assert set(d.preempted) <= set(d.waiting) | set(d.finished) | resumed | left, f"{where}: preempted {d.preempted} are not waiting"
    for r in s.requests:
        if r.request_id in d.running:
            assert r.status == "RUNNING", f"{where}: running request {r.request_id!r} has status {r.status}"
        else:
            assert r.status in ("WAITING", "WAITING_FOR_FSM", "PREEMPTED"), (  # FSM: a grammar no schedule() claimed yet
                f"{where}: waiting request {r.request_id!r} has status {r.status}"
            )
            assert not r.block_ids and r.num_computed_tokens == 0, (
                f"{where}: waiting request {r.request_id!r} holds blocks {r.block_ids}, {r.num_computed_tokens} computed"
            )
    drafts = any(y.num_draft_tokens for y in (*d.scheduled, *later.values()))  # NOTE 4
    for x in d.scheduled:
        label = f"{where}: scheduled {x.request_id!r}"
        _check_entry(x, block_size, label)
        request = s.request(x.request_id)
        if request is not None and x.request_id in d.running:  # rejected drafts are not computed
            end = x.start + x.num_tokens
            if x.request_id in later:  # NOTE 3: N+1 computes on from N's end (NOTE 4: less N-1's rejected drafts)
                start, back = later[x.request_id].start, None if previous is None else _rejected(previous, x.request_id)
                assert start == end - back if back is not None else start == end or (drafts and start < end), (
                    f"{label}: ends at {end}, step N+1 starts at {start} ({back} rejected in the step before)"
                )
                continue
            assert end - x.num_draft_tokens <= request.num_computed_tokens <= end, (
                f"{label}: {request.num_computed_tokens} computed after a step of {x.num_tokens} from {x.start}"
            )


def _check_entry(x: ScheduledRequest, block_size: int, label: str) -> None:
    """One request's share of a step, on its own."""
    assert x.num_tokens > 0 and x.start >= 0, f"{label}: {x.num_tokens} tokens from {x.start}"
    assert x.kind in KINDS, f"{label}: kind {x.kind!r}"
    assert 0 <= x.num_draft_tokens < x.num_tokens, f"{label}: {x.num_draft_tokens} drafts of {x.num_tokens} tokens"
    assert x.kind != "decode" or x.num_tokens - x.num_draft_tokens == 1, (
        f"{label}: a decode of {x.num_tokens} tokens with {x.num_draft_tokens} drafts"
    )
    assert x.kind != "chunk" or not x.new_token_ids, f"{label}: a partial prefill sampled {x.new_token_ids}"
    allowed = x.num_allowed_tokens  # snapshot.py NOTE 5: a count per bitmask row, one row per sampled position
    assert allowed is None or (len(allowed) == 1 + x.num_draft_tokens and min(allowed) >= 0), f"{label}: allowed {allowed}"
    if x.admitted is not None:
        assert x.admitted in ("new", "resumed") and x.start == x.num_hit_tokens, (
            f"{label}: admitted {x.admitted!r} at {x.start} with {x.num_hit_tokens} hit tokens"
        )
        assert not block_size or x.num_hit_tokens % block_size == 0, f"{label}: {x.num_hit_tokens} hit tokens"


def _check_in_flight(s: StepSnapshot, block_size: int, where: str) -> None:
    """NOTE 3: the step in flight against the requests, and every request's placeholders."""
    later = {x.request_id: x for x in s.in_flight or ()}
    assert len(later) == len(s.in_flight or ()), f"{where}: a request is twice in the step in flight"
    finished = set(s.scheduler.finished) if s.scheduler is not None else set()
    for x in s.in_flight or ():
        label = f"{where}: in flight {x.request_id!r}"
        _check_entry(x, block_size, label)
        assert not x.new_token_ids and x.finish_reason is None, f"{label}: sampled {x.new_token_ids} before its read-back"
        request = s.request(x.request_id)
        assert (request is not None and request.status == "RUNNING") or x.request_id in finished, (
            f"{label}: neither running ({request and request.status}) nor finished in this step"
        )
    for r in s.requests:
        label = f"{where}: request {r.request_id!r}"
        x = later.get(r.request_id)
        if x is None:
            assert r.num_output_placeholders == 0, f"{label}: {r.num_output_placeholders} placeholders, no step in flight runs it"
            continue
        end, back = x.start + x.num_tokens, _rejected(s, r.request_id)  # unfinished: known
        assert r.num_computed_tokens == end - back, (  # NOTE 3: step N's rejected drafts taken back
            f"{label}: {r.num_computed_tokens} computed, the step in flight ends at {end}, step N rejected {back}"
        )
        reaches_end = r.num_computed_tokens - x.num_draft_tokens == r.num_tokens  # it samples after its known ones
        assert r.num_output_placeholders == (1 + x.num_draft_tokens) * reaches_end and (x.kind == "chunk") != reaches_end, (
            f"{label}: {r.num_output_placeholders} placeholders, {r.num_computed_tokens} of {r.num_tokens} computed "
            f"when the step in flight ({x.kind}) ends"
        )


def _runner_step(s: StepSnapshot) -> tuple[ScheduledRequest, ...]:
    """The newest step launched, the one the runner's parts show (NOTE 3)."""
    return s.in_flight if s.in_flight is not None else s.scheduler.scheduled


def _rejected(s: StepSnapshot, request_id: str) -> int | None:
    """NOTE 4: the drafts ``s``'s step scheduled for the request and did not keep (taken back
    at its read-back); 0 when it had none there, None when that step finished it (unknown)."""
    y = next((y for y in s.scheduler.scheduled if y.request_id == request_id), None) if s.scheduler else None
    if y is None or not y.num_draft_tokens:
        return 0
    return None if y.finish_reason is not None else y.num_draft_tokens - (len(y.new_token_ids) - 1)


def _runner_row(s: StepSnapshot, x: ScheduledRequest) -> tuple[int, int, int]:
    """NOTE 4: the first and last position the runner's row of ``x`` may start at (one unless
    step N finished the request) and the tokens it runs; ``x.start`` and ``x.num_tokens`` but
    under async scheduling with drafts."""
    ran = dict(s.drafts_run)
    num_tokens = x.num_tokens - x.num_draft_tokens + ran[x.request_id] if x.request_id in ran else x.num_tokens
    if s.in_flight is None:
        return x.start, x.start, num_tokens
    back = _rejected(s, x.request_id)
    if back is not None:
        return x.start - back, x.start - back, num_tokens
    y = next(y for y in s.scheduler.scheduled if y.request_id == x.request_id)  # it kept 1 + at least len - 1 drafts
    return x.start - y.num_draft_tokens + len(y.new_token_ids) - 1, x.start, num_tokens


def _check_drafts_run(s: StepSnapshot, where: str) -> None:
    """NOTE 4: the runner counts the drafts of each row it gave placeholders, at most as many."""
    if s.dispatch is None or s.in_flight is None:
        assert not s.drafts_run, f"{where}: drafts run {s.drafts_run} with no step in flight launched"
        return
    given = {x.request_id: x.num_draft_tokens for x in s.in_flight if x.num_draft_tokens}
    ran = dict(s.drafts_run)
    assert len(ran) == len(s.drafts_run) and ran.keys() == given.keys(), (
        f"{where}: the runner ran drafts {s.drafts_run}, the step in flight has placeholders {given}"
    )
    assert all(0 <= ran[rid] <= k for rid, k in given.items() if rid in ran), f"{where}: drafts run {ran} of {given}"


def _check_batch(s: StepSnapshot, where: str) -> None:
    b = s.batch
    assert len(set(b.rows)) == len(b.rows), f"{where}: a request holds two rows: {b.rows}"
    assert b.replay() == b.rows, (
        f"{where}: rows {b.previous_rows} with removed {b.removed}, added {b.added}, moved {b.moved} "
        f"give {b.replay()}, not {b.rows}"
    )
    if not b.changed:
        assert not (b.removed or b.added or b.moved), f"{where}: an unchanged batch with an update"
    if s.scheduler is not None and (_runner_step(s) or b.rows):
        want = {x.request_id for x in _runner_step(s)}
        assert set(b.rows) == want, f"{where}: batch rows {b.rows} != the step's requests {sorted(want)}"


def _check_dispatch(s: StepSnapshot, where: str) -> None:
    d = s.dispatch
    assert d.runtime_mode in RUNTIME_MODES, f"{where}: runtime mode {d.runtime_mode!r}"
    assert d.padded_num_tokens >= d.num_tokens, f"{where}: {d.num_tokens} tokens padded to {d.padded_num_tokens}"
    if d.runtime_mode == "NONE":
        assert d.num_padding_tokens == 0, f"{where}: an eager step padded {d.num_padding_tokens} tokens"
    else:
        assert d.padded_num_tokens in d.capture_sizes, (
            f"{where}: {d.runtime_mode} replays {d.padded_num_tokens} tokens, not a capture size of {d.capture_sizes}"
        )
    if d.runtime_mode == "FULL":
        assert d.padded_num_reqs is not None and d.padded_num_reqs >= d.num_reqs, (
            f"{where}: a FULL graph for {d.padded_num_reqs} requests runs {d.num_reqs}"
        )
    if d.runtime_mode == "PIECEWISE":
        assert d.padded_num_reqs is None, f"{where}: a PIECEWISE key names {d.padded_num_reqs} requests"
    assert not s.slots or len(s.slots) == d.num_tokens, f"{where}: {len(s.slots)} slots written by {d.num_tokens} tokens"
    if s.scheduler is not None:
        ran = _runner_step(s)
        num_tokens = sum(x.num_tokens for x in ran)
        runs = sum(_runner_row(s, x)[2] for x in ran)  # NOTE 4: the drafts the runner proposed
        assert d.num_tokens == runs and d.num_reqs == len(ran), (
            f"{where}: dispatch of {d.num_tokens} tokens, {d.num_reqs} requests; the scheduler ran "
            f"{num_tokens} tokens of {len(ran)} requests, the runner {runs}"
        )


def _check_slots(s: StepSnapshot, block_size: int, num_blocks: int, where: str) -> None:
    if not s.slots:
        return
    assert block_size > 0, f"{where}: slots written without a KV cache"
    slots = [w.slot for w in s.slots]
    assert len(set(slots)) == len(slots), f"{where}: a slot is written twice: {sorted(slots)}"
    positions = [(w.request_id, w.position) for w in s.slots]
    assert len(set(positions)) == len(positions), f"{where}: a position is written twice"
    for w in s.slots:
        assert 0 <= w.slot < num_blocks * block_size, f"{where}: slot {w.slot} outside {num_blocks} blocks of {block_size}"
        request = s.request(w.request_id)
        if request is not None and request.block_ids:  # NOTE 1
            index = w.position // block_size
            assert index < len(request.block_ids), f"{where}: {w.request_id!r} position {w.position} past its blocks"
            want = request.block_ids[index] * block_size + w.position % block_size
            assert w.slot == want, f"{where}: {w.request_id!r} position {w.position} wrote slot {w.slot}, its table says {want}"
    if s.scheduler is not None:
        for x in _runner_step(s):
            got = sorted(w.position for w in s.slots if w.request_id == x.request_id)
            lo, hi, num_tokens = _runner_row(s, x)  # NOTE 4
            start = got[0] if got else lo
            assert got == list(range(start, start + len(got))) and lo <= start <= hi, (
                f"{where}: {x.request_id!r} wrote positions {got}, it was scheduled {x.start}..{x.start + x.num_tokens - 1}"
                f", the runner starts at {lo if lo == hi else (lo, hi)}"
            )
            assert len(got) == num_tokens, (
                f"{where}: {x.request_id!r} wrote {len(got)} positions, it was scheduled {x.num_tokens}, the runner ran {num_tokens}"
            )
