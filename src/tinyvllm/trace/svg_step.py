"""One step of a trace as one SVG picture: a panel per part of the engine's state.

Concept: ``step_svg(trace, index)`` draws the snapshot of step ``index`` top to bottom, one
panel per name in ``trace.panels`` (or the ``panels`` asked for): the scheduler's token
budget and queues, the block tables, the block pool, the free queue, the prefix cache
map, the persistent batch around its ``BatchUpdate``, the CUDA-graph dispatch and its
padding, and the KV cache tensor with the slots the step wrote. Every request keeps one
colour (``svg_parts.request_colours``).

Follows: seed 002 §3.2's figures (block tables, prefix cache, free queue), seed 003 "KV
cache物理内存分配" (the cache tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]``
of one layer, drawn as its slots: a row per block, a cell per offset), seed 001 appendix
U2 (rows, holes, moves), seed 000 ("BatchDescriptor", padding to a capture size).
Mirrors: nothing in vLLM.

Invariants: the drawn counts are the snapshot's: one ``free-block`` per block of the free
queue, one ``table-block`` per entry of each block table, one ``running`` / ``waiting`` chip
per queued request, one ``allowed-tokens`` box per constrained request (its counts in
``data-allowed``), one ``batch-row`` per row after the step, one ``slot`` with
``data-written="1"`` per slot written (``tests/test_trace_viewer.py`` counts them in a
browser). A ``free-run`` box stands for ``data-count`` free blocks the run never touched
(NOTE 2): they count as free blocks too.

NOTE 1 (what a block shows): a block of a block table shows the tokens of its request
that are computed (their KV is in the cache) and ``_`` for its empty slots, as tutorial 01
prints them; when they would not fit, it shows how many slots are filled (``14/16``).
NOTE 2 (a real engine's pool): an engine on a real model has thousands of blocks, and a
short run touches a few of them. Past ``MAX_DRAWN_BLOCKS`` blocks, the block pool and the
KV cache panels draw only the blocks the run touched (in use, cached, or written at some
step of the trace), and the free queue draws each run of untouched blocks as one box
that says how many it holds. The snapshot keeps every block; only the picture elides.
NOTE 3 (async scheduling, ``in_flight.py``): a step recorded with the next one on the device
draws that step as a second, dashed budget bar (``in-flight-segment``), a request's
placeholders after its computed count (``+1 placeholder``), and says in the batch,
dispatch and KV cache headings that they show the step in flight.
NOTE 4 (structured outputs): a step with constrained requests draws, under the queues, one
``allowed-tokens`` box per constrained request: how many tokens each of its grammar bitmask
rows allows (``snapshot.py`` NOTE 5); a step without them draws nothing more.
NOTE 5 (async scheduling with speculative decoding): a step's drafts are the scheduler's
placeholders; the runner verifies those it proposed (``recorder.py`` NOTE 8), as many as the
picture of its launch says (``drafts_run``). The bars and notes say "placeholder drafts"; a note
leaves the rejected drafts' slots alone, since the KV cache panel shows the next step's writes.
"""

from __future__ import annotations

from tinyvllm.trace.in_flight import in_flight_number, step_number
from tinyvllm.trace.snapshot import StepSnapshot, Trace, kept_blocks
from tinyvllm.trace.svg_parts import (
    BLOCK_TABLE_ORANGE,
    CACHED_GREY,
    FREE_QUEUE_BLUE,
    MARGIN,
    MONO,
    MUTED,
    PREFIX_CACHE_YELLOW,
    Canvas,
    fit,
    lighten,
    request_colours,
    tokens_text,
    wrap,
)

BOX_W, BOX_H, GAP = 62, 36, 6
LABEL_W = 150
MAX_DRAWN_BLOCKS = 64  # NOTE 2


def touched_blocks(trace: Trace) -> tuple[int, ...] | None:
    """The block ids a picture draws (NOTE 2): None (all of them) for a small pool, else the
    ids in use, cached or written at some step of the trace, in order."""
    if trace.num_blocks <= MAX_DRAWN_BLOCKS:
        return None
    cached = getattr(trace, "_touched_blocks", None)
    if cached is not None:
        return cached
    ids: set[int] = set()
    for step in trace.steps:
        ids.update(b.block_id for b in kept_blocks(step.blocks, step.free_queue))  # in use or cached
        ids.update(block_id for r in step.requests for block_id in r.block_ids)
        ids.update(w.slot // trace.block_size for w in step.slots)
    touched = tuple(sorted(ids))
    object.__setattr__(trace, "_touched_blocks", touched)  # a frozen Trace: memoised beside its fields
    return touched


def step_svg(trace: Trace, index: int, panels: tuple[str, ...] | None = None) -> str:
    """The picture of step ``index`` (one ``<svg>`` string)."""
    snap = trace.steps[index]
    colours = request_colours(trace)
    c = Canvas(f"step{index}")
    _header(c, trace, snap, colours)
    for name in panels or trace.panels:
        DRAW[name](c, trace, snap, colours)
    return c.render(f"{trace.title}: {snap.label}", "step")


def _header(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    c.y = MARGIN
    c.text(MARGIN, c.y + 14, f"{s.label}", 16, font_weight="bold", data_role="step-label")
    c.text(c.width - MARGIN, c.y + 14, f"{trace.title} \u00b7 step {s.index + 1} of {len(trace.steps)}", 11,
           fill=MUTED, text_anchor="end")  # fmt: skip
    c.y += 22
    for line in wrap(s.note, 150):
        c.text(MARGIN, c.y + 12, line, 11.5)
        c.y += 16
    ids = [r.request_id for r in s.requests] or ([*s.batch.rows] if s.batch else [])
    x = MARGIN
    for rid in ids:
        c.rect(x, c.y + 4, 12, 12, colours[rid], None, rx=2)
        c.text(x + 16, c.y + 14, rid, 11)
        x += 24 + 7 * len(rid)
    c.y += 20 if ids else 0


def _in_flight(trace: Trace, s: StepSnapshot) -> str:
    """NOTE 3: the runner's panels show the step in flight, if there is one."""
    return "" if s.in_flight is None else f"step {in_flight_number(trace.steps, s.index)}, in flight: "


def _chips(c: Canvas, x: float, y: float, ids: tuple[str, ...], role: str, colours: dict[str, str]) -> float:
    for rid in ids:
        w = 14 + 7 * len(rid)
        c.rect(x, y, w, 20, lighten(colours[rid], 0.35), colours[rid], rx=4, data_role=role, data_request=rid)
        c.text(x + w / 2, y + 14, rid, 11, text_anchor="middle")
        x += w + 4
    return x


def _scheduler(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    d = s.scheduler
    if d is None:
        return
    c.heading("Scheduler", f"token budget {d.token_budget}, used {d.tokens_used} by {len(d.scheduled)} requests")
    x0, width = MARGIN + 90, c.width - 2 * MARGIN - 90
    c.text(MARGIN, c.y + 20, "this step", 11, fill=MUTED)
    c.rect(x0, c.y + 4, width, 26, c.hatch, "#bbbbbb", rx=3, data_role="budget")
    x = x0
    for r in d.scheduled:
        w = width * r.num_tokens / d.token_budget
        c.rect(x, c.y + 4, w, 26, lighten(colours[r.request_id], 0.35), colours[r.request_id], rx=3,
               data_role="budget-segment", data_request=r.request_id, data_tokens=r.num_tokens)  # fmt: skip
        mark = {"chunk": " chunk (no token)", "prefill": " prefill", "decode": " decode"}[r.kind]
        placeholders = any(step.in_flight is not None for step in trace.steps)  # async scheduling: NOTE 5
        if r.num_draft_tokens:
            mark = f" = 1 + {r.num_draft_tokens} {'placeholder drafts' if placeholders else 'drafts'}"
        for label in (f"{r.request_id}: {r.num_tokens}{mark}", f"{r.request_id}: {r.num_tokens}", r.request_id):
            if len(label) * 6.6 + 6 <= w:
                c.text(x + w / 2, c.y + 21, label, 11, text_anchor="middle")
                break
        x += w
    c.y += 38
    flight_note = _in_flight_bar(c, trace, s, x0, width, d.token_budget, colours) if s.in_flight is not None else ""  # NOTE 3
    for name, ids in (("running", d.running), ("waiting", d.waiting)):
        c.text(MARGIN, c.y + 14, name, 11, fill=MUTED)
        end = _chips(c, x0, c.y, ids, name, colours)
        if not ids:
            c.text(end, c.y + 14, "(empty)", 11, fill=MUTED)
        c.y += 26
    _grammar_rows(c, d, x0, colours)
    notes = [f"{x.request_id} admitted ({x.admitted}): {x.num_hit_tokens} tokens from the prefix cache"
             for x in d.scheduled if x.admitted]  # fmt: skip
    ran = _drafts_ran(trace, s)  # NOTE 5: the runner's count, from the picture that showed this step launched
    notes += [_drafts_note(x, placeholders, ran.get(x.request_id)) for x in d.scheduled if x.num_draft_tokens and x.new_token_ids]
    where = "by its priority" if any(r.priority for r in s.requests) else "at the front"  # core/request_queue.py
    notes += [f"{rid} preempted: its blocks are freed, it waits {where}" for rid in d.preempted]
    reasons = {x.request_id: x.finish_reason for x in d.scheduled}
    notes += [f"{rid} finished ({reasons.get(rid) or 'aborted'})" for rid in d.finished]
    notes += [flight_note] if flight_note else []
    for line in wrap("; ".join(notes), 150):
        c.text(MARGIN, c.y + 12, line, 11)
        c.y += 16


def _grammar_rows(c: Canvas, d, x0: float, colours: dict[str, str]) -> None:
    """NOTE 4: each constrained request's allowed-token count per bitmask row (drafts: one per position)."""
    constrained = [r for r in d.scheduled if r.num_allowed_tokens is not None]
    if not constrained:
        return
    c.text(MARGIN, c.y + 14, "grammar", 11, fill=MUTED)
    x = x0
    for r in constrained:
        label = f"{r.request_id}: {' / '.join(str(n) for n in r.num_allowed_tokens)} allowed"
        w = 14 + 6.6 * len(label)
        c.rect(x, c.y, w, 20, lighten(colours[r.request_id], 0.7), colours[r.request_id], rx=4, data_role="allowed-tokens",
               data_request=r.request_id, data_allowed=" ".join(str(n) for n in r.num_allowed_tokens))  # fmt: skip
        c.text(x + w / 2, c.y + 14, label, 11, text_anchor="middle")
        x += w + 4
    c.y += 26


def _in_flight_bar(
    c: Canvas, trace: Trace, s: StepSnapshot, x0: float, width: float, budget: int, colours: dict[str, str]
) -> str:
    """NOTE 3: the next step, launched before this one was read back, dashed; returns its note."""
    c.text(MARGIN, c.y + 20, "in flight", 11, fill=MUTED)
    c.rect(x0, c.y + 4, width, 26, "#ffffff", "#bbbbbb", rx=3, stroke_dasharray="4 3", data_role="in-flight")
    x = x0
    for r in s.in_flight:
        w = width * r.num_tokens / budget
        c.rect(x, c.y + 4, w, 26, lighten(colours[r.request_id], 0.7), colours[r.request_id], rx=3, stroke_dasharray="4 3",
               data_role="in-flight-segment", data_request=r.request_id, data_tokens=r.num_tokens)  # fmt: skip
        drafts = f" (1 + {r.num_draft_tokens} placeholder drafts)" if r.num_draft_tokens else ""  # NOTE 5
        for label in (f"{r.request_id}: {r.num_tokens} {r.kind}{drafts}", f"{r.request_id}: {r.num_tokens} {r.kind}",
                      f"{r.request_id}: {r.num_tokens}", r.request_id):  # fmt: skip
            if len(label) * 6.6 + 6 <= w:
                c.text(x + w / 2, c.y + 21, label, 11, text_anchor="middle")
                break
        x += w
    if not s.in_flight:
        c.text(x0 + 8, c.y + 21, "an empty step: nothing scheduled", 11, fill=MUTED)
    c.y += 34
    waiting = [f"{r.request_id} +{r.num_output_placeholders}" for r in s.requests if r.num_output_placeholders]
    n = in_flight_number(trace.steps, s.index)
    while_ = "just launched, nothing read back yet" if s.launched else "runs on the device while this step is read back"
    note = (f"step {n} {while_}; its tokens arrive with the next "
            f"picture. Placeholders (the token step {n} samples, known on the device only): "
            f"{', '.join(waiting) or 'none'}")  # fmt: skip
    if s.drafts_run:  # NOTE 5
        note += "; the runner runs its own drafts in place of the placeholders: " + ", ".join(
            f"{rid} {k} of {next(r.num_draft_tokens for r in s.in_flight if r.request_id == rid)}" for rid, k in s.drafts_run)
    dropped = [r.request_id for r in s.in_flight if s.scheduler is not None and r.request_id in s.scheduler.finished]
    if dropped:
        whose = "its" if len(dropped) == 1 else "their"
        note += f"; {', '.join(dropped)} finished in this step: {whose} step {n} token is dropped"
    return note


def _drafts_ran(trace: Trace, s: StepSnapshot) -> dict[str, int]:
    """NOTE 5: how many drafts the runner ran for each row of the step ``s`` reads back, as the
    snapshot before (the one whose step in flight it was) says; empty when none did."""
    before = s.index - 1
    if before < 0 or in_flight_number(trace.steps, before) != step_number(trace.steps, s.index):
        return {}
    return dict(trace.steps[before].drafts_run)


def _drafts_note(x, placeholders: bool = False, ran: int | None = None) -> str:
    """What a verification step did with one request's drafts (speculative decoding; NOTE 5)."""
    kept = len(x.new_token_ids) - 1
    if placeholders:  # the KV panel shows the next step's writes: no hatch for this one's rejected
        proposed = "those it proposed" if ran is None else f"the {ran} it proposed"
        return (f"{x.request_id} had {x.num_draft_tokens} placeholder drafts, and the runner verified {proposed}: "
                f"kept {kept}, then 1 token of the target's")  # fmt: skip
    note = f"{x.request_id} verified {x.num_draft_tokens} drafts: kept {kept}, then 1 token of the target's"
    rejected = x.num_draft_tokens - kept
    if rejected:
        what = "its KV slot, hatched, is" if rejected == 1 else "their KV slots, hatched, are"
        note += f" ({rejected} rejected: {what} written again next step)"
    return note


def _owners(s: StepSnapshot) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for r in s.requests:
        for block_id in r.block_ids:
            owners.setdefault(block_id, []).append(r.request_id)
    return owners


def _block_tables(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    c.heading("Block tables", "each request's blocks in order; * = in the prefix cache; thick = shared", BLOCK_TABLE_ORANGE)
    bs = trace.block_size
    per_row = max(int((c.width - 2 * MARGIN - LABEL_W) // (BOX_W + GAP)), 1)
    if not s.requests:
        c.text(MARGIN, c.y + 14, "(no unfinished request)", 11, fill=MUTED)
        c.y += 22
    show_priority = any(r.priority for r in s.requests)  # a run under the priority policy
    for r in s.requests:
        name = f"{r.request_id} (priority {r.priority})" if show_priority else r.request_id
        c.text(MARGIN, c.y + 15, name, 12, font_weight="bold", fill=colours[r.request_id])
        status = f"{r.status.lower()}, " if s.scheduler is not None else ""  # a manager driven by hand has none
        pending = f" +{r.num_output_placeholders} placeholder" if r.num_output_placeholders else ""  # NOTE 3
        c.text(MARGIN, c.y + 29, f"{status}{r.num_computed_tokens}/{r.num_tokens} computed{pending}", 9.5, fill=MUTED)
        if not r.block_ids:
            c.text(MARGIN + LABEL_W, c.y + 22, "no blocks", 11, fill=MUTED)
        for i, block_id in enumerate(r.block_ids):
            x = MARGIN + LABEL_W + (i % per_row) * (BOX_W + GAP)
            y = c.y + (i // per_row) * (BOX_H + GAP)
            computed = r.token_ids[i * bs : min((i + 1) * bs, r.num_computed_tokens)]
            shared = s.blocks[block_id].ref_cnt > 1
            c.rect(x, y, BOX_W, BOX_H, "#ffffff", colours[r.request_id], rx=3, stroke_width=3 if shared else 1.2,
                   data_role="table-block", data_request=r.request_id, data_block=block_id)  # fmt: skip
            c.rect(x + 1.5, y + 1.5, (BOX_W - 3) * len(computed) / bs, BOX_H - 3, lighten(colours[r.request_id], 0.55), None)
            c.text(x + 4, y + 11, f"#{block_id}" + (" *" if i < r.num_cached_blocks else ""), 9.5, fill=MUTED)
            text = tokens_text(trace, computed)
            text += (" _" if " " in text else "_") * (bs - len(computed))
            if len(text) > 9:  # NOTE 1
                text = f"{len(computed)}/{bs}"
            c.text(x + BOX_W / 2, y + 29, text, 11, text_anchor="middle", font_family=MONO)
        rows = max((len(r.block_ids) + per_row - 1) // per_row, 1)
        c.y += rows * (BOX_H + GAP) + 4


def _block_pool(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    shown = touched_blocks(trace)
    elided = "" if shown is None else f"; drawn: the {len(shown)} the run touched"
    c.heading("Block pool", f"{len(s.blocks)} blocks, {s.num_free_blocks} free (dashed){elided}; fill = the requests holding it; grey = free but still cached")
    owners = _owners(s)
    per_row = max(int((c.width - 2 * MARGIN) // (BOX_W + GAP)), 1)
    blocks = s.blocks if shown is None else [s.blocks[i] for i in shown]
    for place, b in enumerate(blocks):
        x = MARGIN + (place % per_row) * (BOX_W + GAP)
        y = c.y + (place // per_row) * (BOX_H + GAP + 4)
        holders = owners.get(b.block_id, [])
        free = b.free_position is not None
        fill = CACHED_GREY if free and b.block_hash else "#ffffff"
        c.rect(x, y, BOX_W, BOX_H + 4, fill, "#999999" if free else "#333333", rx=3,
               stroke_dasharray="4 3" if free else None, data_role="pool-block", data_block=b.block_id,
               data_free=int(free), data_ref=b.ref_cnt)  # fmt: skip
        for k, rid in enumerate(holders):
            w = (BOX_W - 2) / len(holders)
            c.rect(x + 1 + k * w, y + 1, w, BOX_H + 2, lighten(colours[rid], 0.45), None)
        c.text(x + 4, y + 12, f"#{b.block_id}", 10, font_weight="bold")
        c.text(x + BOX_W - 4, y + 12, f"ref {b.ref_cnt}", 9, text_anchor="end", fill=MUTED)
        if b.block_hash:
            label = tokens_text(trace, b.hash_tokens)
            c.text(x + BOX_W / 2, y + 31, fit(label if len(label) <= 9 else b.block_hash[:8], BOX_W - 4, 10), 10,
                   text_anchor="middle", font_family=MONO)  # fmt: skip
    c.y += ((len(blocks) + per_row - 1) // per_row) * (BOX_H + GAP + 4)


def _free_queue_entries(trace: Trace, s: StepSnapshot) -> list[tuple[int, int]]:
    """The free queue as drawn (NOTE 2): ``(block_id, 1)`` per block, and ``(-1, n)`` for each
    run of n blocks the trace never touched."""
    shown = touched_blocks(trace)
    if shown is None:
        return [(block_id, 1) for block_id in s.free_queue]
    keep, entries = set(shown), []
    for block_id in s.free_queue:
        if block_id in keep:
            entries.append((block_id, 1))
        elif entries and entries[-1][0] == -1:
            entries[-1] = (-1, entries[-1][1] + 1)
        else:
            entries.append((-1, 1))
    return entries


def _free_queue(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    c.heading("Free block queue", "head (reused first) \u2192 tail; * = still cached, a hit can take it back", FREE_QUEUE_BLUE)
    w, h, gap = 44, 26, 14
    x0 = MARGIN + 44
    per_row = max(int((c.width - x0 - MARGIN - 40) // (w + gap)), 1)
    c.text(MARGIN, c.y + 17, "head", 11, fill=MUTED)
    if not s.free_queue:
        c.text(x0, c.y + 17, "(empty: every block is in use)", 11, fill=MUTED)
    entries = _free_queue_entries(trace, s)
    for i, (block_id, count) in enumerate(entries):
        x = x0 + (i % per_row) * (w + gap)
        y = c.y + (i // per_row) * (h + 10)
        if block_id < 0:  # NOTE 2: a run of blocks never touched
            c.rect(x, y, w, h, "#f4f4f4", "#aaaaaa", rx=4, stroke_dasharray="3 2", data_role="free-run", data_count=count)
            c.text(x + w / 2, y + 11, f"{count}", 9.5, text_anchor="middle", fill=MUTED)
            c.text(x + w / 2, y + 21, "unused", 8, text_anchor="middle", fill=MUTED)
        else:
            cached = s.blocks[block_id].block_hash is not None
            c.rect(x, y, w, h, lighten(FREE_QUEUE_BLUE, 0.5) if cached else "#ffffff", FREE_QUEUE_BLUE, rx=4,
                   data_role="free-block", data_block=block_id)  # fmt: skip
            c.text(x + w / 2, y + 17, f"{block_id}" + ("*" if cached else ""), 11, text_anchor="middle", font_weight="bold")
        if i + 1 < len(entries) and (i + 1) % per_row:
            c.line(x + w + 1, y + h / 2, x + w + gap - 1, y + h / 2, marker_end=c.arrow)
    rows = max((len(entries) + per_row - 1) // per_row, 1)
    last = len(entries) - 1
    if entries:
        c.text(x0 + (last % per_row) * (w + gap) + w + 6, c.y + (last // per_row) * (h + 10) + 17, "tail", 11, fill=MUTED)
    c.y += rows * (h + 10)


def _prefix_cache(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    c.heading("Prefix cache", "cached_block_hash_to_block: a full block's content \u2192 the blocks holding it", PREFIX_CACHE_YELLOW)
    if not s.hash_map:
        c.text(MARGIN, c.y + 14, "(empty)", 11, fill=MUTED)
        c.y += 22
        return
    col_w = (c.width - 2 * MARGIN) / 3
    for i, (block_hash, ids) in enumerate(s.hash_map):
        x, y = MARGIN + (i % 3) * col_w, c.y + (i // 3) * 26
        label = tokens_text(trace, s.blocks[ids[0]].hash_tokens)
        label = label if len(label) <= 18 else f"{block_hash[:10]}\u2026"
        dup = len(ids) > 1
        c.rect(x, y, col_w - 8, 22, lighten(PREFIX_CACHE_YELLOW, 0.45), "#d9534f" if dup else PREFIX_CACHE_YELLOW, rx=3,
               stroke_width=2 if dup else 1, data_role="cache-entry", data_blocks=" ".join(map(str, ids)))  # fmt: skip
        c.text(x + 6, y + 15, label, 11, font_family=MONO)
        c.text(x + col_w - 14, y + 15, "\u2192 block" + ("s " if dup else " ") + ", ".join(map(str, ids)), 11,
               text_anchor="end", font_weight="bold" if dup else None)  # fmt: skip
    c.y += ((len(s.hash_map) + 2) // 3) * 26


def _batch(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    b = s.batch
    if b is None:
        return
    if b.changed:
        arrow = {"SWAP": "\u2194", "UNIDIRECTIONAL": "\u2192"}
        moved = ", ".join(f"{m.src}{arrow[m.direction]}{m.dst}" for m in b.moved)
        summary = f"BatchUpdate: removed {list(b.removed)}, added {[f'{row}:{rid}' for row, rid in b.added]}, moved [{moved}]"
    else:
        summary = "no change: refresh() handed out no BatchUpdate"
    c.heading("Persistent batch", _in_flight(trace, s) + summary)
    mid = b.rows_before_moves()
    cols = (("before the step", b.previous_rows), ("removed, then added", mid), ("after condense()", b.rows))
    col_x = [MARGIN + 40, MARGIN + 340, MARGIN + 640]
    row_h, w = 26, 200
    for (title, _), x in zip(cols, col_x):
        c.text(x, c.y + 12, title, 11, fill=MUTED)
    top = c.y + 20
    removed_ids = {b.previous_rows[row] for row in b.removed if row < len(b.previous_rows)}
    added_rows = {row for row, _ in b.added}
    for k, ((_, rows), x) in enumerate(zip(cols, col_x)):
        for row, rid in enumerate(rows):
            y = top + row * row_h
            c.text(x - 8, y + 15, str(row), 10, text_anchor="end", fill=MUTED)
            if rid is None:
                c.rect(x, y, w, row_h - 5, "#ffffff", "#aaaaaa", rx=3, stroke_dasharray="4 3")
                c.text(x + 8, y + 15, "hole", 11, fill=MUTED)
                continue
            role = "batch-row" if k == 2 else None
            c.rect(x, y, w, row_h - 5, lighten(colours[rid], 0.4), colours[rid], rx=3, data_role=role, data_request=rid if role else None)
            mark = ""
            if k == 0 and rid in removed_ids | (set(b.previous_rows) - set(b.rows)):
                mark = "  \u2715 leaves"
            if k == 1 and row in added_rows:
                mark = "  + added"
            c.text(x + 8, y + 15, rid + mark, 11)
    for m in b.moved:
        y1, y2 = top + m.src * row_h + 10, top + m.dst * row_h + 10
        c.line(col_x[1] + w + 4, y1, col_x[2] - 6, y2, marker_end=c.arrow,
               marker_start=c.arrow if m.direction == "SWAP" else None, stroke_width=1.5)  # fmt: skip
    c.y = top + max(len(b.previous_rows), len(mid), len(b.rows), 1) * row_h + 4


def _dispatch(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    d = s.dispatch
    if d is None:
        c.heading("CUDA-graph dispatch", _in_flight(trace, s) + "no forward in this step")
        return
    reqs = "" if d.padded_num_reqs is None else f", num_reqs={d.padded_num_reqs}"
    c.heading("CUDA-graph dispatch", f"{_in_flight(trace, s)}runtime mode {d.runtime_mode}, BatchDescriptor(num_tokens={d.padded_num_tokens}"
              f"{reqs}, uniform={d.descriptor_uniform})")  # fmt: skip
    c.text(MARGIN, c.y + 12, f"{d.num_tokens} tokens of {d.num_reqs} requests"
           + (" (a uniform decode batch)" if d.uniform_decode else "")
           + f" + {d.num_padding_tokens} padding token{'s' if d.num_padding_tokens != 1 else ''}"
           + (f"; capture sizes {list(d.capture_sizes)}" if d.capture_sizes else "; eager: nothing is padded"), 11)  # fmt: skip
    c.y += 20
    scale_to = max([d.padded_num_tokens, *d.capture_sizes])
    x0, width = MARGIN + 40, c.width - 2 * MARGIN - 40
    cell = width / scale_to
    owners = [w.request_id for w in s.slots]
    for size in d.capture_sizes:
        x = x0 + size * cell
        c.line(x, c.y, x, c.y + 42, "#999999", stroke_dasharray="2 2")
        c.text(x - 2, c.y + 9, str(size), 9, text_anchor="end", fill=MUTED)
    y = c.y + 12
    if d.padded_num_tokens <= 128:
        for i in range(d.padded_num_tokens):
            real = i < d.num_tokens
            rid = owners[i] if real and i < len(owners) else None
            fill = lighten(colours[rid], 0.3) if rid else ("#dddddd" if real else c.hatch)
            c.rect(x0 + i * cell, y, cell, 24, fill, "#ffffff", data_role="real-token" if real else "pad-token")
    else:
        c.rect(x0, y, d.num_tokens * cell, 24, "#dddddd", "#888888", data_role="real-tokens")
        c.rect(x0 + d.num_tokens * cell, y, d.num_padding_tokens * cell, 24, c.hatch, "#888888", data_role="pad-tokens")
    c.y += 46


def _kv_cache(c: Canvas, trace: Trace, s: StepSnapshot, colours: dict[str, str]) -> None:
    bs = trace.block_size
    shown = touched_blocks(trace)
    blocks = s.blocks if shown is None else [s.blocks[i] for i in shown]
    n = len(blocks)
    elided = "" if shown is None else f"; drawn: the {n} blocks the run touched"
    cache = f"one layer's [2, {trace.num_blocks}, {bs}, num_kv_heads, head_size]: a row per block, a cell per slot"
    if s.in_flight is None:
        c.heading("KV cache", f"{cache} (block_id * block_size + offset); bold: written this step{elided}")
    else:  # NOTE 3
        c.heading("KV cache", f"{_in_flight(trace, s)}bold = its writes; {cache} (block_id * block_size + offset){elided}")
    cell = min(24.0, (c.width - 2 * MARGIN - 70) / bs)
    col_w = 70 + bs * cell + 16
    ncols = max(int((c.width - 2 * MARGIN) // col_w), 1)
    per_col = n if n <= 16 else max(10, -(-n // ncols))
    holds: dict[int, str] = {}  # slot -> the request whose computed token it holds
    for r in s.requests:
        for i, block_id in enumerate(r.block_ids):
            for offset in range(bs):
                if i * bs + offset < r.num_computed_tokens:
                    holds.setdefault(block_id * bs + offset, r.request_id)
    written = {w.slot: w for w in s.slots}
    present = {r.request_id for r in s.requests}
    for place, b in enumerate(blocks):
        col, row = divmod(place, per_col)
        x0, y = MARGIN + col * col_w, c.y + row * (cell + 3)
        c.text(x0 + 60, y + cell * 0.7, f"block {b.block_id}", 10, text_anchor="end", fill=MUTED)
        for offset in range(bs):
            slot = b.block_id * bs + offset
            w = written.get(slot)
            rid = holds.get(slot) or (w.request_id if w else None)  # a finished request's last write too
            fill = lighten(colours[rid], 0.45) if rid else (CACHED_GREY if b.block_hash else "#ffffff")
            if w and slot not in holds and w.request_id in present:
                fill = c.hatch  # written for a draft the target rejected: not computed, written again next step
            c.rect(x0 + 66 + offset * cell, y, cell - 1, cell, fill, "#222222" if w else "#c8c8c8",
                   stroke_width=2 if w else 0.6, data_role="slot", data_slot=slot, data_written=1 if w else None,
                   data_request=w.request_id if w else None)  # fmt: skip
            if cell >= 20:
                c.text(x0 + 66 + offset * cell + cell / 2, y + cell * 0.68, str(slot), 8, text_anchor="middle",
                       fill="#000000" if w else "#888888", font_weight="bold" if w else None)  # fmt: skip
    c.y += min(n, per_col) * (cell + 3) + 4


DRAW = {
    "scheduler": _scheduler,
    "block_tables": _block_tables,
    "block_pool": _block_pool,
    "free_queue": _free_queue,
    "prefix_cache": _prefix_cache,
    "batch": _batch,
    "dispatch": _dispatch,
    "kv_cache": _kv_cache,
}
