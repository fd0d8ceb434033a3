"""Whole-run pictures of a trace: every step side by side in one SVG.

Concept: a step's picture (``svg_step.py``) shows the whole state once; these show one
aspect across all steps, the way the documents draw a sequence:

- ``budget_timeline_svg``: the token budget of each step filled by the requests it ran
  (chunks, decodes), with admissions, preemptions and finishes under each step: the
  scheduler page's timeline (seed 002's opening: a budget per step, mixed prefill and
  decode, chunked prefill, preemption);
- ``block_tables_timeline_svg``: every request's block table at each step, with how full
  each block is, and the prefix cache entries that hold one content twice: seed 004's
  "Duplication" figure (Time 1-4);
- ``padding_timeline_svg``: each step's real tokens and its padding up to the captured
  size, with the runtime mode and ``BatchDescriptor``: seed 000's dispatch and padding.
  Under async scheduling a snapshot's dispatch is the step in flight's (``in_flight.py``),
  so its column draws and names that step.

Follows: the sections named above. Mirrors: nothing in vLLM.

Invariants: one ``data-role="timeline-step"`` group per step of the trace; within it one
``timeline-segment`` per scheduled request (budget), ``timeline-block`` per block-table
entry (block tables), ``timeline-pad`` when the step padded (padding).
"""

from __future__ import annotations

from tinyvllm.trace.in_flight import in_flight_number, step_number
from tinyvllm.trace.snapshot import Trace
from tinyvllm.trace.svg_parts import MARGIN, MONO, MUTED, PREFIX_CACHE_YELLOW, Canvas, lighten, request_colours

AXIS_W = 56


def _legend(c: Canvas, colours: dict[str, str]) -> None:
    x = MARGIN
    for rid, colour in colours.items():
        c.rect(x, c.y + 2, 12, 12, colour, None, rx=2)
        c.text(x + 16, c.y + 12, rid, 11)
        x += 26 + 7 * len(rid)
    c.y += 22


def _columns(c: Canvas, n: int, max_w: float = 70) -> tuple[float, float]:
    """The x of the first column and the width of each."""
    width = min(max_w, (c.width - 2 * MARGIN - AXIS_W) / max(n, 1))
    return MARGIN + AXIS_W, width


def _titled(uid: str, title: str, subtitle: str, gap: float) -> Canvas:
    """A canvas that starts with a whole-run picture's title and its one-line subtitle."""
    c = Canvas(uid)
    c.y = MARGIN
    c.text(MARGIN, c.y + 14, title, 16, font_weight="bold")
    c.y += 24
    c.text(MARGIN, c.y + 10, subtitle, 11, fill=MUTED)
    c.y += gap
    return c


def budget_timeline_svg(trace: Trace) -> str:
    """Each step's token budget, filled by the requests it scheduled (module header)."""
    steps = [s for s in trace.steps if s.scheduler is not None]
    if not steps:
        raise ValueError(f"the trace {trace.title!r} has no scheduler decisions to draw")
    colours = request_colours(trace)
    c = _titled("budget", "Token budget, step by step",
                f"{trace.title}. A bar is one step's budget; * = a chunk (a partial prefill: no token).", 18)  # fmt: skip
    _legend(c, colours)
    budget = max(s.scheduler.token_budget for s in steps)
    height, top = 180.0, c.y + 8
    x0, col = _columns(c, len(steps))
    c.line(x0 - 6, top, x0 + col * len(steps), top, "#d9534f", stroke_dasharray="5 3")
    c.text(x0 - 10, top + 4, f"{budget}", 10, text_anchor="end", fill="#d9534f")
    c.text(x0 - 10, top + height + 4, "0", 10, text_anchor="end", fill=MUTED)
    for i, s in enumerate(steps):
        d = s.scheduler
        x = x0 + i * col
        c.open(data_role="timeline-step", data_step=s.index, data_tokens=d.tokens_used)
        y = top + height
        for r in d.scheduled:
            h = height * r.num_tokens / budget
            y -= h
            c.rect(x + 4, y, col - 8, h, lighten(colours[r.request_id], 0.3), colours[r.request_id],
                   data_role="timeline-segment", data_request=r.request_id, data_tokens=r.num_tokens)  # fmt: skip
            if h >= 13:
                c.text(x + col / 2, y + h / 2 + 4, f"{r.request_id}:{r.num_tokens}{'*' if r.kind == 'chunk' else ''}",
                       10, text_anchor="middle")  # fmt: skip
        c.text(x + col / 2, top + height + 14, str(s.index), 10, text_anchor="middle", fill=MUTED)
        events = [f"+{x.request_id}" + (f" hit {x.num_hit_tokens}" if x.num_hit_tokens else "") for x in d.scheduled if x.admitted]
        events += [f"\u2715{rid} preempted" for rid in d.preempted] + [f"\u2713{rid}" for rid in d.finished]
        for k, event in enumerate(events):
            colour = "#d9534f" if "\u2715" in event else ("#2e7d32" if "\u2713" in event else "#333333")
            c.text(x + col / 2, top + height + 28 + 12 * k, event, 9, text_anchor="middle", fill=colour)
        c.close()
    c.text(x0 - 10, top + height + 14, "step", 10, text_anchor="end", fill=MUTED)
    most = max(len([x for x in s.scheduler.scheduled if x.admitted]) + len(s.scheduler.preempted)
               + len(s.scheduler.finished) for s in steps)  # fmt: skip
    c.y = top + height + 24 + 12 * most
    return c.render(f"{trace.title}: the token budget step by step", "budget-timeline")


def block_tables_timeline_svg(trace: Trace) -> str:
    """Every request's block table at each step, and the duplicated cache entries (module header)."""
    if not trace.block_size:
        raise ValueError(f"the trace {trace.title!r} has no block tables to draw")
    colours = request_colours(trace)
    bs = trace.block_size
    c = _titled("tables", "Block tables, step by step",
                f"A box is a block: its id and how many of its {bs} slots hold computed tokens; bold = cached. "
                "Right: the prefix cache entries that list two blocks.", 22)  # fmt: skip
    label_w, box_w, gap, cache_x = 90, 74, 5, c.width - MARGIN - 230
    for s in trace.steps:
        c.line(MARGIN, c.y, c.width - MARGIN, c.y, "#dddddd")
        c.open(data_role="timeline-step", data_step=s.index)
        c.text(MARGIN, c.y + 18, s.label, 12, font_weight="bold")
        dups = [(h, ids) for h, ids in s.hash_map if len(ids) > 1]
        c.text(cache_x, c.y + 16, f"prefix cache: {len(s.hash_map)} entries", 10, fill=MUTED)
        for k, (h, ids) in enumerate(dups):
            c.rect(cache_x, c.y + 22 + 20 * k, 220, 17, lighten(PREFIX_CACHE_YELLOW, 0.4), "#d9534f", rx=3)
            c.text(cache_x + 6, c.y + 34 + 20 * k, f"{h[:8]}\u2026: [" + ", ".join(f"block{i}" for i in ids) + "]", 10,
                   font_family=MONO)  # fmt: skip
        rows = [r for r in s.requests if r.block_ids] or []
        y = c.y + 6
        for r in rows:
            c.text(MARGIN + label_w, y + 17, r.request_id, 11, font_weight="bold", fill=colours[r.request_id])
            for i, block_id in enumerate(r.block_ids):
                x = MARGIN + label_w + 44 + i * (box_w + gap)
                filled = max(min(r.num_computed_tokens - i * bs, bs), 0)
                full = i < r.num_cached_blocks
                c.rect(x, y + 3, box_w, 22, "#ffffff", colours[r.request_id], rx=3, stroke_width=2.2 if full else 1,
                       data_role="timeline-block", data_request=r.request_id, data_block=block_id)  # fmt: skip
                c.rect(x + 1, y + 4, (box_w - 2) * filled / bs, 20, lighten(colours[r.request_id], 0.55), None)
                text = f"{block_id} ({'full' if filled == bs else f'{filled}/{bs}'})"
                c.text(x + box_w / 2, y + 18, text, 10, text_anchor="middle", font_weight="bold" if full else None)
            y += 28
        if not rows:
            c.text(MARGIN + label_w, y + 17, "(no request holds blocks)", 11, fill=MUTED)
            y += 28
        c.close()
        c.y = max(y, c.y + 26 + 20 * len(dups)) + 6
    return c.render(f"{trace.title}: block tables step by step", "tables-timeline")


def padding_timeline_svg(trace: Trace) -> str:
    """Each step's real tokens, its padding, runtime mode and descriptor (module header)."""
    steps = [s for s in trace.steps if s.dispatch is not None]
    if not steps:
        raise ValueError(f"the trace {trace.title!r} has no CUDA-graph dispatch to draw")
    colours = request_colours(trace)
    sizes = steps[0].dispatch.capture_sizes
    c = _titled("padding", "CUDA-graph dispatch and padding, step by step",
                f"{trace.title}. Hatched = padding up to the captured size; capture sizes {list(sizes)}.", 18)  # fmt: skip
    _legend(c, colours)
    top_size = max([*sizes, *(s.dispatch.padded_num_tokens for s in steps)])
    height, top = 170.0, c.y + 22
    x0, col = _columns(c, len(steps), 96)
    for size in sizes:
        y = top + height - height * size / top_size
        c.line(x0 - 6, y, x0 + col * len(steps), y, "#bbbbbb", stroke_dasharray="2 3")
        c.text(x0 - 10, y + 4, str(size), 10, text_anchor="end", fill=MUTED)
    for i, s in enumerate(steps):
        d, x = s.dispatch, x0 + i * col
        c.open(data_role="timeline-step", data_step=s.index, data_mode=d.runtime_mode)
        y = top + height
        ran = s.in_flight if s.in_flight is not None else s.scheduler.scheduled if s.scheduler else ()
        for r in ran:
            h = height * r.num_tokens / top_size
            y -= h
            c.rect(x + 6, y, col - 12, h, lighten(colours[r.request_id], 0.3), colours[r.request_id], data_role="timeline-segment",
                   data_request=r.request_id)  # fmt: skip
            if h >= 13:
                c.text(x + col / 2, y + h / 2 + 4, f"{r.request_id}:{r.num_tokens}", 10, text_anchor="middle")
        if d.num_padding_tokens:
            h = height * d.num_padding_tokens / top_size
            c.rect(x + 6, y - h, col - 12, h, c.hatch, "#888888", data_role="timeline-pad", data_tokens=d.num_padding_tokens)
        c.text(x + col / 2, top - 8, d.runtime_mode, 9.5, text_anchor="middle", font_weight="bold")
        reqs = "-" if d.padded_num_reqs is None else str(d.padded_num_reqs)
        c.text(x + col / 2, top + height + 14, f"({d.padded_num_tokens}, {reqs}, {'uniform' if d.descriptor_uniform else 'mixed'})",
               9, text_anchor="middle", font_family=MONO)  # fmt: skip
        c.text(x + col / 2, top + height + 27, f"step {in_flight_number(trace.steps, s.index) if s.in_flight is not None else step_number(trace.steps, s.index)}", 9.5, text_anchor="middle", fill=MUTED)
        c.close()
    c.y = top + height + 34
    return c.render(f"{trace.title}: dispatch and padding step by step", "padding-timeline")


RUN_FIGURES = {
    "budget": budget_timeline_svg,
    "tables": block_tables_timeline_svg,
    "padding": padding_timeline_svg,
}
