"""LLMEngine: requests in, one step at a time, outputs out.

Concept: the loop that ties the pieces together. ``add_request`` hands a tokenized prompt
to the scheduler; ``step()`` schedules, runs the model, feeds the sampled tokens back to the
scheduler and turns them into ``RequestOutput``s: one per request when it finishes, or every
step for ``output_kind`` DELTA or CUMULATIVE (NOTE 2). It also detokenises, applies stop
strings (NOTE 3) and keeps the timing.

Follows: the docs page "The model runner" (one engine step: schedule, execute, update).
Mirrors: ``vllm/v1/engine/llm_engine.py`` and ``vllm/v1/engine/core.py`` (``EngineCore.step``)
with the output processor folded in; nano-vllm's ``LLMEngine.step``.

Invariants: every request added is either unfinished in the scheduler or returned exactly
once as a finished ``RequestOutput`` (or aborted). ``check_invariants()`` checks between
steps that the engine tracks exactly the scheduler's unfinished requests, the runner holds
state only for those and for the finished ones the next step reports, and the runner's copy
of each request that ran and still runs (block ids, output tokens) equals the scheduler's, as
vLLM's worker and scheduler agree with only ``SchedulerOutput``/``ModelRunnerOutput`` between.

NOTE 1 (a step that raises): if anything after ``schedule()`` raises (forward, sampler, a
logits processor, the scheduler's update, proposer, detokenizer, stop strings, outputs;
``KeyboardInterrupt`` too), the step's requests are aborted and their blocks freed (finished
ones too: their outputs never left), blocks it cached leave the prefix cache unless the
forward wrote them, the runner empties its batch, and the exception reaches the caller;
other requests carry on. vLLM's engine reports itself dead; one shared by nobody need not.
NOTE 2 (streaming): a request that streams or has stop strings is detokenised every step by
an ``IncrementalDetokenizer`` (never half a character); others once, when they finish; one
with ``detokenize=False`` never (``sampling_params.py`` NOTE 8).
NOTE 3 (stop strings): the new text, plus ``len(stop) - 1`` characters before it (a stop split
across tokens), is searched; as in vLLM a stop counts only if it ends in an output after the
first ``min_tokens``. Of several, the one that starts first wins (vLLM: first in the list).
A hit cuts the text, the scheduler finishes the request (``finish_requests`` frees its blocks
at once), and the output says ``finish_reason="stop"``, ``stop_reason=<the string>``. A
streaming request without ``include_stop_str_in_output`` holds back its last ``len(longest
stop) - 1`` characters: they might start a stop string. A stop token (EOS, ``stop_token_ids``)
keeps its id but not its text unless ``include_stop_str_in_output``, as vLLM's detokenizer
leaves out the last token when ``stop_terminated``.
NOTE 4 (an undo that fails too): every part of the undo runs (``try``/``finally``); a second
exception is logged and noted on the first, which the caller gets: it explains the failure.
NOTE 5 (logprobs): the runner sends token ids, logprobs and ranks (``LogprobEntry``); the
engine turns them into vLLM's ``{token_id: Logprob}`` with each token's text and reports
them as it reports tokens (a DELTA output: its own tokens', and prompt logprobs once).
``cumulative_logprob`` sums the chosen tokens' logprobs (None when none were asked for).
NOTE 6 (n completions): ``SamplingParams.n`` > 1 adds n child requests
(``engine/parallel_sampling.py``) that scheduler and runner see as any other; ``step`` and
``abort_request`` hand each child's output to its ``ParentRequest``, which gathers them;
``unfinished_request_ids`` names the parent.
NOTE 7 (bad words): the engine has the tokenizer, so it turns ``bad_words`` into token
sequences when a request is added (``sample/bad_words.py`` NOTE 1), checks them against the
vocabulary and hands them on with the ``Request``; an engine without a tokenizer refuses them.
NOTE 8 (speculative decoding): with a proposer, every running request that sampled a token
in a step gets drafts (``Request.spec_token_ids``, ``spec_decode/ngram_proposer.py``), a
partial prefill none, as in vLLM; the runner keeps those the target agrees with.
NOTE 9 (an observer): ``observer`` (None by default) is called after every step, a failed one
too (after the undo, with the error); what it raises is logged and noted, never raised in
the step's place. The step pays one ``is not None`` check (``trace/recorder.py`` measures it).
NOTE 10 (no token left): a request whose ``allowed_token_ids`` are all banned by its own
parameters is refused here (``check_some_token_is_allowed``); one that runs out later ends with
``finish_reason="error"`` (``sample/sampler.py`` NOTE 7), never with a token it banned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tinyvllm.config import ReasoningConfig
from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.detokenizer import IncrementalDetokenizer, decode_text
from tinyvllm.engine.parallel_sampling import ParentRequest
from tinyvllm.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    LogprobEntry,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sample.bad_words import tokenize_bad_words
from tinyvllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from tinyvllm.engine.request_checks import check_request_against_model
from tinyvllm.validation import check_token_ids
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.executor.abstract import Executor
from tinyvllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """What the engine remembers of a request until it is returned."""

    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None = None  # None: decoded once, at the end (NOTE 2)
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when a step first scheduled it (vLLM's scheduled_ts)
    num_cached_tokens: int = 0
    text_end: int | None = None  # where a stop string cut the text (NOTE 3)
    stop_token_hidden: bool = False  # the last token stopped the request and has no text (NOTE 3)
    stop_checked_chars: int = 0  # text already searched for stop strings
    sent_chars: int = 0  # DELTA: text and tokens already reported
    sent_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None  # one per token of token_ids, when asked (NOTE 5)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False  # DELTA: sent once


# --8<-- [start:some_token_allowed]
def check_some_token_is_allowed(
    label: str, params: SamplingParams, bad_words_token_ids: Sequence[Sequence[int]], eos_token_id: int | None
) -> None:
    """NOTE 10: a ValueError when ``allowed_token_ids`` leaves nothing that the request's
    own parameters do not ban at its first step: one-token bad words, and, below
    ``min_tokens``, its stop tokens and EOS (which MinTokens masks)."""
    if params.allowed_token_ids is None:
        return
    allowed = set(params.allowed_token_ids)
    one_token_bans = {seq[0] for seq in bad_words_token_ids if len(seq) == 1}
    if allowed <= one_token_bans:
        raise ValueError(
            f"{label}: every id of allowed_token_ids={sorted(allowed)} is a one-token bad word of "
            f"bad_words={list(params.bad_words)}: no token could ever be sampled"
        )
    if params.min_tokens > 0:
        stops = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stops.add(eos_token_id)
        if allowed <= stops | one_token_bans:
            raise ValueError(
                f"{label}: allowed_token_ids={sorted(allowed)} holds only stop tokens (stop_token_ids="
                f"{list(params.stop_token_ids)}, EOS {eos_token_id}) or bad words, which min_tokens="
                f"{params.min_tokens} masks: no first token could be sampled"
            )
# --8<-- [end:some_token_allowed]


class StepObserver(Protocol):
    """Called by ``LLMEngine.step`` after each step (NOTE 9); ``error`` is set when the step
    raised and was undone, and then ``core_outputs`` is empty."""

    def on_step(
        self, engine: LLMEngine, scheduler_output: SchedulerOutput, core_outputs: list[EngineCoreOutput],
        error: BaseException | None,
    ) -> None: ...  # fmt: skip


class LLMEngine:
    """Schedule -> execute -> update, one step at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_executor: Executor,
        tokenizer=None,
        eos_token_id: int | None = None,
        *,
        vocab_size: int | None = None,
        reasoning_config: ReasoningConfig | None = None,
        proposer: NgramProposer | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ):
        self.scheduler = scheduler
        self.model_executor = model_executor  # the engine's one door to the device
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size  # None: unknown, token ids are not checked against a vocabulary
        self.reasoning_config = reasoning_config  # None: thinking_token_budget is refused
        self.proposer = proposer  # None: no speculative decoding (NOTE 8)
        self.max_logprobs = max_logprobs  # the most logprobs a request may ask for; -1: no cap
        self._tracked: dict[str, _Tracked] = {}
        self._parents: dict[str, ParentRequest] = {}  # a request with n > 1, by its id (NOTE 6)
        self._parent_of: dict[str, tuple[ParentRequest, int]] = {}  # child id -> (parent, index)
        self.observer: StepObserver | None = None  # NOTE 9

    @property
    def model_runner(self) -> ModelRunner:
        """The one-process executor's runner, for tests, benches, the step recorder and
        ``check_invariants`` to read; the engine calls only ``model_executor``."""
        return self.model_executor.driver_worker.model_runner

    # --8<-- [start:add_request]
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; TypeError or ValueError (nothing queued) on a bad one.

        Checked against the model here, so that a bad request fails now and never inside
        ``step()``: token ids (the prompt's, ``logit_bias``'s, ``stop_token_ids``, the tokens of
        ``bad_words``, which need the engine's tokenizer: NOTE 7) must lie in
        ``[0, vocab_size)`` when the engine was given ``vocab_size``, and
        ``thinking_token_budget`` needs the engine's ``reasoning_config``. Requests with
        different ``cache_salt``s never share a cached block (``core/prefix_hash.py``).
        ``sampling_params.n`` > 1 adds n child requests, all or none (NOTE 6).
        """
        if not isinstance(sampling_params, SamplingParams) or sampling_params.n == 1:  # a bad type: _add_one says so
            self._add_one(request_id, prompt_token_ids, sampling_params, prompt, cache_salt)
            return
        parent = ParentRequest(request_id, sampling_params)
        children = [parent.child_id(i) for i in range(sampling_params.n)]
        taken = [rid for rid in (request_id, *children) if rid in self._tracked or rid in self._parents]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use (a request with n={sampling_params.n})")
        added: list[str] = []
        try:
            for index, child_id in enumerate(children):
                self._add_one(child_id, prompt_token_ids, parent.child_params(index), prompt, cache_salt)
                added.append(child_id)
        except BaseException:
            self.abort_request(added)
            raise
        self._parents[request_id] = parent
        for index, child_id in enumerate(children):
            self._parent_of[child_id] = (parent, index)
    # --8<-- [end:add_request]

    def _add_one(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
        prompt: str | None, cache_salt: str | None,
    ) -> None:  # fmt: skip
        """One sequence: checked, then queued in the scheduler and tracked here."""
        if request_id in self._parents:
            raise ValueError(f"duplicate request id {request_id!r} (a request with n > 1 has it)")
        request = Request(request_id, prompt_token_ids, sampling_params, eos_token_id=self.eos_token_id, cache_salt=cache_salt)
        if prompt is not None and not isinstance(prompt, str):
            raise TypeError(f"request {request_id!r}: prompt must be a str or None, got {prompt!r}")
        label = f"request {request_id!r}"
        check_token_ids(f"{label}: prompt_token_ids", request.prompt_token_ids, self.vocab_size)
        check_request_against_model(
            f"{label}: sampling_params", sampling_params, self.vocab_size, self.reasoning_config is not None,
            speculative=self.proposer is not None, max_logprobs=self.max_logprobs,
        )  # fmt: skip
        incremental = sampling_params.stop or sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"{label}: stop={sampling_params.stop!r} needs text, but the engine has no tokenizer")
        request.bad_words_token_ids = self._bad_words_token_ids(label, sampling_params)  # NOTE 7
        check_some_token_is_allowed(label, sampling_params, request.bad_words_token_ids, self.eos_token_id)  # NOTE 10
        self.scheduler.add_request(request)
        detokenizer = (
            IncrementalDetokenizer(self.tokenizer, sampling_params.skip_special_tokens)
            if incremental and self.tokenizer and sampling_params.detokenize
            else None
        )
        self._tracked[request_id] = _Tracked(
            prompt, list(request.prompt_token_ids), time.perf_counter(), sampling_params, detokenizer,
            logprobs=[] if sampling_params.logprobs is not None else None,
        )  # fmt: skip

    def _bad_words_token_ids(self, label: str, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences, each id in the vocabulary (NOTE 7)."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise ValueError(f"{label}: bad_words={params.bad_words!r} needs a tokenizer, but the engine has none")
        sequences = tokenize_bad_words(self.tokenizer, params.bad_words)
        for seq in sequences:
            check_token_ids(f"{label}: bad_words {self.tokenizer.decode(list(seq))!r}", seq, self.vocab_size)
        return sequences

    # --8<-- [start:abort_request]
    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks. Returns the final output of each one that
        was unfinished (``finished=True``, ``finish_reason="abort"``, the text of the tokens it
        got), so that whoever waits on it can end; unknown and finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [child for rid in ids for child in self._sequences(rid)]  # a parent's unfinished children
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        now = time.perf_counter()
        outputs = []
        for rid in ids:
            tracked = self._tracked.pop(rid, None)
            if tracked is None:
                continue
            if tracked.detokenizer is not None:
                tracked.detokenizer.finish()
            output = self._to_parent(self._make_output(rid, tracked, "abort", None, now))
            if output is not None:
                outputs.append(output)
        return outputs
    # --8<-- [end:abort_request]

    # --8<-- [start:step]
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the finished requests, and the streaming ones that got tokens (NOTE 2)."""
        scheduler_output = self.scheduler.schedule()
        self._note_first_scheduling(scheduler_output)
        try:
            model_output = self.model_executor.execute_model(scheduler_output)
            core_outputs = self.scheduler.update_from_output(scheduler_output, model_output)
            if self.proposer is not None:
                self._propose_drafts(core_outputs)  # NOTE 8: the next step verifies them
            outputs = self._process_outputs(core_outputs)
        except BaseException as error:  # KeyboardInterrupt too: the engine must stay usable (NOTE 1)
            self._abort_failed_step(scheduler_output, error)
            self._observe(scheduler_output, [], error)
            raise
        self._observe(scheduler_output, core_outputs, None)
        return outputs
    # --8<-- [end:step]

    # --8<-- [start:process_outputs]
    def _process_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The step's tokens into each request's text, stop strings and ``RequestOutput``s."""
        now = time.perf_counter()
        outputs = []
        for out in core_outputs:
            tracked = self._tracked[out.request_id]
            if out.new_token_ids and tracked.first_token_time is None:
                tracked.first_token_time = now
                tracked.num_cached_tokens = out.num_cached_tokens
            num_before = len(tracked.token_ids)
            tracked.token_ids.extend(out.new_token_ids)
            self._update_logprobs(tracked, out)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            text_ids = out.new_token_ids
            if finish_reason == "stop" and not tracked.params.include_stop_str_in_output:
                tracked.stop_token_hidden, text_ids = True, text_ids[:-1]  # EOS or a stop token (NOTE 3)
            if tracked.detokenizer is not None:
                stop = self._update_text(tracked, text_ids, num_before, out.finished)
                if stop is not None:  # NOTE 3
                    if not out.finished:
                        self.scheduler.finish_requests(out.request_id, RequestStatus.FINISHED_STOPPED)
                    finish_reason, stop_reason = "stop", stop
            if finish_reason is not None:
                del self._tracked[out.request_id]
            elif tracked.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue  # nothing to report until it finishes (NOTE 2)
            output = self._make_output(out.request_id, tracked, finish_reason, stop_reason, now)
            if output is not None and (output := self._to_parent(output)) is not None:  # NOTE 6
                outputs.append(output)
        return outputs
    # --8<-- [end:process_outputs]

    def _note_first_scheduling(self, scheduler_output: SchedulerOutput) -> None:
        """The time each request is first scheduled (``RequestMetrics.scheduled_time``)."""
        if scheduler_output.scheduled_new_reqs:
            now = time.perf_counter()
            for new in scheduler_output.scheduled_new_reqs:
                self._tracked[new.req_id].scheduled_time = now

    def _observe(
        self, scheduler_output: SchedulerOutput, core_outputs: list[EngineCoreOutput], error: BaseException | None
    ) -> None:
        """NOTE 9: tell the observer, if any; what it raises never replaces the step's own
        error, nor loses a step's outputs: it is logged, and attached to the step's error."""
        if self.observer is None:
            return
        try:
            self.observer.on_step(self, scheduler_output, core_outputs, error)
        except Exception as observer_error:
            logger.exception("the step observer %r raised", self.observer)
            if error is not None:
                error.add_note(f"tinyvllm: the step observer also raised {observer_error!r}")

    # --8<-- [start:propose]
    def _propose_drafts(self, core_outputs: list[EngineCoreOutput]) -> None:
        """NOTE 8: drafts for every request that sampled a token this step and runs on,
        searched for all of them at once (``ngram_proposer.py`` NOTE 2). A request that only
        computed a chunk of its prompt sampled nothing and gets none, as in vLLM."""
        for request in self.scheduler.running:
            request.spec_token_ids = []
        requests = self.scheduler.requests
        decoding = [requests[out.request_id] for out in core_outputs if out.new_token_ids and out.finish_reason is None]
        for request, drafts in zip(decoding, self.proposer.propose_batch(decoding)):
            request.spec_token_ids = drafts
    # --8<-- [end:propose]

    # --8<-- [start:parents]
    def _sequences(self, request_id: str) -> list[str]:
        """The ids the scheduler knows ``request_id`` by: a parent's unfinished children, else itself."""
        parent = self._parents.get(request_id)
        return [request_id] if parent is None else [parent.child_id(i) for i in sorted(parent.unfinished)]

    def _to_parent(self, output: RequestOutput) -> RequestOutput | None:
        """A child's output as its parent's (``engine/parallel_sampling.py``); others as they are."""
        link = self._parent_of.get(output.request_id)
        if link is None:
            return output
        parent, index = link
        if output.finished:
            del self._parent_of[output.request_id]
        gathered = parent.add(index, output)
        if gathered is not None and gathered.finished:
            del self._parents[parent.request_id]
        return gathered
    # --8<-- [end:parents]

    # --8<-- [start:update_logprobs]
    def _update_logprobs(self, tracked: _Tracked, out: EngineCoreOutput) -> None:
        """The step's logprob entries as ``Logprob``s with their text (NOTE 5)."""
        with_text = self.tokenizer is not None and tracked.params.detokenize  # each token's text too
        for entry in out.new_logprobs or ():
            tracked.logprobs.append(self._position_logprobs(entry, with_text))
            tracked.cumulative_logprob += entry[1][0]  # the chosen token's logprob comes first
        if out.prompt_logprobs is not None:  # nothing predicts the first prompt token
            tracked.prompt_logprobs = [None] + [self._position_logprobs(entry, with_text) for entry in out.prompt_logprobs]

    def _position_logprobs(self, entry: LogprobEntry, with_text: bool) -> PositionLogprobs:
        """``{token_id: Logprob}``: the chosen token with its rank, then the top k with ranks
        1..k; each with its text when ``with_text``."""
        token_ids, logprobs, rank = entry
        ranks = [rank, *range(1, len(token_ids))]
        return {
            token: Logprob(logprob, r, decode_text(self.tokenizer, [token], False) if with_text else None)
            for token, logprob, r in zip(token_ids, logprobs, ranks)
        }
    # --8<-- [end:update_logprobs]

    # --8<-- [start:update_text]
    def _update_text(self, tracked: _Tracked, new_token_ids: list[int], num_before: int, finished: bool) -> str | None:
        """Detokenise the new tokens (the request had ``num_before`` outputs before them);
        return the stop string found in the new text, if any (NOTE 3)."""
        detokenizer, params = tracked.detokenizer, tracked.params
        held = min(len(new_token_ids), max(0, params.min_tokens - num_before))  # inside the first min_tokens
        if held:
            detokenizer.update(new_token_ids[:held])
            tracked.stop_checked_chars = len(detokenizer.text)  # never searched
        detokenizer.update(new_token_ids[held:])
        if finished:
            detokenizer.finish()
        text, checked = detokenizer.text, tracked.stop_checked_chars
        tracked.stop_checked_chars = len(text)
        if not params.stop or held == len(new_token_ids):
            return None
        # each stop string may begin up to len(stop) - 1 characters before the new text
        hits = [(i, stop) for stop in params.stop if (i := text.find(stop, max(0, checked - len(stop) + 1))) >= 0]
        if not hits:
            return None
        index, stop = min(hits)  # the earliest stop string in the text wins (vLLM: the first listed)
        tracked.text_end = index + len(stop) if params.include_stop_str_in_output else index
        return stop
    # --8<-- [end:update_text]

    # --8<-- [start:abort_failed_step]
    def _abort_failed_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> None:
        """NOTE 1: as if the failed step's requests had never been added. Never raises: a
        second error on the way is attached to ``error`` as a note, and every part still runs."""
        step_ids = list(scheduler_output.num_scheduled_tokens)
        try:
            try:
                self.scheduler.abort_failed_step(scheduler_output)
            finally:
                self.model_executor.recover_from_failed_step(step_ids)
        except BaseException as second:  # the first error is the one the caller gets (NOTE 4)
            error.add_note(f"tinyvllm: undoing the failed step also raised {second!r}")
            logger.error("undoing a failed step raised %r (the step raised %r)", second, error)
        finally:
            for rid in step_ids:
                self._tracked.pop(rid, None)
            self._drop_parents_of(step_ids)
    # --8<-- [end:abort_failed_step]

    def _drop_parents_of(self, failed_ids: list[str]) -> None:
        """A failed child's siblings are aborted with it (``parallel_sampling.py`` NOTE 2)."""
        parents = {self._parent_of[rid][0] for rid in failed_ids if rid in self._parent_of}
        for parent in parents:
            children = [parent.child_id(i) for i in range(parent.params.n)]
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            for child in children:
                self._tracked.pop(child, None)
                self._parent_of.pop(child, None)
            del self._parents[parent.request_id]

    # --8<-- [start:check_invariants]
    def check_invariants(self) -> None:
        """The scheduler and the runner check themselves, then their two copies of each
        request are compared (module header). Call it between steps."""
        scheduler, runner = self.scheduler, self.model_runner
        scheduler.check_invariants()
        self.model_executor.check_invariants()  # the worker and its runner check themselves
        if self.proposer is not None:
            self.proposer.check_invariants()
        unfinished, tracked = set(scheduler.requests), set(self._tracked)
        assert tracked == unfinished, (
            f"the engine tracks {sorted(tracked - unfinished)} that the scheduler has not, "
            f"and not {sorted(unfinished - tracked)} that it has"
        )
        stale = set(runner.requests) - unfinished - scheduler.finished_req_ids
        assert not stale, f"the runner holds states of {sorted(stale)}, neither unfinished nor about to be reported finished"
        kv = scheduler.kv_cache_manager
        for req_id in runner.input_batch.req_id_to_index:
            request = scheduler.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted since it ran: the next step removes it from the batch
            state = runner.requests[req_id]
            blocks = kv.get_block_ids(req_id)
            assert state.block_ids == blocks, (
                f"request {req_id!r}: the runner's block ids {state.block_ids} != the scheduler's {blocks}"
            )
            assert state.output_token_ids == request.output_token_ids, (
                f"request {req_id!r}: the runner's output tokens {state.output_token_ids} != "
                f"the scheduler's {request.output_token_ids}"
            )
    # --8<-- [end:check_invariants]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> set[str]:
        """The requests added and not yet returned finished or aborted (a parent by its own id)."""
        return {self._parent_of[rid][0].request_id if rid in self._parent_of else rid for rid in self._tracked}

    # --8<-- [start:make_output]
    def _make_output(
        self, request_id: str, tracked: _Tracked, finish_reason: str | None, stop_reason: int | str | None, now: float
    ) -> RequestOutput | None:
        """The request's output for this step per its ``output_kind`` (a FINAL_ONLY request's
        only when it finishes: ``step`` skips the others); None when a DELTA has nothing new."""
        kind = tracked.params.output_kind
        finished = finish_reason is not None
        text = self._visible_text(tracked, finished)
        token_ids, logprobs, prompt_logprobs = tracked.token_ids, tracked.logprobs, tracked.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            text, token_ids = text[tracked.sent_chars :], token_ids[tracked.sent_tokens :]
            if not (text or token_ids or finished):
                return None
            if logprobs is not None:
                logprobs = logprobs[tracked.sent_tokens :]
            if tracked.sent_prompt_logprobs:
                prompt_logprobs = None
            tracked.sent_prompt_logprobs = prompt_logprobs is not None
            tracked.sent_chars += len(text)
            tracked.sent_tokens += len(token_ids)
        elif kind == RequestOutputKind.CUMULATIVE:
            token_ids = list(token_ids)  # a snapshot: the tracked list grows
            logprobs = None if logprobs is None else list(logprobs)
        cumulative = tracked.cumulative_logprob if logprobs is not None else None
        completion = CompletionOutput(0, text, token_ids, finish_reason, stop_reason, logprobs, cumulative)
        return RequestOutput(
            request_id=request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=tracked.num_cached_tokens,
            metrics=RequestMetrics(
                tracked.arrival_time, tracked.first_token_time, now if finished else None, tracked.scheduled_time
            ),
            prompt_logprobs=prompt_logprobs,
        )
    # --8<-- [end:make_output]

    def _visible_text(self, tracked: _Tracked, finished: bool) -> str:
        """The text a client may see now: cut at a stop string, less what is held back (NOTE 3)."""
        if tracked.detokenizer is None:  # decoded once, at the end (NOTE 2)
            if self.tokenizer is None or not tracked.params.detokenize:
                return ""
            skip, ids = tracked.params.skip_special_tokens, tracked.token_ids
            return decode_text(self.tokenizer, ids[:-1] if tracked.stop_token_hidden else ids, skip)
        text = tracked.detokenizer.text
        if tracked.text_end is not None:
            return text[: tracked.text_end]
        params = tracked.params
        if finished or not params.stop or params.include_stop_str_in_output:
            return text
        return text[: max(tracked.sent_chars, len(text) - max(map(len, params.stop)) + 1)]
