"""OutputProcessor: the step's sampled tokens into text, stop strings and ``RequestOutput``s.

Concept: the front half of an engine step. The scheduler says which tokens each request got
(``EngineCoreOutput``); the output processor keeps one ``RequestState`` per request and turns
them into what a caller reads: the detokenised text (NOTE 1), cut at a stop string (NOTE 2),
the logprobs with each token's text (NOTE 3), and a ``RequestOutput`` per request and step as
its ``output_kind`` asks; a child of an ``n`` > 1 request is gathered into its parent's
(``engine/parallel_sampling.py``). It touches no tensor and no scheduler: a stop string it
finds is returned, and ``LLMEngine.step`` finishes that request in the scheduler in the same
step.

Mirrors: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``, ``RequestState``,
``process_outputs`` returning ``reqs_to_abort``; the ``ParentRequest`` lookup lives there too)
and ``vllm/v1/engine/logprobs.py`` (``LogprobsProcessor``).

Invariants: a request has a ``RequestState`` from ``add_request`` until its finished output
is made (or it is aborted or dropped with a failed step); a child is linked to its parent
exactly while it has a state; a DELTA output never repeats text or tokens already sent.

NOTE 1 (streaming): a request that streams or has stop strings is detokenised every step by
an ``IncrementalDetokenizer`` (never half a character); others once, when they finish; one
with ``detokenize=False`` never (``sampling_params.py`` NOTE 8).
NOTE 2 (stop strings): the new text, plus ``len(stop) - 1`` characters before it (a stop split
across tokens), is searched; as in vLLM a stop counts only if it ends in an output after the
first ``min_tokens``. Of several, the one that starts first wins (vLLM: first in the list).
A hit cuts the text, the scheduler finishes the request (``finish_requests`` frees its blocks
at once), and the output says ``finish_reason="stop"``, ``stop_reason=<the string>``. A
streaming request without ``include_stop_str_in_output`` holds back its last ``len(longest
stop) - 1`` characters: they might start a stop string. A stop token (EOS, ``stop_token_ids``)
keeps its id but not its text unless ``include_stop_str_in_output``, as vLLM's detokenizer
leaves out the last token when ``stop_terminated``.
NOTE 3 (logprobs): the runner sends token ids, logprobs and ranks (``LogprobEntry``); they
become vLLM's ``{token_id: Logprob}`` with each token's text and are reported as tokens are
(a DELTA output: its own tokens', and prompt logprobs once). ``cumulative_logprob`` sums the
chosen tokens' logprobs (None when none were asked for).
NOTE 4 (one list per sampled token): a sampled token is appended to the scheduler's
``Request`` (``output_token_ids`` and ``all_token_ids``, which the runner's batch shares by
reference) and to ``RequestState.token_ids`` here: the output keeps its own list because a
``RequestOutput`` outlives the scheduler's request and a DELTA slices it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.engine.detokenizer import IncrementalDetokenizer, decode_text
from tinyvllm.engine.parallel_sampling import ParentRequest
from tinyvllm.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    LogprobEntry,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    """What the output processor remembers of a request until it is returned."""

    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None = None  # None: decoded once, at the end (NOTE 1)
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    scheduled_time: float | None = None  # when a step first scheduled it (vLLM's scheduled_ts)
    num_cached_tokens: int = 0
    text_end: int | None = None  # where a stop string cut the text (NOTE 2)
    stop_token_hidden: bool = False  # the last token stopped the request and has no text (NOTE 2)
    stop_checked_chars: int = 0  # text already searched for stop strings
    sent_chars: int = 0  # DELTA: text and tokens already reported
    sent_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None  # one per token of token_ids, when asked (NOTE 3)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False  # DELTA: sent once
    pooling: bool = False  # a pooling request: its one output is a PoolingRequestOutput (outputs.py NOTE 2)


class OutputProcessor:
    """Per-request output state; ``EngineCoreOutput``s in, ``RequestOutput``s out."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer  # None: no text (an engine built without one)
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}  # a request with n > 1, by its id
        self._parent_of: dict[str, tuple[ParentRequest, int]] = {}  # child id -> (parent, index)

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, pooling: bool = False
    ) -> None:
        """Start tracking a request the scheduler has just queued (``pooling``: one that ends with a vector)."""
        incremental = params.stop or params.output_kind != RequestOutputKind.FINAL_ONLY
        detokenizer = (
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            if incremental and self.tokenizer and params.detokenize
            else None
        )
        self.request_states[request_id] = RequestState(
            prompt, list(prompt_token_ids), time.perf_counter(), params, detokenizer,
            logprobs=[] if params.logprobs is not None else None, pooling=pooling,
        )  # fmt: skip

    def add_parent(self, parent: ParentRequest, children: list[str]) -> None:
        """Link the children (already added) to their parent, which gathers their outputs."""
        self.parent_requests[parent.request_id] = parent
        for index, child_id in enumerate(children):
            self._parent_of[child_id] = (parent, index)

    def id_in_use(self, request_id: str) -> bool:
        return request_id in self.request_states or request_id in self.parent_requests

    def note_first_scheduling(self, scheduler_output: SchedulerOutput) -> None:
        """The time each request is first scheduled (``RequestMetrics.scheduled_time``)."""
        if scheduler_output.scheduled_new_reqs:
            now = time.perf_counter()
            for new in scheduler_output.scheduled_new_reqs:
                self.request_states[new.req_id].scheduled_time = now

    # --8<-- [start:process_outputs]
    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The step's tokens into each request's text, stop strings and ``RequestOutput``s;
        ``(outputs, ids a stop string finished)``: the engine finishes those in the scheduler."""
        now = time.perf_counter()
        outputs, stopped = [], []
        for out in core_outputs:
            tracked = self.request_states[out.request_id]
            if out.pooling_output is not None:  # a pooling request's one output (outputs.py NOTE 2)
                del self.request_states[out.request_id]
                outputs.append(PoolingRequestOutput(out.request_id, PoolingOutput(out.pooling_output),
                                                    tracked.prompt_token_ids, out.num_cached_tokens))  # fmt: skip
                continue
            if out.new_token_ids and tracked.first_token_time is None:
                tracked.first_token_time = now
                tracked.num_cached_tokens = out.num_cached_tokens
            num_before = len(tracked.token_ids)
            tracked.token_ids.extend(out.new_token_ids)  # NOTE 4
            self._update_logprobs(tracked, out)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            text_ids = out.new_token_ids
            if finish_reason == "stop" and not tracked.params.include_stop_str_in_output:
                tracked.stop_token_hidden, text_ids = True, text_ids[:-1]  # EOS or a stop token (NOTE 2)
            if tracked.detokenizer is not None:
                stop = self._update_text(tracked, text_ids, num_before, out.finished)
                if stop is not None:  # NOTE 2
                    if not out.finished:
                        stopped.append(out.request_id)
                    finish_reason, stop_reason = "stop", stop
            if finish_reason is not None:
                del self.request_states[out.request_id]
            elif tracked.params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue  # nothing to report until it finishes (NOTE 1)
            output = self._make_output(out.request_id, tracked, finish_reason, stop_reason, now)
            if output is not None and (output := self._to_parent(output)) is not None:
                outputs.append(output)
        return outputs, stopped
    # --8<-- [end:process_outputs]

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """The final output (``finish_reason="abort"``) of each tracked one; others are ignored."""
        now = time.perf_counter()
        outputs = []
        for rid in request_ids:
            tracked = self.request_states.pop(rid, None)
            if tracked is None:
                continue
            if tracked.pooling:  # aborted before its vector: a pooling output holding none
                outputs.append(PoolingRequestOutput(rid, None, tracked.prompt_token_ids, tracked.num_cached_tokens))
                continue
            if tracked.detokenizer is not None:
                tracked.detokenizer.finish()
            output = self._to_parent(self._make_output(rid, tracked, "abort", None, now))
            if output is not None:
                outputs.append(output)
        return outputs

    # --8<-- [start:parents]
    def sequences(self, request_id: str) -> list[str]:
        """The ids the scheduler knows ``request_id`` by: a parent's unfinished children, else itself."""
        parent = self.parent_requests.get(request_id)
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
            del self.parent_requests[parent.request_id]
        return gathered
    # --8<-- [end:parents]

    def drop_failed(self, failed_ids: list[str]) -> list[str]:
        """Forget a failed step's requests; returns their siblings (children of the same
        parents), which the engine aborts with them (``parallel_sampling.py`` NOTE 2)."""
        for rid in failed_ids:
            self.request_states.pop(rid, None)
        parents = {self._parent_of[rid][0] for rid in failed_ids if rid in self._parent_of}
        siblings = []
        for parent in parents:
            children = [parent.child_id(i) for i in range(parent.params.n)]
            siblings.extend(children)
            for child in children:
                self.request_states.pop(child, None)
                self._parent_of.pop(child, None)
            del self.parent_requests[parent.request_id]
        return siblings

    def check_invariants(self) -> None:
        """Every child linked to a parent has a state, and its parent is registered (module header)."""
        for child, (parent, _) in self._parent_of.items():
            assert child in self.request_states, f"child {child!r} of {parent.request_id!r} is linked but has no state"
            assert self.parent_requests.get(parent.request_id) is parent, (
                f"child {child!r} is linked to {parent.request_id!r}, which is not a registered parent"
            )

    def unfinished_request_ids(self) -> set[str]:
        """The requests tracked and not yet returned finished or aborted (a parent by its own id)."""
        return {self._parent_of[rid][0].request_id if rid in self._parent_of else rid for rid in self.request_states}

    # --8<-- [start:update_logprobs]
    def _update_logprobs(self, tracked: RequestState, out: EngineCoreOutput) -> None:
        """The step's logprob entries as ``Logprob``s with their text (NOTE 3)."""
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
    def _update_text(self, tracked: RequestState, new_token_ids: list[int], num_before: int, finished: bool) -> str | None:
        """Detokenise the new tokens (the request had ``num_before`` outputs before them);
        return the stop string found in the new text, if any (NOTE 2)."""
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

    # --8<-- [start:make_output]
    def _make_output(
        self, request_id: str, tracked: RequestState, finish_reason: str | None, stop_reason: int | str | None, now: float
    ) -> RequestOutput | None:
        """The request's output for this step per its ``output_kind`` (a FINAL_ONLY request's
        only when it finishes: ``process_outputs`` skips the others); None when a DELTA has nothing new."""
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

    def _visible_text(self, tracked: RequestState, finished: bool) -> str:
        """The text a client may see now: cut at a stop string, less what is held back (NOTE 2)."""
        if tracked.detokenizer is None:  # decoded once, at the end (NOTE 1)
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
