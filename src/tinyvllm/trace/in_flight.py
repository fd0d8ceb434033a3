"""The step in flight: what a trace shows of async scheduling's overlap.

Concept: with ``async_scheduling=True`` the engine reads step N back only after it scheduled
and launched step N+1 (``engine/llm_engine.py`` NOTE 10), and the step observer is called
then. So the recorder takes step N's snapshot at its read-back, and shows the overlap as
it is rather than hiding it: the scheduler's decisions and sampled tokens are step N's; the
requests, block tables and pool already hold N+1's advance (its computed tokens, its new
blocks, one placeholder per request that N+1 brings to the end of its tokens); the runner's
parts (the persistent batch, the dispatch, the slots written) are N+1's, the newest step the
runner launched. ``StepSnapshot.in_flight`` names N+1's requests and token counts, and the
invariants (``invariants.py`` NOTE 3) check both steps against the snapshot exactly.

Mirrors: nothing in vLLM. Reads the engine's steps in flight (``LLMEngine.steps_in_flight``:
their ``SchedulerOutput``s, oldest first) from outside.

Invariants: only reads; without async scheduling (or with no step in flight) there is no
``in_flight`` step and the snapshot is the synchronous one, byte for byte.

NOTE 1 (at most one): the observer runs after step N was taken off the queue, and at most
two steps are ever in flight, so at most one remains: N+1. A step that scheduled nothing is
in flight too (``in_flight == ()``): the runner still took its removals.
NOTE 2 (kind before the tokens): an in-flight step has sampled nothing the host knows, so
its kind comes from what it computes: a ``"chunk"`` stops short of the request's known
tokens; otherwise it reaches their end and its sampled token is the request's placeholder.
NOTE 3 (a launch no read-back follows): the first step launched after the engine was idle
(the start, or a failed step that emptied the queue) is read back only with the next call,
whose launch replaces its rows, dispatch and slots in the runner. So the engine tells the
recorder at that launch (``on_launch``), and it gets a snapshot of its own, "step N:
launched": no decisions read back yet, the step in flight, and the runner parts as that
launch left them. A recording that starts while a step is in flight never saw it launched:
its first snapshot's batch shows the net change from the rows the recorder first saw (all
removed, then the rows now added), and says so in its note; that step's dispatch and slots
reach no snapshot.
NOTE 4 (nothing launched since): a step read back with no step after it in flight (the run's
last, or one whose requests all finished in the step before) was already the runner's
newest step at the last snapshot, which showed its batch, dispatch and slots: this one
shows the batch unchanged, no dispatch and no slots, and says so in its note.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tinyvllm.trace.snapshot import BatchState, ScheduledRequest, StepSnapshot

LAUNCHED_NOTE = "launched, nothing read back yet: the step in flight, and the runner's parts as its launch left them"
UNSEEN_LAUNCH_NOTE = "the batch: net change since the last picture (a launch in between reached no picture)"
NO_LAUNCH_NOTE = "no step was launched since the last picture: the runner's batch, dispatch and slots are as it showed"
BatchSince = Callable[[tuple[str, ...], tuple[str, ...]], BatchState]


def in_flight_output(engine: Any) -> Any | None:
    """The ``SchedulerOutput`` of the step launched and not yet read back (NOTE 1); None when
    no step is in flight (always so without async scheduling)."""
    steps = engine.steps_in_flight()
    if not steps:
        return None
    assert len(steps) == 1, f"{len(steps)} steps in flight after a read-back; at most one can be"
    return steps[0]


def step_number(steps: Sequence[StepSnapshot], index: int) -> int:
    """The engine step snapshot ``index`` is of: the step it read back, or for a launch
    snapshot (NOTE 3) the step it launched. Launch snapshots take no number of their own."""
    return sum(1 for s in steps[:index] if not s.launched)


def in_flight_number(steps: Sequence[StepSnapshot], index: int) -> int:
    """The engine step in flight at snapshot ``index``: the one after the step it read back, or
    the step a launch snapshot launched."""
    return step_number(steps, index) + (0 if steps[index].launched else 1)


def in_flight_kind(start: int, num_tokens: int, num_prompt_tokens: int, num_known_tokens: int | None) -> str:
    """NOTE 2: ``"chunk"`` when the step stops before the request's known tokens end (None:
    the request has finished, so it was past its prompt), else decode or prefill."""
    if num_known_tokens is not None and start + num_tokens < num_known_tokens:
        return "chunk"
    return "decode" if num_tokens == 1 and start >= num_prompt_tokens else "prefill"


def in_flight_step(out: Any, requests: Mapping[str, Any], prompt_lens: Mapping[str, int]) -> tuple[ScheduledRequest, ...]:
    """The in-flight step's requests, in scheduling order, as ``ScheduledRequest`` with no
    tokens yet. ``requests``: the scheduler's unfinished ones; ``prompt_lens``: any others."""
    starts = {d.req_id: (d.num_computed_tokens, d.block_ids, "new", len(d.prompt_token_ids)) for d in out.scheduled_new_reqs}
    for d in out.scheduled_cached_reqs:
        starts[d.req_id] = (d.num_computed_tokens, d.new_block_ids, "resumed" if d.resumed_from_preemption else None, None)
    drafts = getattr(out, "scheduled_spec_decode_tokens", {})
    steps = []
    for rid, n in out.num_scheduled_tokens.items():
        start, new_blocks, admitted, num_prompt = starts[rid]
        request = requests.get(rid)
        if num_prompt is None:
            num_prompt = request.num_prompt_tokens if request is not None else prompt_lens.get(rid, 0)
        kind = in_flight_kind(start, n, num_prompt, request.num_tokens if request is not None else None)
        steps.append(ScheduledRequest(
            rid, start, n, len(drafts.get(rid, ())), kind, admitted, start if admitted else 0, tuple(new_blocks), (), None,
        ))  # fmt: skip
    return tuple(steps)


def since_last_snapshot(
    in_flight: Any | None, out: Any | None, saw_in_flight: bool, launched: Any | None = None
) -> tuple[Any | None, BatchSince | None, str]:
    """What the runner launched since the last snapshot: the ``SchedulerOutput`` its parts
    show (None: nothing new, NOTE 4), how to draw the batch when the runner's own
    ``BatchUpdate`` does not say it (None: it does), and the note that says why.
    ``launched``: a launch snapshot's step (NOTE 3), whose update is relative to the last picture."""
    if launched is not None:
        assert in_flight is launched, "a launch snapshot's step must be the one step in flight"
        return launched, None, ""
    if in_flight is None and saw_in_flight:
        return None, unchanged, NO_LAUNCH_NOTE
    if in_flight is not None and not saw_in_flight:
        return in_flight, net_change, UNSEEN_LAUNCH_NOTE
    return (out if in_flight is None else in_flight), None, ""


def unchanged(previous_rows: tuple[str, ...], rows: tuple[str, ...]) -> BatchState:
    """NOTE 4: no launch, no update."""
    assert previous_rows == rows, f"the batch changed from {previous_rows} to {rows} with no step launched"
    return BatchState(previous_rows, rows, (), (), (), changed=False)


def net_change(previous_rows: tuple[str, ...], rows: tuple[str, ...]) -> BatchState:
    """NOTE 3: ``previous_rows`` to ``rows`` as one update: every row removed, the new ones added."""
    removed = tuple(range(len(previous_rows) - 1, -1, -1))
    added = tuple(enumerate(rows))
    return BatchState(previous_rows, rows, removed, added, (), changed=bool(removed or added))
