"""StructuredOutputManager: compile grammars off the step's thread, and build each step's bitmask.

Concept: the engine's half of structured outputs. ``grammar_init`` starts a request's compile on
the manager's thread (the request waits as ``WAITING_FOR_FSM``, ``core/scheduler.py`` NOTE 6);
``grammar_bitmask`` fills, after ``schedule()``, one mask row per sampled position of every
scheduled constrained request; ``advance`` feeds each request's new tokens to its matcher after
the step; ``trim_drafts`` keeps only the drafts the grammar allows.

Mirrors: ``vllm/v1/structured_output/__init__.py`` (``StructuredOutputManager``: ``grammar_init``,
``grammar_bitmask``, ``should_fill_bitmask``, ``should_advance``) and the scheduler's
``get_grammar_bitmask``.

Invariants: between steps every ready matcher has accepted exactly the request's output tokens
after its think section (NOTE 4); a bitmask row's drafts are rolled back before it returns.

NOTE 1 (off the step's thread): a compile takes milliseconds to seconds for a large schema and
vocabulary; the step loop must not wait on it. One worker thread compiles (xgrammar releases the
GIL while it works); a request is scheduled like any other once its compile is done.
NOTE 2 (the cache): compiles are kept by ``StructuredOutputsParams.key`` (kind, spec, whitespace
flag), least recently used first out, as ``Future``s, so requests with one schema share one compile
even while it runs; each request gets its own matcher (the state) over the shared grammar.
NOTE 3 (drafts): a request verifying k drafts gets k + 1 rows: row i is the mask after drafts
0..i-1, made by accepting them in turn and rolling all of them back after; drafts the grammar
refuses were cut when they were proposed (``trim_drafts``), except under NOTE 8.
NOTE 4 (think sections, ``enable_in_reasoning=False``): a request whose prompt leaves a think
section open (the last start sequence after the last end one) is not constrained until the
model closes it: its rows allow every token and its matcher skips the tokens up to and with the
end sequence. vLLM's reasoning parsers treat a prompt with neither sequence as still thinking;
here it is constrained from the first token, since a model without a think section never closes one.
NOTE 5 (no constraint, no cost): a step with no constrained request builds nothing and its
``SchedulerOutput`` carries no mask.
NOTE 6 (after the stop token): a matcher that accepted its stop token is terminated; a request
that runs on (``ignore_eos``) is unconstrained from there, as in vLLM.
NOTE 7 (async scheduling): a row's mask needs every token before it in the matcher, and under
async scheduling the step before may still hold one on the device. So the engine launches such a
step's forward alone, reads the step before back (the matchers take its tokens), makes the mask,
then has it sampled (``engine/llm_engine.py`` NOTE 10; vLLM's ``execute_model`` / ``sample_tokens``):
the forward still overlaps the host's work, and the tokens are the synchronous engine's.
NOTE 8 (drafts nobody cut, async scheduling with speculative decoding): the runner proposed
them when it launched the step (``core/sched_output.py`` NOTE 5). The first draft the grammar
refuses has a row that refuses it, so the verification rejects it there (a seeded row draws
by position: the token is the one the synchronous engine's bonus row drew); the rows after it
are never read and allow every token. It, those after it and the placeholders the runner left
are ``num_invalid_spec_tokens``. Past a stop token (NOTE 6) nothing is refused.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tinyvllm.config import ReasoningConfig, StructuredOutputsConfig
from tinyvllm.core.sched_output import DRAFT_PLACEHOLDER, SchedulerOutput
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.structured_output import backend_xgrammar
from tinyvllm.structured_output.request import StructuredOutputRequest

MAX_CACHED_GRAMMARS = 256  # NOTE 2


def find_last(tokens: Sequence[int], seq: Sequence[int], end: int | None = None) -> int:
    """Where the last occurrence of ``seq`` in ``tokens[:end]`` ends (one past it), or -1."""
    end = len(tokens) if end is None else end
    n = len(seq)
    for stop in range(end, n - 1, -1):
        if list(tokens[stop - n : stop]) == list(seq):
            return stop
    return -1


def think_section_open(tokens: Sequence[int], start_ids: Sequence[int], end_ids: Sequence[int]) -> bool:
    """NOTE 4: the last start sequence comes after the last end sequence."""
    if not start_ids or not end_ids:
        return False
    return find_last(tokens, start_ids) > find_last(tokens, end_ids)


class StructuredOutputManager:
    """Grammars of the engine's constrained requests (see the module header)."""

    def __init__(
        self, config: StructuredOutputsConfig, tokenizer, vocab_size: int | None,
        eos_token_ids: Sequence[int] = (), reasoning_config: ReasoningConfig | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.reasoning_config = reasoning_config
        self._backend: backend_xgrammar.XgrammarBackend | None = None  # built at the first constrained request
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()  # NOTE 2
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown on demand

    # -- requests in -------------------------------------------------------------------

    @property
    def in_use(self) -> bool:
        """Whether any request has asked for a constraint yet (NOTE 5: until then, nothing to do)."""
        return self._backend is not None

    @property
    def backend(self) -> backend_xgrammar.XgrammarBackend:
        if self._backend is None:
            self._backend = backend_xgrammar.XgrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._backend

    # --8<-- [start:compile]
    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compile of ``params``' grammar, started now or found in the cache (NOTE 1, NOTE 2)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyvllm-grammar")
        backend = self.backend
        future = self._executor.submit(backend.compile, params)
        self._cache[key] = future
        while len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return future

    def grammar_init(self, request: Request) -> None:
        """Start ``request``'s compile; it waits as ``WAITING_FOR_FSM`` until it is done."""
        params = request.sampling_params.structured_outputs
        assert params is not None and request.status == RequestStatus.WAITING, f"{request!r}"
        future = self.compile(params)
        request.structured_output_request = StructuredOutputRequest(params, future, self.backend.matcher)
        request.status = RequestStatus.WAITING_FOR_FSM
    # --8<-- [end:compile]

    # -- one step ----------------------------------------------------------------------

    def should_fill_bitmask(self, request: Request) -> bool:
        """NOTE 4: whether the request's grammar applies now (not inside a think section)."""
        so = request.structured_output_request
        if so.reasoning_ended is None:
            rc = self.reasoning_config
            in_think = rc is not None and not self.config.enable_in_reasoning and think_section_open(
                request.prompt_token_ids, rc.reasoning_start_token_ids, rc.reasoning_end_token_ids
            )  # fmt: skip
            so.reasoning_ended = not in_think
        return so.reasoning_ended

    # --8<-- [start:grammar_bitmask]
    def grammar_bitmask(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> SchedulerOutput:
        """The step with its bitmask: one row per sampled position of each scheduled
        constrained request (NOTE 3); the step unchanged when none is (NOTE 5)."""
        if not self.in_use:  # NOTE 5
            return scheduler_output
        constrained = [rid for rid in scheduler_output.num_scheduled_tokens
                       if (r := requests.get(rid)) is not None and r.use_structured_output]  # fmt: skip
        if not constrained:
            return scheduler_output
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_rows = sum(1 + len(spec.get(rid, ())) for rid in constrained)
        bitmask = self._bitmask_rows(num_rows)  # [G, W]
        first_row: dict[str, int] = {}
        invalid: dict[str, int] = {}  # NOTE 8
        row = 0
        for rid in constrained:
            request = requests[rid]
            so, first_row[rid] = request.structured_output_request, row
            drafts = spec.get(rid, ())
            if so.grammar is None:  # a failed compile (request.py NOTE 1): nothing is allowed
                bitmask[row : row + len(drafts) + 1] = 0
            elif not self.should_fill_bitmask(request):  # NOTE 4: thinking, every token allowed
                bitmask[row : row + len(drafts) + 1] = -1
            else:
                num_valid = self._fill_rows(so.grammar, drafts, bitmask, row)
                if num_valid < len(drafts):
                    invalid[rid] = len(drafts) - num_valid
            row += len(drafts) + 1
        return dataclasses.replace(
            scheduler_output, structured_output_request_ids=first_row, grammar_bitmask=bitmask[:num_rows].numpy().copy(),
            num_invalid_spec_tokens=invalid,
        )  # fmt: skip

    @staticmethod
    def _fill_rows(grammar, drafts: Sequence[int], bitmask: torch.Tensor, row: int) -> int:
        """NOTE 3: rows ``row .. row + len(drafts)``, row i the mask after drafts 0 .. i-1; the
        drafts are rolled back after. Returns how many drafts come before the first one the
        grammar refuses or a placeholder (NOTE 8); the rows after it are never read."""
        accepted, num_valid = 0, len(drafts)
        for i, draft in enumerate((*drafts, None)):
            if i > num_valid:
                bitmask[row + i] = -1  # NOTE 8: past a refused draft
            elif grammar.is_terminated():  # NOTE 6: past its stop token, nothing to constrain
                bitmask[row + i] = -1
            else:
                grammar.fill_bitmask(bitmask, row + i)
                if draft is None:
                    continue
                if draft != DRAFT_PLACEHOLDER and grammar.accept_tokens([draft]):
                    accepted += 1
                else:
                    num_valid = i  # refused (or not proposed): its row refuses it
        if accepted:
            grammar.rollback(accepted)
        return num_valid
    # --8<-- [end:grammar_bitmask]

    def _bitmask_rows(self, num_rows: int) -> torch.Tensor:
        width = -(-self.vocab_size // 32)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.full((max(num_rows, 64), width), -1, dtype=torch.int32)
        return self._bitmask

    # -- after the step ------------------------------------------------------------------

    # --8<-- [start:advance]
    def advance(self, request: Request, new_token_ids: Sequence[int]) -> None:
        """Feed ``request``'s new tokens to its matcher; inside a think section, only those
        after the sequence that closes it (NOTE 4)."""
        so = request.structured_output_request
        if so is None or so.grammar is None or not new_token_ids:
            return
        tokens = list(new_token_ids)
        so.num_unconstrained_tokens += len(tokens)  # until the matcher takes them, below
        if not self.should_fill_bitmask(request):
            end_ids = self.reasoning_config.reasoning_end_token_ids
            first_new = request.num_tokens - len(tokens)
            closed_at = find_last(request.all_token_ids, end_ids)
            if closed_at <= first_new:
                return  # still thinking: no end sequence ends among the new tokens
            so.reasoning_ended = True
            tokens = tokens[closed_at - first_new :]
        if so.grammar.is_terminated():
            return  # it took its stop token; what follows (ignore_eos) stays unconstrained
        so.num_unconstrained_tokens -= len(tokens)
        if not so.grammar.accept_tokens(tokens):
            so.grammar, so.error = None, f"the grammar refused a sampled token of {tokens}"  # its next rows allow nothing
    # --8<-- [end:advance]

    def trim_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts to verify: those the grammar allows, in order (NOTE 3)."""
        so = request.structured_output_request
        if so is None or not drafts or not so.is_grammar_ready() or so.grammar is None:
            return drafts
        if not self.should_fill_bitmask(request):
            return drafts
        return so.grammar.validate_tokens(drafts)

    # -- lifetime --------------------------------------------------------------------------

    def num_cached_grammars(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        """Stop the compile thread (a compile in progress finishes; nothing waits on it)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def check_invariants(self, requests: Iterable[Request] = ()) -> None:
        """The cache's bound, and each unfinished request's matcher against its output tokens."""
        assert len(self._cache) <= MAX_CACHED_GRAMMARS, f"{len(self._cache)} cached grammars"
        for request in requests:
            so = request.structured_output_request
            if so is None or so.grammar is None:
                continue
            fed = so.grammar.num_processed_tokens + so.num_unconstrained_tokens
            assert fed == request.num_output_tokens, f"{request!r}: its matcher took {fed} of {request.num_output_tokens} tokens"
