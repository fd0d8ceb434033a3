"""ModelRunner: turns one ``SchedulerOutput`` into sampled tokens.

Concept: the runner orchestrates one forward and owns nothing that has its own module. Each
step: (a) update its copy of every request, the persistent batch and its block table
(removals, additions, condense; after the forward, refresh: one ``BatchUpdate`` reaches the
logits processors and the thinking budget); (b) ask the CUDA-graph dispatcher for the
runtime mode and padded ``BatchDescriptor``; (c) write the padded inputs and attention metadata into the persistent
buffers; (d) run the model over the paged KV cache under ``set_forward_context``, so graph
wrappers capture, replay or pass through; (e) sample from each request's last scheduled
token and report one token per request whose step reached the end of its tokens.

Follows: the docs page "The model runner" (parts (a)-(e)); seed 003 "KV cache物理内存分配"
(the runner owns the KV tensors); seed 001 appendix U2 (the batch is updated, condensed and
refreshed once per step); seed 000 "CUDA Graphs" (dispatch, then the forward under a forward
context). The worker builds it and captures its graphs (``worker.py``, ``cudagraph_capture.py``).
Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``_update_states``, ``_prepare_inputs``,
``execute_model``), ``gpu_input_batch.CachedRequestState``.

Invariants: after ``_update_states`` the batch holds exactly this step's scheduled requests,
rows ``0 .. R-1``, block-table row r holding row r's block ids; each ``RunnerRequestState``
has the prompt, the outputs so far and the scheduler's block ids; ``cudagraph_stats`` counts
every executed step once, by mode. ``check_invariants()`` checks them between steps.

NOTE 1 (a request not scheduled this step leaves the batch): skipped or preempted, it leaves
(its state stays) and returns when scheduled, a preempted one with its block table replaced.
NOTE 2 (partial prefills get no token): a row whose step ends inside its prompt gets none; its
draw is thrown away, and as a seeded draw is keyed by position (``sample/draw_keys.py``), a
seeded request's tokens do not depend on how its prompt was chunked.
NOTE 3 (the mode): the runner runs under the ``CUDAGraphSetup`` the worker hands it (the mode
after the backend's downgrade, the dispatcher, the FULL wrapper; ``cudagraph_capture.py``
NOTE 1); it never writes the model's ``pieces``, which the worker wraps.
NOTE 4 (padding): FULL pads tokens to ``desc.num_tokens`` and requests to ``desc.num_reqs``;
PIECEWISE pads only tokens (attention runs eagerly on the real requests); NONE pads nothing.
Padding writes no KV and its outputs are never read.
NOTE 5 (dummy batches): warm-up and capture run ``desc.num_reqs`` (or ``min(N,
max_num_seqs)``) empty requests, KV writes to ``PAD_SLOT_ID``, block rows ``PAD_BLOCK_ID``.
NOTE 6 (a seeded request's stream): no random state here: each draw is keyed by seed and
position, so preemption, skipped steps, chunking and drafts change nothing.
NOTE 7 (a finished id leaves the batch before the step's new requests arrive): a client may
reuse an id once its request finished, in the very step that reports it finished; left in
the batch, the old row (sampling parameters, block table) would serve the new request. So
a finished id leaves ``self.requests`` and the batch first, as in vLLM's ``_update_states``.
NOTE 8 (prompt logprobs): each prompt token after the first gets its logprob from the logits
of the position before it, computed in pieces by a chunked prefill; the state collects them
by position and the step that finishes the prompt sends the list once (a later preemption
sends nothing again). It takes no prefix-cache hit (vLLM's rule): a hit's positions go uncomputed.
NOTE 9 (speculative decoding): a request with drafts computes its last real token and k
drafts at once; the k + 1 logits rows take the sampler's plain steps, and the rejection
sampler decides at read-back (``worker/draft_verification.py``); the rejected are taken back.
NOTE 10 (logprobs with drafts): kept token ``i`` has verified row ``i``'s raw logprobs (vLLM's PR #26060).
NOTE 11 (everything queued before the one wait): a step waits once, reading the sampled ids
(``tinyvllm/device_syncs.py``); the prompt logprobs are queued before it, read after it.
NOTE 12 (``worker/async_output.py``): ``execute_model_async`` launches a step, read back when asked or by
the next launch (``defer_sampling``: its forward only; ``sample_tokens`` samples it, vLLM's split).
NOTE 13 (pooling, ``worker/pooler.py``): a pooling engine samples nothing; the pooler folds each row's chunk in.
NOTE 14 (async scheduling, ``core/async_scheduler.py`` NOTE 6): drafts come as placeholders; the
step before is read back, then ``proposer`` proposes at most as many per row (the row runs only
those; ``take_draft_token_ids`` hands them to a grammar mask), counted as scheduled: the
rejected, the unproposed and those a grammar refused (``sched_output.py`` NOTE 5) alike.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID
from tinyvllm.attention.metadata import AttentionMetadata
from tinyvllm.arith import cdiv, spec_row_starts
from tinyvllm.core.sched_output import GrammarOutput, SchedulerOutput
from tinyvllm.outputs import DraftTokenIds, LogprobEntry, ModelRunnerOutput
from tinyvllm.sample import logprobs as logprob_ops
from tinyvllm.sample.sampler import Sampler
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.structured_output.bitmask import apply_grammar_bitmask
from tinyvllm.worker.async_output import (
    AsyncModelRunnerOutput,
    ForwardInFlight,
    HostIds,
    PlaceholderFeed,
    StepInFlight,
    logprobs_to_host_early,
    placeholder_feed,
)
from tinyvllm.worker.attention_metadata import build_step_inputs
from tinyvllm.worker.cuda_graph import CUDAGraphWrapper, set_forward_context
from tinyvllm.worker.cudagraph_capture import CUDAGraphSetup
from tinyvllm.worker.cudagraph_dispatcher import BatchDescriptor, CUDAGraphMode, common_query_len
from tinyvllm.worker.draft_verification import finish_verification, launch_verification
from tinyvllm.worker.input_batch import InputBatch, RunnerRequestState
from tinyvllm.worker.input_buffers import InputBuffers
from tinyvllm.worker.pooler import Pooler
from tinyvllm.worker.prompt_logprobs import collect_prompt_logprobs, queue_prompt_logprobs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDispatch:
    """How the last step ran: its real size, the runtime mode and the padded key."""

    num_tokens: int
    num_reqs: int
    uniform_decode: bool
    runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor

    @property
    def num_padding_tokens(self) -> int:
        return self.batch_descriptor.num_tokens - self.num_tokens


class ModelRunner:
    """Runs the model for one scheduler step and samples (see the module header)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        input_batch: InputBatch,
        device: torch.device,
        eos_token_id: int | None = None,
        *,
        max_num_batched_tokens: int,
        max_model_len: int,
        cudagraphs: CUDAGraphSetup,
        num_speculative_tokens: int = 0,
        pooler: Pooler | None = None,
        proposer: NgramProposer | None = None,
    ) -> None:
        if input_batch.block_table is None:
            raise ValueError("the runner's InputBatch needs a block table: pass max_num_blocks_per_req")
        self.model = model
        self.kv_caches = kv_caches  # L x [2, B, S, Hkv, D]
        self.block_size = block_size
        self.input_batch = input_batch
        self.device = torch.device(device)
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.sampler = Sampler()
        self.pooler = pooler  # NOTE 13: None for a generating engine
        self.proposer = proposer  # NOTE 14: drafts proposed here (async scheduling); else None
        self.requests: dict[str, RunnerRequestState] = {}
        self.buffers = InputBuffers(
            max_num_batched_tokens, input_batch.max_num_reqs, input_batch.block_table.max_num_blocks_per_req, self.device
        )
        self.cudagraph_stats: Counter[CUDAGraphMode] = Counter()
        self.last_dispatch: StepDispatch | None = None
        # NOTE 9: with speculative decoding every step samples through the rejection
        # sampler, and a uniform decode batch has 1 + k tokens per request (or 1, a step
        # without drafts: cudagraph_dispatcher.py NOTE 4).
        self.speculative = num_speculative_tokens > 0
        self.uniform_decode_query_len = 1 + num_speculative_tokens
        # NOTE 3: the worker's graph set-up (cudagraph_capture.py); the model's pieces are its to wrap
        self.cudagraph_mode = cudagraphs.mode
        self.dispatcher = cudagraphs.dispatcher
        self.emulate_cudagraphs = cudagraphs.emulate
        self.full_graph = cudagraphs.full_graph
        self._in_flight: StepInFlight | None = None  # the last step launched (NOTE 12)
        self._deferred: ForwardInFlight | None = None  # a forward launched, its sampling to come (NOTE 12)

    # -- (a) states and the persistent batch ---------------------------------------------

    # --8<-- [start:update_states]
    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        table = batch.block_table
        for req_id in out.finished_req_ids:  # NOTE 7: forget a finished id everywhere, first
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in list(batch.req_id_to_index):  # removals first (NOTE 1)
            if req_id not in out.num_scheduled_tokens:
                batch.remove_request(req_id)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
                bad_words_token_ids=new.bad_words_token_ids,
                prompt_logprobs=(
                    [None] * (len(new.prompt_token_ids) - 1) if new.sampling_params.prompt_logprobs is not None else None
                ),
                pooling_params=new.pooling_params,
            )
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            row = batch.req_id_to_index.get(cached.req_id)  # None: it (re-)enters the batch below
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
                if row is not None:
                    table.add_row(row, state.block_ids)
            elif cached.new_block_ids:  # most decode steps bring none
                state.block_ids.extend(cached.new_block_ids)
                if row is not None:
                    table.append_row(row, cached.new_block_ids)  # incremental, never rebuilt
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id in out.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                state = self.requests[req_id]
                batch.add_request(
                    req_id, state.sampling_params, state.prompt_token_ids, state.output_token_ids,
                    self.eos_token_id, block_ids=state.block_ids,
                    bad_words_token_ids=state.bad_words_token_ids,
                )  # fmt: skip
        batch.condense()  # the processors hear of the step in ``_launch_forward``, after NOTE 12's read-back
    # --8<-- [end:update_states]

    # -- (b)-(d) dispatch, inputs, forward -----------------------------------------------

    # --8<-- [start:forward]
    def _forward(
        self,
        token_ids: list[int],
        num_computed: list[int],
        num_scheduled: list[int],
        block_ids: list[list[int]],
        dispatch: tuple[CUDAGraphMode, BatchDescriptor] | None = None,
        dummy: bool = False,
        feed: tuple[PlaceholderFeed, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """One forward over the persistent buffers: hidden states [N_pad, hidden], the metadata,
        and the logits [R_pad, V] when the forward computes them (``cudagraph_capture.py`` NOTE 4)."""
        num_tokens, num_reqs = sum(num_scheduled), len(num_scheduled)
        # a decode step is uniform at 1 + k (every request verifies k drafts) or at 1 (no drafts
        # this step): each length has its own FULL keys (cudagraph_dispatcher.py NOTE 4)
        query_len = common_query_len(num_scheduled, (1, self.uniform_decode_query_len))
        uniform = query_len is not None
        if dispatch is None:
            dispatch = self.dispatcher.dispatch(num_tokens, uniform_decode=uniform, uniform_query_len=query_len)
        mode, desc = dispatch
        num_padded_reqs = desc.num_reqs if mode == CUDAGraphMode.FULL else num_reqs  # NOTE 4
        step = build_step_inputs(
            num_computed, num_scheduled, block_ids, self.block_size,
            num_padded_tokens=desc.num_tokens, num_padded_reqs=num_padded_reqs,
        )  # fmt: skip
        if dummy:  # NOTE 5: nothing reaches the KV cache
            step = dataclasses.replace(step, slot_mapping=[PAD_SLOT_ID] * desc.num_tokens)
        max_query_len, max_seq_len = step.max_query_len, step.max_seq_len
        if mode == CUDAGraphMode.FULL:  # frozen into the graph: the descriptor's bounds
            max_query_len = desc.uniform_query_len if desc.uniform else desc.num_tokens
            max_seq_len = self.max_model_len
        fed = feed[0] if feed is not None else PlaceholderFeed((), ())
        input_ids, metadata, (fed_positions, fed_rows) = self.buffers.fill(
            token_ids, step, self.input_batch.block_table.rows_for_step(num_padded_reqs), self.block_size,
            max_query_len=max_query_len, max_seq_len=max_seq_len, fed_positions=fed.positions, fed_rows=fed.prev_rows,
        )  # fmt: skip
        if feed is not None:  # NOTE 12: tokens the host does not know yet, from the last step's ids [R_prev]
            input_ids.index_copy_(0, fed_positions, feed[1][fed_rows])
        run = self.full_graph if self.full_graph is not None else self.model
        with set_forward_context(mode, desc):
            out = run(input_ids, metadata.positions, self.kv_caches, metadata)  # hidden, or (hidden, logits)
        if not dummy:
            self.cudagraph_stats[mode] += 1
            self.last_dispatch = StepDispatch(num_tokens, num_reqs, uniform, mode, desc)
        hidden, logits = out if isinstance(out, tuple) else (out, None)  # [N_pad, hidden], [R_pad, V]
        return hidden, metadata, logits
    # --8<-- [end:forward]

    # --8<-- [start:recover]
    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        """After a step raised: forget the failed requests and empty the persistent batch,
        whatever state the step left it in. Requests the step did not schedule keep their
        state here and re-enter the batch when next scheduled (NOTE 1). On CUDA it first
        waits for the device: the next step rewrites the pinned input buffers, whose copies
        the failed step may have left in flight (``input_buffers`` NOTE 2)."""
        for req_id in failed_req_ids:
            self.requests.pop(req_id, None)
        self._in_flight = self._deferred = None  # never read or sampled: the steps in flight failed together
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.input_batch.reset()
    # --8<-- [end:recover]

    # -- between steps -----------------------------------------------------------------

    # --8<-- [start:check_invariants]
    def check_invariants(self) -> None:
        """The persistent batch against the request states (module header), then the batch,
        the dispatcher and every graph wrapper check themselves. Call it between steps."""
        batch = self.input_batch
        batch.check_invariants()
        assert self._deferred is None, "a step's forward was launched and never sampled (NOTE 12)"
        for row, req_id in enumerate(batch.req_ids):
            if req_id is None:
                continue
            state = self.requests.get(req_id)
            assert state is not None, f"row {row} holds request {req_id!r}, which has no state in the runner"
            assert batch.output_token_ids[row] is state.output_token_ids, (
                f"row {row}: request {req_id!r} does not read its state's live output list"
            )
            table_row = batch.block_table.row(row)
            assert table_row == state.block_ids, (
                f"row {row}: request {req_id!r}'s block table row {table_row} != its block ids {state.block_ids}"
            )
            assert cdiv(state.num_computed_tokens, self.block_size) <= len(state.block_ids), (
                f"request {req_id!r}: {state.num_computed_tokens} computed tokens in {len(state.block_ids)} blocks"
            )
        self.dispatcher.check_invariants()
        wrappers = [self.full_graph, *self.model.pieces]
        for wrapper in wrappers:
            if isinstance(wrapper, CUDAGraphWrapper):
                wrapper.check_invariants()
    # --8<-- [end:check_invariants]

    # -- one step ------------------------------------------------------------------------

    # --8<-- [start:execute_model]
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step, launched and read back at once."""
        return self._launch(scheduler_output, read_later=False).get_output()

    @torch.inference_mode()
    def execute_model_async(
        self, scheduler_output: SchedulerOutput, defer_sampling: bool = False
    ) -> AsyncModelRunnerOutput | None:
        """One step launched; its output is read back by the handle's ``get_output()``, at the
        latest when the next step is launched. With ``defer_sampling`` only its forward, and
        ``sample_tokens`` samples it (NOTE 12)."""
        if defer_sampling:
            self._deferred = self._launch_forward(scheduler_output)
            return None
        return self._launch(scheduler_output, read_later=True)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> AsyncModelRunnerOutput:
        """NOTE 12: sample the step whose forward ``execute_model_async`` launched, under the
        grammar mask made since; its handle, as ``execute_model_async`` returns it."""
        if self._deferred is None:
            raise RuntimeError("sample_tokens: no step's forward is waiting to be sampled")
        forward, self._deferred = self._deferred, None
        if grammar_output is not None:
            forward.scheduler_output = dataclasses.replace(
                forward.scheduler_output, structured_output_request_ids=grammar_output.structured_output_request_ids,
                grammar_bitmask=grammar_output.grammar_bitmask, num_invalid_spec_tokens=grammar_output.num_invalid_spec_tokens,
            )  # fmt: skip
        return self._handle(self._sample(forward, read_later=True))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """NOTE 14: the drafts the forward waiting for ``sample_tokens`` runs in place of its
        placeholders (vLLM's name); None when this runner proposes none."""
        if self._deferred is None:
            raise RuntimeError("take_draft_token_ids: no step's forward is waiting to be sampled")
        if self.proposer is None:
            return None
        step = self._deferred.step
        rows = [i for i, k in enumerate(step.scheduled_drafts) if k]
        return DraftTokenIds(tuple(step.req_ids[i] for i in rows), tuple(step.drafts[i] for i in rows))

    def launched_drafts(self) -> dict[str, int]:
        """NOTE 14: how many drafts each row of the newest launched step runs, for the rows
        given placeholders (at most as many); empty when this runner proposes none. A trace reads it."""
        step = self._deferred.step if self._deferred is not None else self._in_flight
        if self.proposer is None or step is None:
            return {}
        return {r: len(d) for r, d, k in zip(step.req_ids, step.drafts, step.scheduled_drafts) if k}

    def _launch(self, scheduler_output: SchedulerOutput, read_later: bool) -> AsyncModelRunnerOutput:
        return self._handle(self._sample(self._launch_forward(scheduler_output), read_later))

    def _handle(self, step: StepInFlight) -> AsyncModelRunnerOutput:
        self._in_flight = step
        step.handle = AsyncModelRunnerOutput(lambda: self._read_back(step))
        return step.handle

    def _launch_forward(self, scheduler_output: SchedulerOutput) -> ForwardInFlight:
        self._update_states(scheduler_output)  # (a)
        batch = self.input_batch
        req_ids: list[str] = list(batch.req_ids)  # row order
        prev, self._in_flight = self._in_flight, None
        if self.proposer is not None and prev is not None and prev.handle is not None:
            prev.handle.get_output()  # NOTE 14: the drafts follow the tokens it kept
        states = [self.requests[r] for r in req_ids]
        num_sched = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
        computed = [s.num_computed_tokens for s in states]
        spec = scheduler_output.scheduled_spec_decode_tokens
        drafts = [spec.get(r, ()) for r in req_ids]  # NOTE 9: a request's drafts follow its last token
        scheduled_drafts = [len(d) for d in drafts]
        if self.proposer is not None and spec:  # NOTE 14: placeholders in, real drafts out
            drafts = self._propose_drafts(states, computed, drafts)
            num_sched = [n - k + len(d) for n, k, d in zip(num_sched, scheduled_drafts, drafts)]
            runs = {r: d for r, d, k in zip(req_ids, drafts, scheduled_drafts) if k}  # the step as it runs here
            scheduler_output = dataclasses.replace(scheduler_output, scheduled_spec_decode_tokens=runs)
        feed = self._placeholder_feed(prev, req_ids, states, computed, num_sched)  # NOTE 12
        token_ids = [t for s, c, n, d in zip(states, computed, num_sched, drafts)
                     for t in (*s.token_slice(c, c + n - len(d)), *d)]  # fmt: skip
        for position in (feed.positions if feed is not None else ()):
            token_ids.insert(position, 0)  # a placeholder: the forward reads the device's id

        # (b)-(d): dispatch, pad into the persistent buffers, run (graph replay or eager).
        hidden = metadata = logits = None
        if req_ids:
            fed = None if feed is None else (feed, prev.host_ids.tokens)
            hidden, metadata, logits = self._forward(token_ids, computed, num_sched, [s.block_ids for s in states], feed=fed)
        if prev is not None and prev.handle is not None:
            prev.handle.get_output()  # NOTE 12: its tokens join the output lists before the processors read them
        batch.refresh(spec_token_ids=drafts if spec else None)
        step = StepInFlight(req_ids, states, num_sched, drafts, dict(batch.req_id_to_index), scheduled_drafts)
        return ForwardInFlight(step, hidden, metadata, computed, scheduler_output, logits)

    def _sample(self, forward: ForwardInFlight, read_later: bool) -> StepInFlight:
        """(e) sample; only rows that reached the end of their tokens keep theirs (NOTE 2)."""
        step, hidden, computed, scheduler_output = forward.step, forward.hidden, forward.computed, forward.scheduler_output
        req_ids, states, num_sched, drafts = step.req_ids, step.states, step.num_sched, step.drafts
        if not req_ids:
            return step
        step.complete = [c + n - len(d) >= s.num_tokens for s, c, n, d in zip(states, computed, num_sched, drafts)]
        step.num_invalid_drafts = scheduler_output.num_invalid_spec_tokens
        pending = queue_prompt_logprobs(self.model, states, computed, num_sched, hidden)  # NOTE 8 first half, NOTE 11
        if read_later:  # copied up behind the sampler, before the event (async_output.py NOTE 1)
            pending = [dataclasses.replace(p, tensors=logprobs_to_host_early(p.tensors)) for p in pending]
        step.pending_prompt_logprobs = pending
        if self.pooler is not None:  # NOTE 13: vectors, no token, nothing for the sampler
            step.pooled = self.pooler.pool(
                hidden, [s.pooling_params for s in states], [s.pooling_state for s in states], computed, num_sched, step.complete,
                [s.prompt_token_ids for s in states],
            )  # fmt: skip
            step.tokens = [[] for _ in req_ids]
        elif self.speculative:  # NOTE 9: decided when read back
            step.verification = launch_verification(
                self.model, self.sampler, hidden, num_sched, drafts, self.input_batch.make_sampling_metadata(), req_ids,
                scheduler_output, read_later,
            )  # fmt: skip
        else:
            sampling_metadata = self.input_batch.make_sampling_metadata()
            logits = forward.logits  # [R_pad, V]: from the forward, or the LM head runs now
            logits = self.model.compute_logits(hidden[forward.metadata.logits_indices]) if logits is None else logits
            logits = logits[: len(req_ids)]  # [R, V]
            apply_grammar_bitmask(scheduler_output, req_ids, logits)  # structured outputs: before the sampler
            sampler_output = self.sampler(logits, sampling_metadata)
            if read_later:
                sampler_output = dataclasses.replace(sampler_output, logprobs=logprobs_to_host_early(sampler_output.logprobs))
            step.host_ids = HostIds(sampler_output.sampled_token_ids, sampler_output.no_token, read_later, sampler_output.host_ids)
            step.sampler_output, step.sampling_metadata = sampler_output, sampling_metadata
        for state, n, k, d in zip(states, num_sched, step.scheduled_drafts, drafts):
            state.num_computed_tokens += n + k - len(d)  # as scheduled (NOTE 14); the rejected go when read
        return step

    def _propose_drafts(
        self, states: list[RunnerRequestState], computed: list[int], scheduled: list[tuple[int, ...]]
    ) -> list[tuple[int, ...]]:
        """NOTE 14: each row with placeholder drafts gets the proposer's, at most as many."""
        rows = [i for i, d in enumerate(scheduled) if d]
        for i in rows:
            if computed[i] != states[i].num_tokens - 1:
                raise RuntimeError(f"request {states[i].req_id!r}: drafts scheduled, but it does not decode next")
        drafts = list(scheduled)
        for i, proposed in zip(rows, self.proposer.propose_batch([states[i] for i in rows])):
            drafts[i] = tuple(proposed[: len(scheduled[i])])
        return drafts

    def _placeholder_feed(
        self, prev: StepInFlight | None, req_ids: list[str], states: list[RunnerRequestState],
        computed: list[int], num_sched: list[int],
    ) -> PlaceholderFeed | None:  # fmt: skip
        """NOTE 12: the positions whose token the last step sampled and the host has not read."""
        if prev is None or prev.host_ids is None or (prev.handle is not None and prev.handle.done):
            return None
        feed = placeholder_feed(req_ids, computed, num_sched, [s.num_tokens for s in states], prev.req_id_to_index)
        return feed if feed.positions else None

    @torch.inference_mode()
    def _read_back(self, step: StepInFlight) -> ModelRunnerOutput:
        """Read a launched step back (the one wait, NOTE 11) and update the request states."""
        req_ids, states = step.req_ids, step.states
        if not req_ids:
            return ModelRunnerOutput([], {}, [])
        tokens, logprobs = step.tokens, step.logprobs
        if step.verification is not None:  # NOTE 9: the drafts kept are decided now
            tokens, logprobs = finish_verification(step.verification, req_ids, step.complete)
        elif tokens is None:  # plain sampling: the ids come up now
            ids, no_token = step.host_ids.get()  # the wait
            tokens = [None if none else [token] for token, none in zip(ids, no_token)]  # [R]
            logprobs = self._sample_logprobs(step.sampler_output, step.sampling_metadata, req_ids, step.complete)
        prompt_logprobs = self._collect_prompt_logprobs(step.pending_prompt_logprobs)
        no_token_req_ids = set()
        for row, (state, done, k) in enumerate(zip(states, step.complete, step.scheduled_drafts)):
            if done and tokens[row] is None:  # nothing left to sample: it ends (sampler NOTE 7)
                no_token_req_ids.add(state.req_id)
                logger.warning("request %r: no token is left to sample (every logit -inf or NaN); it ends with an error", state.req_id)
            kept = tokens[row] if done and tokens[row] is not None else []
            state.num_computed_tokens -= k + 1 - len(kept) if k else 0  # rejected drafts undone (NOTE 14)
            state.output_token_ids.extend(kept)
            tokens[row] = kept
        pooled = {r: v.cpu() for r, v in zip(req_ids, step.pooled or ()) if v is not None}  # NOTE 13
        invalid = step.num_invalid_drafts  # sched_output.py NOTE 5: those a grammar refused are not counted
        proposed = {r: d[: k - invalid.get(r, 0)] for r, d, k in zip(req_ids, step.drafts, step.scheduled_drafts)
                    if k and self.proposer}  # fmt: skip
        return ModelRunnerOutput(  # rows 0 .. R-1
            req_ids, step.req_id_to_index, tokens, logprobs, prompt_logprobs, frozenset(no_token_req_ids), pooled, proposed,
        )
    # --8<-- [end:execute_model]

    # --8<-- [start:logprobs]
    @staticmethod
    def _sample_logprobs(
        sampler_output, metadata, req_ids: list[str], complete: list[bool]
    ) -> dict[str, list[LogprobEntry]]:
        """The sampler's logprobs of the rows that asked, for the rows that got a token (NOTE 2)."""
        if sampler_output.logprobs is None:
            return {}
        rows = sampler_output.logprob_rows
        entries = logprob_ops.row_entries(sampler_output.logprobs, [metadata.num_logprobs[row] for row in rows])
        return {req_ids[row]: [entry] for row, entry in zip(rows, entries) if complete[row]}

    _collect_prompt_logprobs = staticmethod(collect_prompt_logprobs)  # NOTE 8, second half, after the wait
    # --8<-- [end:logprobs]
