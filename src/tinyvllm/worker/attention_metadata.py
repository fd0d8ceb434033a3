"""Attention metadata: where each scheduled token sits, in the sequence and in the cache.

Concept: the scheduler hands the worker, per request, how many tokens are already computed
(``num_computed_tokens``), how many are scheduled this step (``num_scheduled_tokens``) and
the request's block ids. Attention needs the same facts token by token: each token's
position, its slot in the paged cache, where each request's queries start, each request's
sequence length and padded block table, and which rows produce logits. Small pure functions
compute each one from plain ints; ``build_step_inputs`` runs them all and pads the result
for a CUDA graph; ``build_attention_metadata`` packs it as fresh tensors into the frozen
``AttentionMetadata`` (the runner writes it into persistent buffers instead:
``worker/input_buffers.py``).

Follows: seed 003 "KV cache物理内存分配" (``_prepare_inputs`` builds ``attn_metadata`` and
``logits_indices``; attention reads them through the forward context); seed 000 "完整 CUDA
图捕获 & 热身" (a graph replays a fixed, padded batch shape).
Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``_prepare_inputs``) and
``vllm/v1/attention/backends/utils.py`` (``CommonAttentionMetadata``).

Invariants (property-tested): slots are unique across the batch and each lies inside its own
request's blocks; positions continue from ``num_computed_tokens``; ``query_start_loc`` is the
cumulative sum of ``num_scheduled_tokens``; ``logits_indices[r]`` is request r's last row.

NOTE 1 (padding convention): a CUDA graph replays a fixed token count, so the runner pads
the N real tokens to ``num_padded_tokens`` (the dispatcher's ``desc.num_tokens``: a capture
size under a graph, N itself in an eager step). Padding rows belong to no request: their
position is 0 (a valid rotary index), their slot is ``PAD_SLOT_ID`` (``write_kv_cache`` skips
them), ``query_start_loc[-1]`` stays N, and every attention backend writes zeros to its
output rows. A FULL graph also fixes the request count, so in a FULL step (and only there)
the runner pads the R requests to ``num_padded_reqs``: a padded request has no query rows
(its ``query_start_loc`` entry repeats N), ``seq_len`` 0, a block-table row of
``PAD_BLOCK_ID`` and a logits row that is never read. Block-table rows are padded with
``PAD_BLOCK_ID`` past a request's own blocks; the kernels never read those entries (they
stop at ``cdiv(seq_len, block_size)``).

Left out: speculative decoding, multimodal positions (M-RoPE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID
from tinyvllm.attention.metadata import AttentionMetadata  # the type lives with attention
from tinyvllm.arith import cdiv
from tinyvllm.worker.block_table import PAD_BLOCK_ID


def _check_batch(num_computed_tokens: Sequence[int], num_scheduled_tokens: Sequence[int]) -> None:
    if len(num_computed_tokens) != len(num_scheduled_tokens):
        raise ValueError(
            f"num_computed_tokens has {len(num_computed_tokens)} requests but "
            f"num_scheduled_tokens has {len(num_scheduled_tokens)}"
        )
    for r, (c, n) in enumerate(zip(num_computed_tokens, num_scheduled_tokens)):
        if c < 0:
            raise ValueError(f"num_computed_tokens[{r}] = {c} is negative")
        if n < 1:
            raise ValueError(f"num_scheduled_tokens[{r}] = {n}: every request in the batch needs >= 1 token")


# --8<-- [start:builders]
def compute_query_start_loc(num_scheduled_tokens: Sequence[int]) -> list[int]:
    """``[0, n0, n0+n1, ...]``: where each request's queries start (R+1 entries)."""
    return list(accumulate(num_scheduled_tokens, initial=0))


def compute_seq_lens(num_computed_tokens: Sequence[int], num_scheduled_tokens: Sequence[int]) -> list[int]:
    """Tokens in the cache for each request once this step's K/V are written."""
    return [c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens)]


def compute_positions(num_computed_tokens: Sequence[int], num_scheduled_tokens: Sequence[int]) -> list[int]:
    """Each scheduled token's position in its sequence: request r's tokens are
    ``num_computed_tokens[r], ..., num_computed_tokens[r] + num_scheduled_tokens[r] - 1``."""
    return [p for c, n in zip(num_computed_tokens, num_scheduled_tokens) for p in range(c, c + n)]


def slot_for_position(block_ids: Sequence[int], position: int, block_size: int) -> int:
    """The cache slot of one token: ``block_ids[position // S] * S + position % S``."""
    return block_ids[position // block_size] * block_size + position % block_size


def compute_slot_mapping(
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
) -> list[int]:
    """Each scheduled token's slot, through its own request's block ids."""
    slots = []
    for r, (ids, c, n) in enumerate(zip(block_ids, num_computed_tokens, num_scheduled_tokens)):
        if len(ids) * block_size < c + n:
            raise ValueError(
                f"request {r} has {len(ids)} blocks but {c + n} tokens need "
                f"{cdiv(c + n, block_size)} of size {block_size}"
            )
        for p in range(c, c + n):  # slot_for_position, inlined: this runs for every token of every step
            slots.append(ids[p // block_size] * block_size + p % block_size)
    return slots


def pad_block_table(block_ids: Sequence[Sequence[int]], max_num_blocks: int) -> list[list[int]]:
    """Rows of block ids, each padded with ``PAD_BLOCK_ID`` to ``max_num_blocks``."""
    longest = max((len(ids) for ids in block_ids), default=0)
    if max_num_blocks < longest:
        raise ValueError(f"max_num_blocks = {max_num_blocks} is less than the longest block table ({longest})")
    return [list(ids) + [PAD_BLOCK_ID] * (max_num_blocks - len(ids)) for ids in block_ids]


def compute_logits_indices(query_start_loc: Sequence[int]) -> list[int]:
    """The row of each request's last scheduled token: ``query_start_loc[r + 1] - 1``."""
    return [end - 1 for end in query_start_loc[1:]]
# --8<-- [end:builders]




# --8<-- [start:step_inputs]
@dataclass(frozen=True)
class StepInputs:
    """One step's index arithmetic as plain lists, already padded (NOTE 1)."""

    positions: list[int]  # [N_pad]
    slot_mapping: list[int]  # [N_pad]
    query_start_loc: list[int]  # [R_pad + 1]
    seq_lens: list[int]  # [R_pad]
    logits_indices: list[int]  # [R_pad]
    num_tokens: int  # N, the real tokens
    max_query_len: int
    max_seq_len: int


def build_step_inputs(
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    *,
    num_padded_tokens: int | None = None,
    num_padded_reqs: int | None = None,
) -> StepInputs:
    """Every per-token and per-request list of one step, padded to the given sizes."""
    _check_batch(num_computed_tokens, num_scheduled_tokens)
    if len(block_ids) != len(num_scheduled_tokens):
        raise ValueError(f"block_ids has {len(block_ids)} rows for {len(num_scheduled_tokens)} requests")
    if block_size < 1:
        raise ValueError(f"block_size = {block_size} must be >= 1")
    num_tokens, num_reqs = sum(num_scheduled_tokens), len(num_scheduled_tokens)
    n_pad = num_tokens if num_padded_tokens is None else num_padded_tokens
    r_pad = num_reqs if num_padded_reqs is None else num_padded_reqs
    if n_pad < num_tokens:
        raise ValueError(f"num_padded_tokens = {n_pad} is less than the {num_tokens} scheduled tokens")
    if r_pad < num_reqs:
        raise ValueError(f"num_padded_reqs = {r_pad} is less than the {num_reqs} scheduled requests")
    if num_tokens == num_reqs:  # a decode step (every request has >= 1 token, so each has exactly 1)
        query_start_loc, positions = list(range(num_reqs + 1)), list(num_computed_tokens)
        seq_lens = [c + 1 for c in num_computed_tokens]
    else:
        query_start_loc = compute_query_start_loc(num_scheduled_tokens)
        positions = compute_positions(num_computed_tokens, num_scheduled_tokens)
        seq_lens = compute_seq_lens(num_computed_tokens, num_scheduled_tokens)
    query_start_loc += [num_tokens] * (r_pad - num_reqs)
    slots = compute_slot_mapping(num_computed_tokens, num_scheduled_tokens, block_ids, block_size)
    return StepInputs(
        positions=positions + [0] * (n_pad - num_tokens),
        slot_mapping=slots + [PAD_SLOT_ID] * (n_pad - num_tokens),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens + [0] * (r_pad - num_reqs),
        logits_indices=compute_logits_indices(query_start_loc),
        num_tokens=num_tokens,
        max_query_len=max(num_scheduled_tokens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
# --8<-- [end:step_inputs]


def build_attention_metadata(
    num_computed_tokens: Sequence[int],
    num_scheduled_tokens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    *,
    num_padded_tokens: int | None = None,
    num_padded_reqs: int | None = None,
    max_num_blocks: int | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the step's ``AttentionMetadata`` as fresh tensors (NOTE 1 for padding)."""
    step = build_step_inputs(
        num_computed_tokens, num_scheduled_tokens, block_ids, block_size,
        num_padded_tokens=num_padded_tokens, num_padded_reqs=num_padded_reqs,
    )  # fmt: skip
    width = max((len(ids) for ids in block_ids), default=0) if max_num_blocks is None else max_num_blocks
    table = pad_block_table(list(block_ids) + [[]] * (len(step.seq_lens) - len(block_ids)), width)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return AttentionMetadata(
        positions=tensor(step.positions, torch.int64),
        query_start_loc=tensor(step.query_start_loc, torch.int32),
        seq_lens=tensor(step.seq_lens, torch.int32),
        slot_mapping=tensor(step.slot_mapping, torch.int64),
        block_table=tensor(table, torch.int32).reshape(len(table), width),
        logits_indices=tensor(step.logits_indices, torch.int64),
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        block_size=block_size,
    )
