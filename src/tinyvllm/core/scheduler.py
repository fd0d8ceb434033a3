# --8<-- [start:header]
"""Scheduler: the token budget, chunked prefill, prefix hits at admission, preemption.

Concept: each step, decide how many tokens of which requests to compute. There are no
prefill and decode phases: every request only has ``num_tokens`` and
``num_computed_tokens``, and a step schedules part of the difference for as many
requests as the token budget allows, so one step can mix prompt chunks and decodes.

Follows: seed 002 opening (token_budget from ``--max-num-batched-tokens``; mixed
prefill and decode; R3 prefilled over two steps; the waiting queue holds new and
preempted requests, preempted ones at the front; running requests may still be
prefilling) and §3.1 (prefix hits only when a request leaves the waiting queue;
append-only block tables). Where the seed is silent we follow vLLM V1's scheduler:
``vllm/v1/core/sched/scheduler.py`` (v0.8.x), ``utils.py`` (``check_stop``).

One step (``schedule``):
1. running requests, in order: as many new tokens as they have (capped by
   ``long_prefill_token_threshold`` and the budget); if ``allocate_slots`` fails, preempt
   the *last* running request (NOTE 7) and retry, until it fits or it preempted itself;
2. waiting requests, in arrival order (NOTE 7), only if nothing was preempted in this
   step and fewer than ``max_num_seqs`` run: look up prefix hits, allocate, run them;
3. advance every scheduled request's ``num_computed_tokens`` at once, so the runner and
   ``update_from_output`` see the step's end state.

Invariants (``check_invariants``): every unfinished request is in exactly one of ``waiting`` and
``running``; running requests have status RUNNING; a waiting request holds no blocks and has no
computed tokens; ``len(running) <= max_num_seqs``; the KV cache manager's invariants hold.

NOTE 1 (preemption is recompute): a preempted request frees all its blocks, drops to
``num_computed_tokens = 0`` and goes to the front of the waiting queue. Its block
hashes are kept, so when it is admitted again it usually re-hits its own prefix.
NOTE 2 (no token for a partial prefill): a step that does not reach the end of a request's
tokens produces no token for it; the runner's sample for such a row, if any, is dropped here.
NOTE 3 (a failed step): ``update_from_output`` first commits the step's newly cached
blocks (their KV is now written). If the forward raises instead, ``abort_failed_step``
aborts the step's requests and rolls the prefix cache back, so the engine can serve on
(the offline counterpart of vLLM's engine-dead handling, which stops the engine).

NOTE 4 (speculative decoding): a decoding request may carry drafts (``Request.spec_token_ids``,
proposed after the previous step). They are scheduled with its one real token, count against the
budget (as many as it leaves), and get lookahead slots (``allocate_slots(num_draft_tokens=...)``);
the long-prefill threshold caps the real token plus its drafts, as in vLLM; ``num_computed_tokens``
advances past them like any scheduled token. ``update_from_output`` then takes back the drafts the
target did not keep (the runner returns the kept drafts plus one token, so ``len(drafts) + 1 -
len(sampled)`` were rejected) and caches the blocks the kept ones filled, as today's vLLM does at
the read-back. A preempted request drops its drafts.

NOTE 5 (no token to sample): a request whose parameters leave its row nothing to pick
(``sample/sampler.py`` NOTE 7) is named in ``ModelRunnerOutput.no_token_req_ids``; it ends
with ``FINISHED_ERROR`` (``finish_reason="error"``, vLLM's status of that name) and gets no
token this step, rather than a token it banned.

NOTE 6 (structured outputs): a request whose grammar still compiles (``WAITING_FOR_FSM``) is passed
over and keeps its place; the engine adds the step's bitmask (``structured_output/manager.py``).
NOTE 7 (``policy="priority"``, ``core/request_queue.py``): waiting requests go by (priority, arrival);
the victim is the running request of the largest key: one scheduled earlier in this step gives its
tokens back and the blocks it cached this step leave the prefix cache (no KV); if it is the request
being scheduled, the requests after it, which rank higher, are still scheduled (today's vLLM).
NOTE 8 (pooling, ``request.py``): the step that ends a pooling request's prompt brings its vector
(``pooler_output``), not a token, and it finishes there. Left out: encoder inputs, KV transfer.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.arith import cdiv
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.request_queue import create_request_queue, preemption_victim
from tinyvllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tinyvllm.core.sched_utils import check_stop
from tinyvllm.outputs import EngineCoreOutput, ModelRunnerOutput
from tinyvllm.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler for logging and tutorials."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    spec_acceptance_rate: float = 0.0  # drafts kept / drafts verified (speculative decoding)
    spec_mean_accepted_length: float = 0.0  # tokens a verification step yields per request


# --8<-- [start:spec]
@dataclass
class SpecDecodingStats:
    """Speculative decoding since start, as vLLM's ``SpecDecodingStats`` counts it: steps that
    verified drafts, drafts verified, drafts kept, and drafts kept at each position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.append(0)
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Drafts kept / drafts verified (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields per request on average: kept drafts + 1."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def draft_tokens_to_verify(
    request: Request, num_new: int, token_budget: int, long_prefill_token_threshold: int = 0
) -> tuple[int, ...]:
    """The drafts a running request verifies this step: only when it decodes (one real
    token left to compute), as many as the budget and the long-prefill threshold leave after
    that token: like vLLM, the threshold caps the real token plus its drafts (NOTE 4)."""
    if num_new != 1 or request.num_tokens + request.num_output_placeholders - request.num_computed_tokens != 1:
        return ()  # placeholders: tokens in flight count as known (async_scheduler.py NOTE 6)
    limit = min(token_budget, long_prefill_token_threshold) if long_prefill_token_threshold > 0 else token_budget
    return tuple(request.spec_token_ids[: max(0, limit - num_new)])
# --8<-- [end:spec]


# --8<-- [start:prefill_chunk_size]
def prefill_chunk_size(num_remaining: int, token_budget: int, long_prefill_token_threshold: int) -> int:
    """Tokens to schedule for a request with ``num_remaining`` uncomputed tokens."""
    n = num_remaining
    if 0 < long_prefill_token_threshold < n:
        n = long_prefill_token_threshold
    return min(n, token_budget)
# --8<-- [end:prefill_chunk_size]


class Scheduler:
    """Decides each step's tokens per request; owns the waiting and running queues."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, log_stats: bool = False, *,
                 num_spec_tokens: int = 0) -> None:  # fmt: skip
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks is None: the scheduler needs the pool size")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.log_stats = log_stats
        self.max_model_len = scheduler_config.max_model_len
        self.num_spec_tokens = num_spec_tokens  # the most drafts a request verifies a step (k; 0: none)
        self.kv_cache_manager = KVCacheManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            num_preallocate_tokens=cache_config.num_preallocate_tokens,
            hash_algo=cache_config.hash_algo,
            log_stats=log_stats,
        )
        self.requests: dict[str, Request] = {}
        self.policy = scheduler_config.policy
        self.waiting = create_request_queue(self.policy)  # NOTE 7
        self.running: list[Request] = []
        # Finished since the last step; the next SchedulerOutput tells the runner.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()

    # -- requests in and out ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError, changing nothing, for an id in use or a
        request the pool could never hold; the prompt was checked by the input processor
        (``engine/input_processor.py``) and is only asserted here."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        # The input processor checked the prompt (engine/input_processor.py); assertions only.
        assert request.num_prompt_tokens > 0, f"request {rid!r}: the prompt is empty"
        assert request.num_prompt_tokens <= self.max_model_len, (
            f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens is longer than max_model_len {self.max_model_len}"
        )
        max_tokens = request.sampling_params.max_tokens  # None: up to the context; SamplingParams refuses < 1
        fresh = request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM)
        if not fresh or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {rid!r} is not fresh: {request!r}")
        final_len = min(request.num_prompt_tokens + (max_tokens or self.max_model_len), self.max_model_len)
        blocks_needed = cdiv(final_len, self.cache_config.block_size)
        if blocks_needed > self.kv_cache_manager.num_gpu_blocks:
            raise ValueError(
                f"request {rid!r} may grow to {final_len} tokens = {blocks_needed} blocks, but the pool "
                f"has only {self.kv_cache_manager.num_gpu_blocks} blocks"
            )
        self.requests[rid] = request
        self.waiting.add_request(request)

    # --8<-- [start:finish_requests]
    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, or a stop string found by the engine).
        Their blocks are freed at once; unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._free_request(request)
    # --8<-- [end:finish_requests]

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.free_block_hashes(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # --8<-- [start:preempt]
    def _preempt(self, index: int, scheduled_this_step: bool = False) -> Request:
        """Preempt by recompute (NOTE 1) the running request at ``index``, the policy's victim."""
        victim = self.running.pop(index)
        if scheduled_this_step:  # NOTE 7: the blocks it cached this step will hold no KV
            self.kv_cache_manager.uncache_unscheduled(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []  # drafts belong to the next decode step; it will prefill again
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(victim)
        return victim
    # --8<-- [end:preempt]

    # -- one step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens per request within the token budget."""
        config = self.scheduler_config
        kv = self.kv_cache_manager
        token_budget = config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, tuple[int, ...]] = {}
        start_tokens: dict[str, int] = {}
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        running_reqs: list[Request] = []
        preempted: list[Request] = []
        spec_tokens: dict[str, tuple[int, ...]] = {}

        # --8<-- [start:running_loop]
        # 1. Running requests first, in order.
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            if self._pending_tokens_end(request):  # async scheduling: its last step is on the device
                index += 1
                continue
            num_new = prefill_chunk_size(  # placeholders: tokens still on the device (async_scheduler.py)
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                token_budget, config.long_prefill_token_threshold,
            )  # fmt: skip
            assert num_new > 0, f"running request {request.request_id!r} has nothing to compute"
            drafts = draft_tokens_to_verify(request, num_new, token_budget, config.long_prefill_token_threshold)  # NOTE 4
            while (new_blocks := kv.allocate_slots(request, num_new, num_draft_tokens=len(drafts))) is None:
                at = preemption_victim(self.running, self.policy)  # the last one under FCFS
                scheduled = self.running[at].request_id in num_scheduled  # earlier this step (NOTE 7)
                index -= at < index  # the cursor stays on `request`
                preempted.append(victim := self._preempt(at, scheduled))
                if victim is request:
                    break
                if scheduled:  # NOTE 7: its tokens go back to the budget
                    running_reqs.remove(victim)
                    token_budget += num_scheduled.pop(victim.request_id)
                    for book in (new_block_ids, start_tokens, spec_tokens):
                        book.pop(victim.request_id, None)
            if new_blocks is None:  # NOTE 7: it preempted itself; the cursor is on the next one
                continue
            running_reqs.append(request)
            new_block_ids[request.request_id] = tuple(b.block_id for b in new_blocks) if new_blocks else ()
            num_scheduled[request.request_id] = num_new + len(drafts)
            if drafts:
                spec_tokens[request.request_id] = drafts
            start_tokens[request.request_id] = request.num_computed_tokens
            token_budget -= num_new + len(drafts)
            index += 1
        # --8<-- [end:running_loop]

        # --8<-- [start:waiting_loop]
        # 2. Waiting requests, in the queue's order (NOTE 7), unless this step had to preempt.
        skipped: list[Request] = []  # NOTE 6: grammars still compiling; they keep their place
        while not preempted and self.waiting and token_budget > 0 and len(self.running) < config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output_request.is_grammar_ready():
                    skipped.append(self.waiting.pop_request())
                    continue
                request.status = RequestStatus.WAITING
            if request.num_output_placeholders:
                break  # preempted with a token still on the device: it waits for it (async scheduling)
            hits, num_hit_tokens = kv.get_computed_blocks(request)
            num_remaining = request.num_tokens - num_hit_tokens
            if not config.enable_chunked_prefill and num_remaining > token_budget:
                break  # the prompt is scheduled whole or not at all
            num_new = prefill_chunk_size(num_remaining, token_budget, config.long_prefill_token_threshold)
            new_blocks = kv.allocate_slots(request, num_new, hits)
            if new_blocks is None:
                break
            self.waiting.pop_request()
            (resumed_reqs if request.status == RequestStatus.PREEMPTED else new_reqs).append(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            new_block_ids[request.request_id] = tuple(kv.get_block_ids(request.request_id))
            num_scheduled[request.request_id] = num_new
            start_tokens[request.request_id] = num_hit_tokens
            token_budget -= num_new
        self.waiting.prepend_requests(skipped)
        # --8<-- [end:waiting_loop]

        output = SchedulerOutput(
            scheduled_new_reqs=tuple(
                NewRequestData(
                    req_id=r.request_id,
                    prompt_token_ids=tuple(r.prompt_token_ids),
                    sampling_params=r.sampling_params,
                    block_ids=new_block_ids[r.request_id],
                    num_computed_tokens=start_tokens[r.request_id],
                    bad_words_token_ids=r.bad_words_token_ids, pooling_params=r.pooling_params,
                )
                for r in new_reqs
            ),
            scheduled_cached_reqs=tuple(
                CachedRequestData(
                    req_id=r.request_id,
                    resumed_from_preemption=resumed,
                    new_block_ids=new_block_ids[r.request_id],
                    num_computed_tokens=start_tokens[r.request_id],
                    resumed_token_ids=tuple(r.all_token_ids) if resumed else None,
                )
                for r, resumed in [(r, False) for r in running_reqs] + [(r, True) for r in resumed_reqs]
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(r.request_id for r in preempted),
            scheduled_spec_decode_tokens=spec_tokens,
        )
        # --8<-- [start:advance]
        # 3. Advance at once: the runner and update_from_output see the step's end state.
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        self.finished_req_ids = set()
        self.kv_cache_manager.seal_step()  # this step's cached blocks commit when it returns
        self._update_after_schedule(output)
        return output
        # --8<-- [end:advance]

    # --8<-- [start:update_from_output]
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append each request's sampled tokens, apply stop checks, free the finished.
        Returns one ``EngineCoreOutput`` per scheduled request that got tokens or finished."""
        self.kv_cache_manager.commit_step()  # the forward finished: this step's blocks are written
        outputs: list[EngineCoreOutput] = []
        scheduled = self._requests_of_step(scheduler_output)
        for rid in scheduler_output.num_scheduled_tokens:
            request = scheduled(rid)
            if request is None:
                continue  # finished from outside after this step was scheduled
            pooled = model_runner_output.pooler_output.get(rid)  # NOTE 8: a pooling request's vector
            if pooled is not None or rid in model_runner_output.no_token_req_ids:  # NOTE 5: nothing to sample
                self._finish_without_token(request, outputs, pooled)
                continue
            index = model_runner_output.req_id_to_index.get(rid)
            sampled = model_runner_output.sampled_token_ids[index] if index is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts is not None and sampled:  # NOTE 4: the drafts the target did not keep are undone
                self._take_back_rejected(request, len(drafts) + 1 - len(sampled))
                verified = model_runner_output.draft_token_ids.get(rid, drafts)  # the runner's own (async)
                if verified:  # a step whose placeholders got no drafts verified none
                    self.spec_stats.record(len(verified), len(sampled) - 1)
            if self._is_partial_prefill(request):
                sampled = []  # a partial prefill produces no token (NOTE 2)
            new_token_ids: list[int] = []
            logprobs = model_runner_output.logprobs.get(rid)  # one entry per sampled token, if asked
            finished = False  # a request still in self.requests has not finished yet
            status_before = request.status
            for token in sampled:
                request.append_output_token_ids(token)
                new_token_ids.append(token)
                finished = check_stop(request, self.max_model_len)
                if finished:
                    break
            self._after_tokens_arrived(request, 1 + len(drafts or ()) if sampled else 0, status_before)
            if finished:  # preempted while its token was on the device, it waits (async scheduling)
                if status_before == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove_request(request)
                self._free_request(request)
            if new_token_ids or finished:
                outputs.append(EngineCoreOutput(
                    request_id=rid, new_token_ids=new_token_ids,
                    finish_reason=RequestStatus.get_finished_reason(request.status) if finished else None,
                    stop_reason=request.stop_reason, num_cached_tokens=max(request.num_cached_tokens, 0),
                    new_logprobs=logprobs[: len(new_token_ids)] if logprobs is not None else None,
                    prompt_logprobs=model_runner_output.prompt_logprobs.get(rid),
                ))  # fmt: skip
        return outputs
    # --8<-- [end:update_from_output]

    # -- hooks: async scheduling overrides them (core/async_scheduler.py) -------------------

    def _pending_tokens_end(self, request: Request) -> bool:
        """Whether the tokens still on the device end ``request`` (never: none are here)."""
        return False

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """After a step is scheduled and its requests advanced (nothing to do here)."""

    def _requests_of_step(self, scheduler_output: SchedulerOutput):
        """Request id -> the unfinished request the step scheduled under it, or None."""
        return self.requests.get

    def _is_partial_prefill(self, request: Request) -> bool:
        """The step did not reach the end of the request's tokens (NOTE 2)."""
        return request.num_computed_tokens < request.num_tokens

    def _take_back_rejected(self, request: Request, num_rejected: int) -> None:  # NOTE 4
        request.num_computed_tokens -= num_rejected  # counted computed when scheduled; they are not

    def _after_tokens_arrived(self, request: Request, num_scheduled_to_sample: int, status_before: RequestStatus) -> None:
        """After ``update_from_output`` appended a request's sampled tokens; the step had scheduled
        ``num_scheduled_to_sample`` positions that sample (its drafts and its one token; 0 if none).
        The blocks its kept drafts filled are cached now: the finished step wrote their KV (NOTE 4)."""
        if num_scheduled_to_sample > 1 and status_before == RequestStatus.RUNNING:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)

    def _finish_without_token(self, request: Request, outputs: list[EngineCoreOutput], pooled=None) -> None:
        """NOTE 5: the request's row had no token to sample: it ends with an error, and no token.
        NOTE 8: a pooling request ends with its vector, "stop". Preempted while its step was in
        flight (async scheduling), it waits, holding no blocks: it leaves the waiting queue."""
        (self.running.remove if request.status == RequestStatus.RUNNING else self.waiting.remove_request)(request)
        request.status = RequestStatus.FINISHED_ERROR if pooled is None else RequestStatus.FINISHED_STOPPED
        self._free_request(request)
        outputs.append(
            EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], num_cached_tokens=max(request.num_cached_tokens, 0),
                finish_reason=RequestStatus.get_finished_reason(request.status), pooling_output=pooled,
            )
        )  # fmt: skip

    # --8<-- [start:abort_failed_step]
    def abort_failed_step(self, *scheduler_outputs: SchedulerOutput) -> list[str]:
        """Undo a step whose forward (or sampling) raised: abort its requests, freeing their
        blocks, and drop the blocks it cached from the prefix cache, since their KV was never
        written (NOTE 3). Async scheduling passes every step in flight: they fail together.
        Requests no such step scheduled are untouched, even under an id one had. Returns the ids."""
        failed: dict[str, None] = {}
        for out in scheduler_outputs:
            request_of = self._requests_of_step(out)
            failed |= dict.fromkeys(rid for rid in out.num_scheduled_tokens if request_of(rid) is not None)
        self.finish_requests(list(failed), RequestStatus.FINISHED_ABORTED)
        self.kv_cache_manager.rollback_step()
        return list(failed)
    # --8<-- [end:abort_failed_step]

    # -- views -----------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def get_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_hit_rate=stats.hit_rate if stats is not None else 0.0,
            num_preemptions=self.num_preemptions,
            spec_acceptance_rate=self.spec_stats.acceptance_rate,
            spec_mean_accepted_length=self.spec_stats.mean_accepted_length,
        )

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants()
        self.waiting.check_invariants()
        queued = [r.request_id for r in self.waiting] + [r.request_id for r in self.running]
        assert len(queued) == len(set(queued)), f"a request is queued twice: {queued}"
        assert set(queued) == set(self.requests), (
            f"queued {sorted(queued)} != known unfinished requests {sorted(self.requests)}"
        )
        assert len(self.running) <= self.scheduler_config.max_num_seqs, (
            f"{len(self.running)} running > max_num_seqs {self.scheduler_config.max_num_seqs}"
        )
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, f"{r!r} is in running"
            assert 0 < r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders, f"{r!r} has bad num_computed_tokens"
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM, RequestStatus.PREEMPTED), f"{r!r} is in waiting"
            assert r.num_computed_tokens == 0, f"waiting {r!r} has computed tokens"
            assert not self.kv_cache_manager.req_to_blocks.get(r.request_id), f"waiting {r!r} holds blocks"
