# --8<-- [start:header]
"""SamplingMetadata: everything the sampler may know about one step's batch, frozen.

Concept: the sampler needs, per row, a temperature, optional top-p / top-k limits and
(for seeded requests) the seed its draws are keyed by, plus the two stateful helpers that edit
logits (the logits processors and the thinking-budget holder), and, only for the rows
whose requests ask for them, the penalty state, the allowed-token mask and the bad words
with the output lists they are checked against. This frozen record carries exactly that
from the worker to the sampler, and nothing else.

Seed: 001 ch. 9.2 (the sampler's order of operations reads these fields), ch. 13.9 (the
thinking budget forces tokens inside the sampler).
Mirrors: ``vllm/v1/sample/metadata.py`` (``SamplingMetadata``); vLLM builds it in
``InputBatch._make_sampling_metadata`` (``vllm/v1/worker/gpu_input_batch.py``), ours is
``InputBatch.make_sampling_metadata``.

Invariants:
- every per-row tensor has ``num_reqs`` rows, row ``i`` being row ``i`` of the logits;
- ``all_greedy`` is True exactly when every temperature is 0, ``all_random`` exactly when
  none is (both hold only for an empty batch);
- ``top_p`` is None exactly when no row has ``top_p < 1``, ``top_k`` exactly when no row
  has ``top_k > 0``: a None tells the sampler to skip the sort over the vocabulary;
- ``seeds`` and ``num_logprobs`` are read-only views; their keys are rows ``< num_reqs``;
- ``penalties`` is None exactly when no row uses a penalty (vLLM's ``no_penalties``);
- ``allowed_token_ids_rows`` ``[P]`` and ``allowed_token_ids_mask`` ``[P, V]`` are both None
  (no row restricts its tokens) or both set, one mask row per listed batch row;
- ``bad_words_token_ids`` is a read-only view whose keys are rows ``< num_reqs``, and
  ``output_token_ids`` holds every row's output so far (or nothing, when no row has
  bad words and no row is seeded);
- ``rows_per_request`` is None (one row per request) or sums to ``num_reqs`` (``expand``).

NOTE 1 (why it exists): the sampler knows nothing of the worker. The persistent
``InputBatch`` builds this record after ``refresh()`` has handed the step's
``BatchUpdate`` to the processors (and hands the same record out again while the batch
does not change), so ``sample/`` never imports ``worker/``.
NOTE 2 (frozen at the top level only): the fields cannot be reassigned, but the logits
processors and the thinking-budget holder are live, stateful objects shared with the
batch. So are the penalty state (its counts grow by each step's tokens,
``sample/penalties.py`` NOTE 1) and the output lists (bad words read their ends; a seeded
row's draw is keyed by their length, ``draw_keys``): a record handed out again for an
unchanged batch sees the newest tokens.
NOTE 3 (host copies of device values): ``all_greedy``, ``all_random`` and
``top_k_top_p_plan`` (which rows top-k and top-p touch, ``sample/top_k_top_p.py``) say on the
host what the device tensors hold, so that the sampler picks its path without reading the
device (``tinyvllm/device_syncs.py``); the input batch builds them from its host values.
Built without a plan, the record reads the device once.
NOTE 4 (one record per row, vLLM's ``expand_batch_to_tokens`` idea): a request verifying k
drafts owns k + 1 rows of logits, and row j samples the token after drafts ``0 .. j - 1``.
``expand(drafts)`` spreads every per-request value over the request's rows once per step:
temperature, top-k, top-p, seed, allowed ids, bad words and penalties are the request's,
the top-k/top-p plan names each row, and row j's output so far is the outputs plus the
drafts before it (bad words, penalties, and the position its draw is keyed by). MinTokens
and the thinking budget read ``rows_per_request``. So draft rows and plain rows take the
same ``Sampler`` steps; a step without drafts is its own expansion (the record itself).
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from tinyvllm.arith import spec_row_starts
from tinyvllm.device_syncs import upload
from tinyvllm.sample.bad_words import BadWordsTokenIds
from tinyvllm.sample.draw_keys import draw_key
from tinyvllm.sample.logits_processors.state import LogitsProcessors
from tinyvllm.sample.penalties import PenaltyRows, PenaltyState
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder
from tinyvllm.sample.top_k_top_p import TopKTopPPlan, plan_top_k_top_p


# --8<-- [start:metadata]
@dataclass(frozen=True, eq=False)
class SamplingMetadata:
    """The sampler's read-only view of one step's batch (see the module header)."""

    temperature: torch.Tensor  # [R] float32, 0 = greedy
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [R] float32; None when no row uses top-p (1.0 = off)
    top_k: torch.Tensor | None  # [R] int64; None when no row uses top-k (0 = off)
    seeds: Mapping[int, int]  # row -> its request's seed (seeded requests); draws keyed by it (draw_keys)
    logitsprocs: LogitsProcessors
    thinking_budget: ThinkingBudgetStateHolder | None
    # row -> k, for the rows whose request asked for logprobs (``sample/logprobs.py``); empty: none did
    num_logprobs: Mapping[int, int] = field(default_factory=dict)
    # None: no row uses a penalty, the sampler skips them; PenaltyRows: a record from expand()
    penalties: PenaltyState | PenaltyRows | None = None
    allowed_token_ids_rows: torch.Tensor | None = None  # [P] int64: the rows that restrict their tokens
    allowed_token_ids_mask: torch.Tensor | None = None  # [P, V] bool, True = not allowed
    bad_words_token_ids: Mapping[int, BadWordsTokenIds] = field(default_factory=dict)  # row -> sequences
    output_token_ids: tuple[Sequence[int], ...] = ()  # row -> its output so far (the live list)
    # which rows top-k and top-p touch, on the host (NOTE 3); None: read from ``top_k``/``top_p``
    top_k_top_p_plan: TopKTopPPlan | None = None
    # request r's rows, back to back (NOTE 4); None: one row per request
    rows_per_request: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.temperature.dim() != 1:
            raise ValueError(f"temperature must have shape [R], got {tuple(self.temperature.shape)}")
        if self.top_k_top_p_plan is None and (self.top_k is not None or self.top_p is not None):
            top_k, top_p = (None if t is None else t.tolist() for t in (self.top_k, self.top_p))
            object.__setattr__(self, "top_k_top_p_plan", plan_top_k_top_p(top_k, top_p))
        for name in ("top_p", "top_k"):
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != (self.num_reqs,):
                raise ValueError(f"{name} must have shape [{self.num_reqs}], got {tuple(tensor.shape)}")
        for name in ("seeds", "num_logprobs", "bad_words_token_ids"):
            outside = sorted(row for row in getattr(self, name) if not 0 <= row < self.num_reqs)
            if outside:
                raise ValueError(f"{name} name rows {outside}, outside 0 .. {self.num_reqs - 1}")
        self._check_token_restrictions()
        for name in ("seeds", "num_logprobs", "bad_words_token_ids"):
            if not isinstance(getattr(self, name), MappingProxyType):
                # A private copy behind a read-only view: later edits of the caller's dict cannot leak in.
                object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def _check_token_restrictions(self) -> None:
        rows, mask = self.allowed_token_ids_rows, self.allowed_token_ids_mask
        if (rows is None) != (mask is None):
            raise ValueError("allowed_token_ids_rows and allowed_token_ids_mask must be both set or both None")
        if rows is not None and (rows.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rows.shape[0]):
            raise ValueError(
                f"allowed_token_ids_rows must be [P] and allowed_token_ids_mask [P, V], got "
                f"{tuple(rows.shape)} and {tuple(mask.shape)}"
            )
        if self.rows_per_request is not None and sum(self.rows_per_request) != self.num_reqs:
            raise ValueError(f"rows_per_request {list(self.rows_per_request)} do not add up to {self.num_reqs} rows")
        if (self.bad_words_token_ids or self.seeds) and len(self.output_token_ids) != self.num_reqs:
            raise ValueError(
                f"bad words and seeds need every row's output list: {len(self.output_token_ids)} lists for "
                f"{self.num_reqs} rows"
            )

    def draw_keys(self) -> dict[int, int]:
        """Row of the logits -> the key of its draw, for the seeded rows: the request's seed and
        the output position of the token the row samples, the length of its output so far
        (``sample/draw_keys.py``; a draft row's output so far ends with the drafts before it)."""
        return {row: draw_key(seed, len(self.output_token_ids[row])) for row, seed in self.seeds.items()}

    @property
    def no_penalties(self) -> bool:
        """True when no row uses a penalty (vLLM's flag of the same name)."""
        return self.penalties is None

    @property
    def num_reqs(self) -> int:
        """R: the number of rows of the logits this step, one per request (or, in a record from
        ``expand``, ``sum(rows_per_request)``)."""
        return self.temperature.shape[0]
# --8<-- [end:metadata]

    # --8<-- [start:expand]
    def expand(self, drafts: Sequence[Sequence[int]]) -> SamplingMetadata:
        """The record of a speculative step's rows (NOTE 4): request r owns ``len(drafts[r]) + 1``
        rows of the logits, back to back, and its row j samples the token after drafts
        ``0 .. j - 1``. A step without drafts gets this record back, unchanged. No value is
        read from the device: indices go up with ``upload``, per-request tensors are spread
        by ``repeat_interleave`` with a known size. The rows ask for no logprobs: those of a
        speculative step are the kept rows', taken after the rejection (``model_runner.py``)."""
        if len(drafts) != self.num_reqs:
            raise ValueError(f"drafts for {len(drafts)} requests, the sampling metadata has {self.num_reqs}")
        if not any(drafts):
            return self
        assert not self.logitsprocs.argmax_invariant, "only MinTokens is built under speculative decoding"
        starts = spec_row_starts(drafts)  # request r's rows: starts[r] .. starts[r + 1] - 1
        num_rows = starts[-1]
        repeat = upload([len(d) + 1 for d in drafts], torch.int64, self.temperature.device)  # [R]

        def per_row(values: torch.Tensor | None) -> torch.Tensor | None:  # [R, ...] -> [N, ...]
            return None if values is None else values.repeat_interleave(repeat, dim=0, output_size=num_rows)

        def rows_of(requests) -> Iterator[tuple[int, int, int]]:  # (row, its request, its j)
            return ((starts[r] + j, r, j) for r in requests for j in range(len(drafts[r]) + 1))

        allowed_rows, allowed_mask = None, None
        if self.allowed_token_ids_mask is not None:  # every row gets its request's mask row (all False: none)
            mask = self.allowed_token_ids_mask
            full = torch.zeros(self.num_reqs, mask.shape[1], dtype=torch.bool, device=mask.device)  # [R, V]
            full[self.allowed_token_ids_rows] = mask
            allowed_rows, allowed_mask = torch.arange(num_rows, device=mask.device), per_row(full)  # [N], [N, V]
        plan = self.top_k_top_p_plan
        if plan is not None:
            plan = TopKTopPPlan(
                tuple(row for row, _, _ in rows_of(plan.top_k_rows)),
                tuple(row for row, _, _ in rows_of(plan.top_p_rows)),
                plan.max_top_k,
            )
        outputs = self.output_token_ids
        return SamplingMetadata(
            temperature=per_row(self.temperature),
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_p=per_row(self.top_p),
            top_k=per_row(self.top_k),
            seeds={row: self.seeds[r] for row, r, _ in rows_of(self.seeds)},
            logitsprocs=self.logitsprocs,
            thinking_budget=self.thinking_budget,
            penalties=None if self.penalties is None else self.penalties.expand(drafts),
            allowed_token_ids_rows=allowed_rows,
            allowed_token_ids_mask=allowed_mask,
            bad_words_token_ids={row: self.bad_words_token_ids[r] for row, r, _ in rows_of(self.bad_words_token_ids)},
            output_token_ids=tuple(
                OutputWithDrafts(outputs[r], drafts[r][:j]) if j else outputs[r] for _, r, j in rows_of(range(len(drafts)))
            ) if outputs else (),
            top_k_top_p_plan=plan,
            rows_per_request=tuple(len(d) + 1 for d in drafts),
        )  # fmt: skip
    # --8<-- [end:expand]


class OutputWithDrafts(Sequence[int]):
    """A draft row's output so far: the request's live output list, then the drafts before
    the row (NOTE 4), read in place: a step copies no output list."""

    __slots__ = ("output", "drafts")

    def __init__(self, output: Sequence[int], drafts: Sequence[int]) -> None:
        self.output, self.drafts = output, drafts

    def __len__(self) -> int:
        return len(self.output) + len(self.drafts)

    def __getitem__(self, index: int | slice) -> int | list[int]:  # a slice gives a list
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside an output of {len(self)} tokens")
        n = len(self.output)
        return self.output[index] if index < n else self.drafts[index - n]
