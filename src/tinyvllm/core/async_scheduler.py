"""AsyncScheduler: schedule step N+1 while step N still runs on the device.

Concept: with ``async_scheduling=True`` the engine schedules the next step before the last
one's sampled tokens are back (``engine/llm_engine.py`` NOTE 10), so the host's scheduling
and input preparation overlap the device's forward. A request that samples in a step gets a
*placeholder* (``Request.num_output_placeholders``): a token whose position the next step
may already compute, although its value is known only on the device (the runner feeds it to
the next forward from there: ``worker/async_output.py``). When the step's output arrives,
``update_from_output`` appends the real token and takes the placeholder back.

Mirrors: ``vllm/v1/core/sched/async_scheduler.py`` (``AsyncScheduler``,
``_update_after_schedule``, ``_update_request_with_output``) and the placeholder arithmetic
of ``vllm/v1/core/sched/scheduler.py``.

Invariants (on top of ``Scheduler``'s): ``0 <= num_output_placeholders <= 2 (1 + k)`` (at
most two steps are in flight, each samples at most ``1 + k`` tokens per request, k drafts
and one of the target's); a request's placeholders count the positions that sample in its
steps in flight; the KV cache caches a block only when its tokens are known and a finished
step wrote their KV (``kv_cache_manager.py`` NOTE 6).

NOTE 1 (one step late): stop checks, detokenization and stop strings see a step's tokens
when its output arrives, after the next step was scheduled. A request that stopped in step N
was already scheduled in N+1: that extra token is computed and thrown away (the request has
left ``requests`` when N+1's output arrives), as in vLLM.
NOTE 2 (no step that cannot count): a request whose tokens in flight surely end it
(``max_tokens`` reached even if every draft in flight is rejected, as vLLM's check) is not
scheduled again; nor one they may bring to ``max_model_len`` (as if every draft were kept), so
no position past it is ever allocated. A pooling request (``max_tokens`` 1) ends with its prompt.
NOTE 3 (preempted with a token in flight): a request preempted while its last step runs keeps
that step's token (sampled from KV its blocks held when the step was queued); it recomputes
from the start with it, as if the step had returned before the preemption, as in sync mode.
NOTE 4 (grammars): a constrained request's mask needs the tokens in flight and, with drafts,
the runner's drafts: the engine launches its step's forward, reads the step before back and
takes the drafts (NOTE 7), then makes the mask (``engine/llm_engine.py`` NOTE 10).
NOTE 5 (an id reused while its step is in flight): a client may abort a request and add a
new one under the same id before the aborted request's step is read back; that step's
token belongs to the old request. So the scheduler remembers each step's request objects
and gives a step's tokens only to the very requests it scheduled.
NOTE 6 (speculative decoding, vLLM's placeholder drafts): a request's drafts for step N+1
depend on the tokens step N samples, unknown when N+1 is scheduled. So a request that
samples in step N gets ``k`` placeholder drafts (``DRAFT_PLACEHOLDER``, fewer near
``max_model_len``), scheduled in N+1 like real ones; the runner reads step N back, proposes
the real drafts (at most as many; ``worker/model_runner.py`` NOTE 14) and verifies them. The
scheduler counts as if every draft in flight were kept (``num_computed_tokens`` and the
placeholders both grow by ``1 + k`` a step), so it may allocate a few slots too many, never
too few; when the output says how many were kept, the rest are taken back from both. A
request preempted with drafts in flight recomputes from 0: nothing of it is taken back.
NOTE 7 (the drafts written in, vLLM's ``update_draft_token_ids_in_output``): the engine's copy
of a step gets the drafts the runner proposed, so the grammar mask has a row per draft; a
draft the grammar refuses is not cut (it already ran) but rejected (``sched_output.py`` NOTE 5).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from tinyvllm.core.sched_output import DRAFT_PLACEHOLDER, SchedulerOutput
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.outputs import DraftTokenIds
from tinyvllm.request import Request, RequestStatus

MAX_STEPS_IN_FLIGHT = 2  # the engine's batch queue: the step on the device and the one being prepared


class AsyncScheduler(Scheduler):
    """``Scheduler`` with placeholders for the tokens of steps still on the device."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # NOTE 5: each step scheduled and not yet updated, with the requests it scheduled;
        # bounded, so steps a caller never updates are forgotten
        self._in_flight: deque[tuple[SchedulerOutput, dict[str, Request]]] = deque(maxlen=2 * MAX_STEPS_IN_FLIGHT)

    # --8<-- [start:placeholders]
    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Each request this step brings to the end of its tokens (placeholders included)
        will sample one token, and one per draft it verifies: count them as placeholders until
        their values arrive; with speculative decoding, its next step verifies placeholder
        drafts (NOTE 6). The step's requests are remembered until its output arrives (NOTE 5)."""
        self._in_flight.append((scheduler_output, {rid: self.requests[rid] for rid in scheduler_output.num_scheduled_tokens}))
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            num_drafts = len(spec.get(req_id, ()))
            if request.num_computed_tokens - num_drafts == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1 + num_drafts
                if self.num_spec_tokens:  # as if every draft in flight were kept: never past max_model_len
                    room = self.max_model_len - request.num_tokens - request.num_output_placeholders
                    request.spec_token_ids = [DRAFT_PLACEHOLDER] * max(0, min(self.num_spec_tokens, room))

    def _take_back_rejected(self, request: Request, num_rejected: int) -> None:
        """NOTE 6: a preempted request recomputes from 0; a running one gives back the drafts
        the target did not keep (its placeholders for them go in ``_after_tokens_arrived``)."""
        if request.status == RequestStatus.RUNNING:
            super()._take_back_rejected(request, num_rejected)

    def _after_tokens_arrived(self, request: Request, num_scheduled_to_sample: int, status_before: RequestStatus) -> None:
        """The step's tokens replace its placeholders (its drafts' too: those not kept were
        taken back); the blocks their arrival fills are cached now (their KV was written by
        finished steps: ``kv_cache_manager.py`` NOTE 6)."""
        if num_scheduled_to_sample == 0:
            return  # a partial prefill's row: it had no placeholder
        request.num_output_placeholders -= num_scheduled_to_sample
        assert request.num_output_placeholders >= 0, f"{request!r}: more tokens arrived than were scheduled"
        if status_before == RequestStatus.RUNNING:  # a preempted request holds no blocks (NOTE 3)
            computed = request.num_computed_tokens - request.num_output_placeholders
            self.kv_cache_manager.cache_blocks(request, computed)
    # --8<-- [end:placeholders]

    # --8<-- [start:update_drafts]
    def update_draft_token_ids_in_output(self, draft_token_ids: DraftTokenIds, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        """NOTE 7: a copy of the step with the runner's drafts in place of its placeholders,
        at most as many as were scheduled, the rest left placeholders. The step is untouched."""
        ids, lists = draft_token_ids.req_ids, draft_token_ids.draft_token_ids
        if len(ids) != len(lists):
            raise ValueError(f"{len(ids)} request ids and {len(lists)} draft lists")
        spec = dict(scheduler_output.scheduled_spec_decode_tokens)
        for rid, drafts in zip(ids, lists):
            scheduled = spec.get(rid)
            if scheduled is None or any(t != DRAFT_PLACEHOLDER for t in scheduled):
                raise ValueError(f"request {rid!r}: no placeholder drafts in this step for its drafts {drafts}")
            if any(not isinstance(t, int) or t < 0 for t in drafts):
                raise ValueError(f"request {rid!r}: drafts {drafts} are not token ids")
            kept = tuple(drafts[: len(scheduled)])
            spec[rid] = kept + (DRAFT_PLACEHOLDER,) * (len(scheduled) - len(kept))
        return dataclasses.replace(scheduler_output, scheduled_spec_decode_tokens=spec)
    # --8<-- [end:update_drafts]

    # --8<-- [start:pending_end]
    def _pending_tokens_end(self, request: Request) -> bool:
        """NOTE 2: the tokens in flight surely reach ``max_tokens``, or may reach ``max_model_len``."""
        pending = request.num_output_placeholders
        if pending == 0:
            return False
        if request.num_tokens + pending >= self.max_model_len:  # as if every draft in flight were kept
            return True
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None or request.num_output_tokens + pending < max_tokens:  # not even if all kept
            return False
        rid = request.request_id
        drafts = sum(len(step.scheduled_spec_decode_tokens.get(rid, ())) for step, scheduled in self._in_flight
                     if scheduled.get(rid) is request)  # fmt: skip
        return request.num_output_tokens + pending - drafts >= max_tokens  # as if every draft were rejected
    # --8<-- [end:pending_end]

    # --8<-- [start:requests_of_step]
    def _requests_of_step(self, scheduler_output: SchedulerOutput):
        """NOTE 5: the request the step scheduled under an id, if it is still that id's
        unfinished request (not one added under the id after an abort)."""
        for index, (step, scheduled) in enumerate(self._in_flight):
            if step.same_step(scheduler_output):  # the engine may send a copy (sched_output.py NOTE 4)
                del self._in_flight[index]
                return lambda rid: request if (request := self.requests.get(rid)) is scheduled.get(rid) else None
        return self.requests.get  # a step scheduled longer ago than the queue remembers
    # --8<-- [end:requests_of_step]

    def abort_failed_step(self, *scheduler_outputs: SchedulerOutput) -> list[str]:
        """Only the requests the failed steps scheduled (NOTE 5); then every step in flight is
        forgotten: they failed together (``llm_engine.py`` NOTE 10)."""
        failed = super().abort_failed_step(*scheduler_outputs)
        self._in_flight.clear()
        return failed

    def _is_partial_prefill(self, request: Request) -> bool:
        """The runner sends no token for a partial prefill's row; a preempted request's token
        was sampled before it was preempted, and counts (NOTE 3)."""
        return request.status == RequestStatus.RUNNING and request.num_computed_tokens < request.num_tokens

    def check_invariants(self) -> None:
        super().check_invariants()
        most = MAX_STEPS_IN_FLIGHT * (1 + self.num_spec_tokens)
        for request in self.requests.values():
            pending = request.num_output_placeholders
            assert 0 <= pending <= most, f"{request!r} has {pending} placeholders"
            assert all(t == DRAFT_PLACEHOLDER for t in request.spec_token_ids), f"{request!r}: real drafts here (NOTE 6)"
