# --8<-- [start:header]
"""The persistent input batch: one row per running request, kept compact step to step.

Concept: requests keep their row across steps, so per-row state (sampling tensors, logits
processors' state) changes only where the batch changes. Each step the model runner calls
``remove_request`` for finished requests (their rows become holes), ``add_request`` for
new ones (the lowest hole first, else a new row at the end), ``condense()`` (the highest
live rows move down into the remaining holes: UNIDIRECTIONAL moves), optionally
``swap_states``, then ``refresh()``, which freezes the step's changes into one
``BatchUpdate`` and hands it to every logits processor and to the thinking-budget holder,
and finally ``make_sampling_metadata()``, the frozen view of rows ``0 .. num_reqs - 1``
that the sampler reads (the sampler never sees this class).

Seed: 001 appendix U2 (the builder and the input batch), ch. 7.3 (live output lists).
Mirrors: ``vllm/v1/worker/gpu_input_batch.py`` (``InputBatch``: ``add_request``,
``remove_request``, ``swap_states``, ``condense``, ``refresh_metadata``).

Invariants (``check_invariants``): after ``condense`` rows ``0 .. num_reqs - 1`` are live
and nothing lies beyond; ``req_id_to_index`` and ``req_ids`` agree; each live row's
``temperature``/``top_p``/``top_k`` equal its request's params; a row has a seed exactly
when its request has one; rows with no request hold the neutral values; a row has penalty
state exactly when its request uses a penalty, built from its own prompt and live output
list, and bad-word token ids exactly when its request has bad words (NOTE 7).

NOTE 1: within a step, every removal comes before the first addition: ``add_request``
reads the builder's holes, after which ``removed_append`` raises (ch. 8.3).
NOTE 2: MinTokens must hold back EOS as well as ``stop_token_ids`` (vLLM's
``all_stop_token_ids``): ``add_request(eos_token_id=...)`` hands the processors a copy of
the params with EOS appended to ``stop_token_ids`` unless ``ignore_eos``.
NOTE 3: with ``max_num_blocks_per_req`` the batch also keeps the persistent block table
(``worker/block_table.py``) in step with its rows: a row's ids are written when a request
enters it, moved by ``condense``, swapped by ``swap_states`` and cleared on removal.
NOTE 4: a seeded row carries only its request's seed: the sampler keys each draw by the
seed and the position of the token drawn (``sample/draw_keys.py``), so nothing about a
request's randomness needs to survive it leaving and re-entering the batch.
NOTE 5 (the sampling metadata is reused): in a run of decode steps the batch usually does
not change, and building ``SamplingMetadata`` costs about ten small tensor operations. So
``make_sampling_metadata`` hands out the record it built until a ``refresh()`` sees a change
(an addition, removal, move or swap), the only ways its values can change; the record is
frozen and its tensors are copies, so handing it out twice is safe.
NOTE 6 (every processor hears of every change): ``refresh`` gives the update to every
processor even when one raises, and raises the first error after. After a failed step
``reset`` removes every row in one update; a processor that raises there again must not
keep the others from dropping their rows, or they would apply a finished request's
masks to whatever request next takes its row.
NOTE 7 (penalties, allowed tokens, bad words): per-row state only for the requests that use
them. The penalties' prompt masks and output counts live in a ``PenaltyState``
(``sample/penalties.py``, its NOTE 2 on memory): rows enter it in ``add_request`` (counted
from the prompt and the whole output so far, so a preempted request comes back counted
right), move and swap with their rows, leave on removal and ``reset``, and ``refresh`` adds
each step's new tokens. Bad-word token ids (tokenized by the engine, ``sample/bad_words.py``
NOTE 1) move with the row like its seed. ``allowed_token_ids`` needs no state here: its
``[P, V]`` mask is built with the metadata (NOTE 5), so it costs nothing while the batch is
unchanged. Penalties and allowed ids need ``InputBatch(vocab_size=...)``.
NOTE 8 (no wait for the device): the metadata's flags (``all_greedy``, ``all_random``, the
top-k/top-p plan) are read from the batch's host tensors and the device copies made with
``upload`` (pinned, ``non_blocking``): building the metadata never waits for a forward still
running on the GPU (``tinyvllm/device_syncs.py``).
Left out: token-id buffers (the runner's ``InputBuffers``), LoRA, pooling.
"""
# --8<-- [end:header]

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import MappingProxyType

import torch

from tinyvllm.device_syncs import upload
from tinyvllm.outputs import LogprobEntry
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.sample.bad_words import BadWordsTokenIds
from tinyvllm.sample.batch_update import BatchUpdate, BatchUpdateBuilder, MoveDirectionality
from tinyvllm.sample.logits_processors.state import LogitsProcessors
from tinyvllm.sample.logprobs import num_top
from tinyvllm.sample.metadata import SamplingMetadata
from tinyvllm.sample.penalties import PenaltyState, uses_penalties
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder
from tinyvllm.sample.top_k_top_p import plan_top_k_top_p
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.block_table import BlockTable
from tinyvllm.worker.pooler import PoolingState


@dataclasses.dataclass(eq=False)
class RunnerRequestState:
    """The runner's copy of one request (it may live in another process in vLLM; vLLM's
    ``CachedRequestState``). Compared and hashed by identity: the runner's n-gram proposer keys
    its table rows by it (``spec_decode/token_table.py`` NOTE 1)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]  # the live list the logits processors read
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # its bad words, tokenized by the input processor
    # model_runner.py NOTE 8: position p holds the logprobs of prompt token p + 1; None until computed
    prompt_logprobs: list[LogprobEntry | None] | None = None
    prompt_logprobs_sent: bool = False
    pooling_params: PoolingParams | None = None  # model_runner.py NOTE 13
    pooling_state: PoolingState = dataclasses.field(default_factory=PoolingState)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + outputs, without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


class InputBatch:
    """The persistent batch of running requests (see the module header)."""

    def __init__(
        self,
        max_num_reqs: int,
        device: torch.device | str = "cpu",
        logitsprocs: LogitsProcessors | None = None,
        thinking_budget: ThinkingBudgetStateHolder | None = None,
        max_num_blocks_per_req: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be >= 1, got {max_num_reqs!r}")
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size  # None: penalties and allowed_token_ids are refused (NOTE 7)
        self.device = torch.device(device)
        self.logitsprocs = logitsprocs or LogitsProcessors()
        self.thinking_budget = thinking_budget
        self.batch_update_builder = BatchUpdateBuilder()
        self.req_ids: list[str | None] = []  # row -> request id (None: a hole)
        self.req_id_to_index: dict[str, int] = {}
        self.params: list[SamplingParams | None] = []
        self.output_token_ids: list[list[int] | None] = []  # row -> the request's live output list
        self.temperature = torch.ones(max_num_reqs, dtype=torch.float32)  # [R_max]
        self.top_p = torch.ones(max_num_reqs, dtype=torch.float32)  # [R_max]
        self.top_k = torch.zeros(max_num_reqs, dtype=torch.int64)  # [R_max], 0 = off
        self.seeds: dict[int, int] = {}  # row -> its request's seed (NOTE 4)
        self.num_logprobs: dict[int, int] = {}  # row -> its request's SamplingParams.logprobs, when set
        self.bad_words_token_ids: dict[int, BadWordsTokenIds] = {}  # row -> its bad words' token ids (NOTE 7)
        self.penalties = PenaltyState(max_num_reqs, vocab_size, self.device) if vocab_size else None  # NOTE 7
        self.block_table = (  # NOTE 3
            BlockTable(max_num_reqs, max_num_blocks_per_req) if max_num_blocks_per_req else None
        )
        self._sampling_metadata: SamplingMetadata | None = None  # NOTE 5: valid until the batch changes
        self.last_batch_update: BatchUpdate | None = None  # what the last refresh() handed out (tinyvllm.trace reads it)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    # --8<-- [start:add_remove]
    def add_request(
        self,
        req_id: str,
        params: SamplingParams,
        prompt_token_ids: list[int] | None,
        output_token_ids: list[int],
        eos_token_id: int | None = None,
        block_ids: Sequence[int] = (),
        bad_words_token_ids: Sequence[Sequence[int]] = (),
    ) -> int:
        """Put a request into the lowest hole (or a new last row); return its row.

        A request with ``bad_words`` brings their token ids (NOTE 7).
        """
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} is already in the batch")
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"batch is full ({self.max_num_reqs} requests); cannot add {req_id!r}")
        bad_words = tuple(tuple(seq) for seq in bad_words_token_ids)
        if bool(params.bad_words) != bool(bad_words):
            raise ValueError(
                f"request {req_id!r}: bad_words={params.bad_words!r} with bad_words_token_ids={bad_words!r}: "
                "a request with bad words needs their token ids, and only such a request"
            )
        if self.vocab_size is None and (uses_penalties(params) or params.allowed_token_ids is not None or params.logprobs == -1):
            raise ValueError(
                f"request {req_id!r} uses penalties, allowed_token_ids or logprobs=-1, which need the batch's vocab_size"
            )
        row = self.batch_update_builder.pop_removed()  # NOTE 1
        if row is None:
            row = len(self.req_ids)
            self.req_ids.append(None)
            self.params.append(None)
            self.output_token_ids.append(None)
        self.req_ids[row], self.req_id_to_index[req_id] = req_id, row
        self.params[row], self.output_token_ids[row] = params, output_token_ids
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        if params.seed is not None:
            self.seeds[row] = params.seed
        if params.logprobs is not None:  # -1: the whole vocabulary (SamplingParams NOTE 6)
            self.num_logprobs[row] = num_top(params.logprobs, self.vocab_size)
        if bad_words:
            self.bad_words_token_ids[row] = bad_words
        if self.penalties is not None and uses_penalties(params):
            self.penalties.add_row(row, params, prompt_token_ids or (), output_token_ids)
        if self.block_table is not None:
            self.block_table.add_row(row, block_ids)
        self.batch_update_builder.added.append(
            (row, _params_for_processors(params, eos_token_id), prompt_token_ids, output_token_ids)
        )
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Take a request out; its row becomes a hole. Returns the row (None if unknown)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._clear_row(row)
        self.batch_update_builder.removed_append(row)
        return row
    # --8<-- [end:add_remove]

    def _clear_row(self, row: int) -> None:
        self.req_ids[row] = None
        self.params[row] = None
        self.output_token_ids[row] = None
        self.temperature[row], self.top_p[row], self.top_k[row] = 1.0, 1.0, 0
        self.seeds.pop(row, None)
        self.num_logprobs.pop(row, None)
        self.bad_words_token_ids.pop(row, None)
        if self.penalties is not None:
            self.penalties.clear_row(row)
        if self.block_table is not None:
            self.block_table.clear_row(row)

    # --8<-- [start:condense]
    def condense(self) -> None:
        """Move the highest live rows into the remaining holes (UNIDIRECTIONAL moves)."""
        holes = sorted(self.batch_update_builder.removed)  # lowest first
        last = len(self.req_ids) - 1
        for hole in holes:
            while last >= 0 and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            self.batch_update_builder.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        del self.req_ids[self.num_reqs :], self.params[self.num_reqs :], self.output_token_ids[self.num_reqs :]

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange two live rows (recorded as a SWAP)."""
        for index in (i1, i2):
            if not 0 <= index < len(self.req_ids) or self.req_ids[index] is None:
                raise ValueError(f"swap_states: row {index} holds no request")
        for seq in (self.req_ids, self.params, self.output_token_ids):
            seq[i1], seq[i2] = seq[i2], seq[i1]
        for tensor in (self.temperature, self.top_p, self.top_k):
            tensor[[i1, i2]] = tensor[[i2, i1]]
        for per_row in (self.seeds, self.num_logprobs, self.bad_words_token_ids):
            v1, v2 = per_row.pop(i1, None), per_row.pop(i2, None)
            if v1 is not None:
                per_row[i2] = v1
            if v2 is not None:
                per_row[i1] = v2
        self.req_id_to_index[self.req_ids[i1]] = i1
        self.req_id_to_index[self.req_ids[i2]] = i2
        if self.penalties is not None:
            self.penalties.swap_rows(i1, i2)
        if self.block_table is not None:
            self.block_table.swap_rows(i1, i2)
        self.batch_update_builder.moved.append((i1, i2, MoveDirectionality.SWAP))
        self.batch_update_builder.batch_changed = True
    # --8<-- [end:condense]

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None and self.req_ids[dst] is None, f"move {src} -> {dst} needs a live source and a hole"
        self.req_ids[dst], self.params[dst], self.output_token_ids[dst] = req_id, self.params[src], self.output_token_ids[src]
        self.temperature[dst], self.top_p[dst], self.top_k[dst] = self.temperature[src], self.top_p[src], self.top_k[src]
        for per_row in (self.seeds, self.num_logprobs, self.bad_words_token_ids):
            value = per_row.pop(src, None)
            if value is not None:
                per_row[dst] = value
        if self.penalties is not None:
            self.penalties.move_row(src, dst)
        if self.block_table is not None:
            self.block_table.move_row(src, dst)
        self.req_id_to_index[req_id] = dst
        self._clear_row(src)

    def reset(self) -> None:
        """Empty the batch after a failed step, whatever state the step left it in: every
        row is removed in one fresh ``BatchUpdate``, so the processors drop all their rows."""
        self.batch_update_builder = BatchUpdateBuilder()  # forget half-recorded changes
        for row in range(len(self.req_ids)):
            self._clear_row(row)
            self.batch_update_builder.removed_append(row)
        self.req_ids, self.params, self.output_token_ids = [], [], []
        self.req_id_to_index.clear()
        self._sampling_metadata = None
        self.refresh()

    # --8<-- [start:refresh]
    def refresh(self, spec_token_ids: Sequence[Sequence[int]] | None = None) -> BatchUpdate | None:
        """Hand this step's BatchUpdate (None: no change) to the processors and the thinking budget.

        Call it every step, changed or not: MinTokens and the thinking budget re-read the
        live output lists here. ``spec_token_ids`` (speculative decoding): each row's drafts
        of this step, which the thinking budget plans its forcing on.
        """
        if any(req_id is None for req_id in self.req_ids):
            raise RuntimeError(f"rows {[i for i, r in enumerate(self.req_ids) if r is None]} are holes: call condense() first")
        batch_update = self.last_batch_update = self.batch_update_builder.get_and_reset(self.num_reqs)
        if batch_update is not None:
            self._sampling_metadata = None  # NOTE 5
        if self.penalties is not None:
            self.penalties.count_new_tokens()  # the tokens sampled last step (NOTE 7)
        self._hand_over(batch_update, spec_token_ids)
        return batch_update
    # --8<-- [end:refresh]

    def _hand_over(
        self, batch_update: BatchUpdate | None, spec_token_ids: Sequence[Sequence[int]] | None = None
    ) -> None:
        """Give the update to every processor and the thinking budget, even when one of
        them raises (NOTE 6); then raise the first error."""
        receivers = [proc.update_state for proc in self.logitsprocs.all]
        if self.thinking_budget is not None:
            receivers.append(lambda update: self._update_thinking_budget(update, spec_token_ids))
        first: Exception | None = None
        for receive in receivers:
            try:
                receive(batch_update)
            except Exception as error:
                first = first or error
        if first is not None:
            raise first

    def _update_thinking_budget(
        self, batch_update: BatchUpdate | None, drafts: Sequence[Sequence[int]] | None
    ) -> None:
        self.thinking_budget.sync_batch(batch_update)
        if not drafts:
            self.thinking_budget.update_state(self.output_token_ids)
            return
        # The holder reads each row's outputs followed by its drafts (seed 001 ch. 13).
        with_drafts = [list(out) + list(d) if d else out for out, d in zip(self.output_token_ids, drafts)]
        self.thinking_budget.update_state(with_drafts, spec_token_ids=drafts)

    # --8<-- [start:sampling_metadata]
    def make_sampling_metadata(self) -> SamplingMetadata:
        """Freeze rows ``0 .. num_reqs - 1`` into the sampler's view of this step.

        Call it after ``refresh()``: the processors and the thinking budget it hands over
        must already know this step's batch. Tensors are copies (on ``self.device``), so
        later edits of the batch cannot change a metadata already built; the penalty state
        and the output lists are the batch's own objects, which grow step by step. A step whose ``refresh()``
        found no change gets the previous step's record back (NOTE 5).
        """
        holes = [i for i, r in enumerate(self.req_ids) if r is None]
        if holes:
            raise RuntimeError(f"rows {holes} are holes: call condense() and refresh() first")
        builder = self.batch_update_builder
        if builder.has_removed() or builder.added or builder.moved or builder.batch_changed:
            raise RuntimeError("the batch changed since the last refresh(): call refresh() first")
        if self._sampling_metadata is not None:
            return self._sampling_metadata
        n = self.num_reqs
        # Decided on the host values, copied up without a wait (NOTE 8).
        temperature, top_p, top_k = self.temperature[:n], self.top_p[:n], self.top_k[:n]  # [R] each, host
        is_greedy = (temperature == 0).tolist()
        allowed_rows, allowed_mask = self._allowed_token_ids_mask()  # [P], [P, V]; None, None: no row restricts
        self._sampling_metadata = SamplingMetadata(
            temperature=upload(temperature, torch.float32, self.device),
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            # None when no row needs them: the sampler then skips the sort over V.
            top_p=upload(top_p, torch.float32, self.device) if bool((top_p < 1).any()) else None,
            top_k=upload(top_k, torch.int64, self.device) if bool((top_k > 0).any()) else None,
            top_k_top_p_plan=plan_top_k_top_p(top_k.tolist(), top_p.tolist()),
            seeds=MappingProxyType(dict(self.seeds)),
            num_logprobs=MappingProxyType(dict(self.num_logprobs)),
            logitsprocs=self.logitsprocs,
            thinking_budget=self.thinking_budget,
            penalties=self.penalties if self.penalties is not None and self.penalties.rows else None,
            allowed_token_ids_rows=allowed_rows,
            allowed_token_ids_mask=allowed_mask,
            bad_words_token_ids=MappingProxyType(dict(self.bad_words_token_ids)),
            output_token_ids=tuple(self.output_token_ids),
        )
        return self._sampling_metadata

    def _allowed_token_ids_mask(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows whose request has ``allowed_token_ids`` ``[P]`` and their masks ``[P, V]``,
        True where a token is not allowed (NOTE 7); ``(None, None)`` when no row has any."""
        rows = [row for row, params in enumerate(self.params) if params.allowed_token_ids is not None]
        if not rows:
            return None, None
        mask = torch.ones(len(rows), self.vocab_size, dtype=torch.bool)  # [P, V]
        for i, row in enumerate(rows):
            mask[i, list(self.params[row].allowed_token_ids)] = False
        return upload(rows, torch.int64, self.device), upload(mask, torch.bool, self.device)
    # --8<-- [end:sampling_metadata]

    def _check_cached_metadata(self) -> None:
        """A metadata record handed out again (NOTE 5) still says, in its host copies, what
        the rows' host values say (NOTE 8); a record the next refresh will drop is not checked."""
        md, builder = self._sampling_metadata, self.batch_update_builder
        if md is None or builder.has_removed() or builder.added or builder.moved or builder.batch_changed:
            return
        n = self.num_reqs
        greedy = (self.temperature[:n] == 0).tolist()
        flags = (all(greedy), not any(greedy))
        assert (md.all_greedy, md.all_random) == flags, f"cached all_greedy, all_random {(md.all_greedy, md.all_random)} != rows {flags}"
        if md.top_k is not None or md.top_p is not None:
            plan = plan_top_k_top_p(self.top_k[:n].tolist(), self.top_p[:n].tolist())
            assert md.top_k_top_p_plan == plan, f"cached plan {md.top_k_top_p_plan} != rows {plan}"

    def check_invariants(self) -> None:
        assert len(self.req_ids) == len(self.params) == len(self.output_token_ids), "row lists differ in length"
        for req_id, row in self.req_id_to_index.items():
            assert self.req_ids[row] == req_id, f"request {req_id!r} maps to row {row} holding {self.req_ids[row]!r}"
        for row in range(self.max_num_reqs):
            params = self.params[row] if row < len(self.params) else None
            expected = (params.temperature, params.top_p, params.top_k) if params else (1.0, 1.0, 0)
            got = (self.temperature[row].item(), self.top_p[row].item(), self.top_k[row].item())
            assert got == tuple(torch.tensor(expected[:2]).tolist()) + (expected[2],), f"row {row}: tensors {got} != params {expected}"
            seed = params.seed if params is not None else None
            assert self.seeds.get(row) == seed, f"row {row}: seed {self.seeds.get(row)}, params' seed {seed}"
            wants = params.logprobs if params is not None else None
            assert self.num_logprobs.get(row) == wants, f"row {row}: num_logprobs {self.num_logprobs.get(row)}, params {wants}"
            has_bad = params is not None and bool(params.bad_words)
            assert (row in self.bad_words_token_ids) == has_bad, f"row {row}: bad-word ids {row in self.bad_words_token_ids}, bad_words {has_bad}"
        if self.penalties is not None:  # NOTE 7
            self.penalties.check_invariants()
            wanted = {row for row, params in enumerate(self.params) if params is not None and uses_penalties(params)}
            assert set(self.penalties.rows) == wanted, f"rows with penalty state {sorted(self.penalties.rows)} != rows using penalties {sorted(wanted)}"
            for row, entry in self.penalties.rows.items():
                params = self.params[row]
                assert entry.output_token_ids is self.output_token_ids[row], f"row {row}: penalty state reads another output list"
                got = (entry.presence, entry.frequency, entry.repetition)
                want = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
                assert got == want, f"row {row}: penalty state {got} != params {want}"
        self._check_cached_metadata()
        if self.block_table is not None:
            self.block_table.check_invariants()
            live = {row for row, req_id in enumerate(self.req_ids) if req_id is not None}
            empty = [r for r in range(self.max_num_reqs) if r not in live and self.block_table.num_blocks[r]]
            assert not empty, f"rows {empty} hold no request but have block ids"


def _params_for_processors(params: SamplingParams, eos_token_id: int | None) -> SamplingParams:
    """The params the processors see: EOS joins the stop tokens (NOTE 2)."""
    if eos_token_id is None or params.ignore_eos or eos_token_id in params.stop_token_ids:
        return params
    return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, eos_token_id))
