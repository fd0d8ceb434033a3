"""Paged attention batched for torch's SDPA: the default attention backend on the CPU.

Concept: the same math and signature as ``reference.paged_attention``, in a few large torch
ops instead of about fifteen small ones per request. Decodes (one query token) go together
in groups of similar length (NOTE 5): one gather each for keys and values copies a group's
blocks into padded ``[G, L, Hkv, D]`` tensors (``L`` the longest length in whole blocks),
and one ``scaled_dot_product_attention`` (SDPA) call attends over them with a key-padding
mask. Requests of a few query tokens group the same way (NOTE 8); a longer prefill or chunk
gets its own gather and SDPA call with a causal mask aligned to its last key (NOTE 1). The
host-side work is the step's, not the layer's: ``plan_step`` does it once (NOTE 6).

Follows: seed 003 "KV cache物理内存分配" (the per-layer cache ``(2, num_blocks, block_size,
num_kv_heads, head_size)``); seed 000 "Attention 后端对 CUDA 图的兼容性" (``NEVER``). Cousin
of: vLLM's CPU backend (V1 ``vllm/v1/attention/backends/cpu_attn.py``, V0 ``torch_sdpa.py``),
which decodes with a C++ paged kernel; here decodes use SDPA too, after the gather.

Invariants: the result has the query's shape and dtype and matches the reference within
float32 rounding; rows at and after ``query_start_loc[-1]`` (CUDA-graph padding) are zero;
every cache slot read belongs to its request and lies before its length (NOTE 2), so what
other slots hold (stale keys, NaN) never reaches the result.

NOTE 1 (the causal mask of a chunk): query token j of q, over L keys, sits at ``L - q + j``.
SDPA's ``is_causal=True`` aligns top-left (keys ``0 .. j``), right only when ``q == L``; a
later chunk gets an explicit boolean mask, ``causal_mask(q, L)``.
NOTE 2 (padded gather, whole blocks): block ``j`` of a request owning ``m`` blocks is its
block ``min(j, m - 1)``, so entries past its own blocks are never read. Positions at or past
its length may hold anything (stale, NaN): the gather zeroes them (``DecodeGroup.stale``)
and the mask drops them. Both are needed: SDPA adds the mask to the score, and a zero
weight times a NaN value is still NaN. Whole blocks copy faster than single slots.
NOTE 3 (GQA): ``enable_gqa=True`` (torch 2.5+) lets query head h read KV head
``h // (H // Hkv)``; older torch gets the KV heads expanded (``expand_kv_heads``).
NOTE 4 (a reused gather buffer): a fresh tensor of megabytes gets fresh pages the copy faults
in one by one. So a gather writes into a buffer each thread keeps (per device, dtype and
inference mode), grown to a power of two elements: the largest gather so far.
NOTE 5 (length groups): a group costs its size times its width ``L``. ``group_by_length``
sorts decodes longest first and starts a new group where a length falls below
``1 / GROUP_PADDING`` (4/5) of its group's longest: nobody is padded past 5/4 of its length.
NOTE 6 (a plan per step): ``plan_step`` reads ``query_start_loc`` and ``seq_lens`` on the host
once and builds every group's rows, slot indices and mask (and NOTE 7's bias), and every
prefill's block ids, as a frozen ``StepPlan``; ``paged_attention`` makes one when not given
one, so it keeps the reference's signature.
NOTE 7 (a shared prefix, attended once: cascade attention): requests sharing a cached prefix
hold the same blocks. ``plan_step`` finds the leading block-table columns equal across a
group (``shared_prefix_blocks``; full blocks only); when the keys saved, ``(G - 1) * P``,
reach ``CASCADE_MIN_SAVED_KEYS``, the group attends in two parts, all its queries over the
prefix gathered once, then each request over its own keys, and ``merge_attention`` combines
them exactly through their log-sum-exps. The public SDPA returns no LSE, so both parts call
torch's CPU flash kernel (query heads of a KV head folded into its rows); CPU only. vLLM does
this on GPUs (``common_prefix_len``). The split's fixed cost is why the bound exists.
NOTE 8 (short queries, grouped): 2 .. ``SHORT_QUERY_MAX`` query tokens (a verification's
drafts, beam search's tails) join length groups of their own, rows padded to the group's
most by repeating the last (its output dropped), each row's causal mask keeping keys past
its length out: one SDPA call instead of one per request.

Not CUDA-graph safe (``NEVER``): the split and ``L`` come from host reads (``.tolist()``);
its KV writer (``write_kv_cache_torch``) indexes with a boolean mask.
Left out: sliding windows, ALiBi, soft-capping, sinks, fp8 caches, cross-attention; batched
long prefills; bounding or freeing the decode gather (NOTE 4); gradients through it (``out=``);
cascade for prefills and off the CPU.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.attention.metadata import AttentionLayout, AttentionMetadata
from tinyvllm.arith import cdiv

# Seed 000 "Attention 后端对 CUDA 图的兼容性": query lengths and sequence lengths are read on
# the host to split the batch and size the gather, which a CUDA graph cannot capture.
CUDAGRAPH_SUPPORT = AttentionCGSupport.NEVER

# NOTE 3: SDPA takes ``enable_gqa`` from torch 2.5 on.
SDPA_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

# NOTE 5: a decode group's width is at most this many times each of its lengths.
GROUP_PADDING = 1.25

# NOTE 7: a decode group attends to a shared prefix once when that saves this many keys.
CASCADE_MIN_SAVED_KEYS = 2048

# NOTE 8: requests of 2 .. this many query tokens attend in length groups, as decodes do.
SHORT_QUERY_MAX = 16

# NOTE 4: each thread's reusable gather buffers, keyed by (name, device, dtype, whether
# inference mode is on: a tensor made under it cannot be written outside it).
_scratch = threading.local()


# --8<-- [start:helpers]
def decode_blocks(
    block_table: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32, each >= 1
    block_size: int,
    num_blocks: int,  # L / S: blocks per request in the gather
) -> torch.Tensor:  # [R, L / S] int64
    """The block ids of blocks ``0 .. num_blocks - 1`` of each request; blocks past a
    request's own repeat its last one (NOTE 2)."""
    index = torch.arange(num_blocks, device=seq_lens.device)  # [L / S]
    last = ((seq_lens.long() + block_size - 1) // block_size - 1).clamp(min=0)  # [R]
    return block_table.gather(1, torch.minimum(index[None, :], last[:, None])).long()


def stale_positions(keep: torch.Tensor) -> torch.Tensor | None:  # [k] int64
    """Flat indices ``r * L + p`` of the gathered positions that ``keep`` ([R, L] bool, the
    ``key_padding_mask``) drops: they hold no key of request r (NOTE 2). None when there
    are none."""
    stale = ~keep  # [R, L]
    return stale.flatten().nonzero().squeeze(1) if bool(stale.any()) else None


def key_padding_mask(seq_lens: torch.Tensor, width: int) -> torch.Tensor:  # [R, L] bool
    """True where position p < the request's length: the keys a decode token may read."""
    return torch.arange(width, device=seq_lens.device)[None, :] < seq_lens[:, None]


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:  # [q, L] bool
    """True where query token j (at position ``seq_len - query_len + j``) may read key p,
    that is ``p <= seq_len - query_len + j``: causal, aligned bottom-right (NOTE 1)."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)  # [q]
    k_pos = torch.arange(seq_len, device=device)  # [L]
    return k_pos[None, :] <= q_pos[:, None]


def gather_rows(
    rows: torch.Tensor,  # [B, ...]: e.g. a cache [B, S, Hkv, D], one row per block
    slots: torch.Tensor,  # [n] int64: the rows to take
    name: str,  # which buffer: "key" or "value"
) -> torch.Tensor:  # [n, ...]
    """``rows[slots]``, written into this thread's reusable buffer ``name`` (NOTE 4). The
    result is valid until the next call with the same name on the same thread."""
    key = (name, rows.device, rows.dtype, torch.is_inference_mode_enabled())
    buffers = _scratch.__dict__.setdefault("buffers", {})
    need = slots.numel() * math.prod(rows.shape[1:])
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < need:
        buffer = torch.empty(1 << max(need - 1, 0).bit_length(), dtype=rows.dtype, device=rows.device)
        buffers[key] = buffer  # a power of two: a slowly growing batch reallocates rarely
    out = buffer[:need].view(slots.numel(), *rows.shape[1:])
    return torch.index_select(rows, 0, slots, out=out)


def expand_kv_heads(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[..., Hkv, L, D] -> [..., Hkv * group, L, D], KV head i repeated as heads
    ``i * group .. i * group + group - 1`` (the layout ``enable_gqa`` assumes; NOTE 3).
    No copy when ``group == 1``."""
    if group == 1:
        return kv
    *batch, num_kv_heads, length, dim = kv.shape
    return kv.unsqueeze(-3).expand(*batch, num_kv_heads, group, length, dim).flatten(-4, -3)


def sdpa(
    q: torch.Tensor,  # [..., H, q, D] float32
    k: torch.Tensor,  # [..., Hkv, L, D] float32
    v: torch.Tensor,  # [..., Hkv, L, D] float32
    scale: float,
    attn_mask: torch.Tensor | None = None,  # bool, broadcast to [..., H, q, L]; True = attend
    is_causal: bool = False,
) -> torch.Tensor:  # [..., H, q, D]
    """One SDPA call with grouped-query heads, natively or by expansion (NOTE 3)."""
    if SDPA_HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[-3] // k.shape[-3]
    k, v = expand_kv_heads(k, group), expand_kv_heads(v, group)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
# --8<-- [end:helpers]


# --8<-- [start:cascade_helpers]
def shared_prefix_blocks(rows: torch.Tensor) -> int:  # rows: [G, n] block ids
    """How many leading columns of ``rows`` hold one block id in every row (NOTE 7)."""
    same = (rows == rows[:1]).all(0)  # [n]
    return int(same.int().cumprod(0).sum()) if same.numel() else 0


def attention_with_lse(
    q: torch.Tensor,  # [B, Hkv, M, D] float32: the M query rows of each KV head
    k: torch.Tensor,  # [B, Hkv, L, D] float32
    v: torch.Tensor,  # [B, Hkv, L, D] float32
    scale: float,
    bias: torch.Tensor | None = None,  # [B, 1, 1, L] float32, 0 or -inf, added to the scores
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hkv, M, D], [B, Hkv, M]
    """Attention and the log of each row's softmax denominator, through torch's CPU flash
    kernel (the public SDPA returns no LSE; NOTE 7)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor,  # [..., D], [...]: attention over key set A
    out_b: torch.Tensor, lse_b: torch.Tensor,  # [..., D], [...]: over key set B, disjoint from A
) -> torch.Tensor:  # [..., D]: attention over A and B together
    """Combine two partial attentions by their softmax denominators (NOTE 7): each part's
    weight is its share ``exp(lse_x) / (exp(lse_a) + exp(lse_b))``, computed from the
    larger LSE so that nothing overflows."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = (lse_a - top).exp(), (lse_b - top).exp()
    return (out_a * w_a[..., None] + out_b * w_b[..., None]) / (w_a + w_b)[..., None]
# --8<-- [end:cascade_helpers]


# --8<-- [start:plan]
def group_by_length(lens: list[int], reqs: list[int]) -> list[list[int]]:
    """The requests ``reqs``, longest first, split into groups so that no length is below
    ``1 / GROUP_PADDING`` of its group's longest (NOTE 5). Each group lists request indices."""
    groups: list[list[int]] = []
    for r in sorted(reqs, key=lambda r: -lens[r]):
        if groups and lens[groups[-1][0]] <= GROUP_PADDING * lens[r]:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


@dataclass(frozen=True)
class DecodeGroup:
    """Decode requests attended together over one padded width (NOTE 5)."""

    rows: torch.Tensor  # [G] int64: each request's query row
    blocks: torch.Tensor  # [G * L / S] int64: the cache block of each gathered block (NOTE 2)
    stale: torch.Tensor | None  # [k] int64: gathered positions past their request's length (NOTE 2)
    mask: torch.Tensor | None  # [G, 1, 1, L] bool, True = a real key; None if all have L keys
    width: int  # L, the group's longest length rounded up to whole blocks
    # NOTE 7: the blocks of a prefix all G requests share, attended once; the fields above
    # then cover each request's keys after it (its length minus P), and width L is theirs.
    prefix_blocks: torch.Tensor | None = None  # [P / S] int64
    # With prefix_blocks and a mask: the mask as the flash kernel takes it, made once per step.
    bias: torch.Tensor | None = None  # [G, 1, 1, L] float32, 0 for a real key, -inf elsewhere


@dataclass(frozen=True)
class ChunkGroup:
    """Requests of 2 .. ``SHORT_QUERY_MAX`` query tokens attended together (NOTE 8): each
    request's queries padded to the group's ``Q`` rows by repeating its last one."""

    rows: torch.Tensor  # [G * Q] int64: the query row each padded row reads
    valid: torch.Tensor  # [n] int64: which of the G * Q rows are real
    out_rows: torch.Tensor  # [n] int64: the output row of each real one
    blocks: torch.Tensor  # [G * L / S] int64: as a decode group's (NOTE 2)
    stale: torch.Tensor | None  # [k] int64: as a decode group's (NOTE 2)
    mask: torch.Tensor  # [G, 1, Q, L] bool: causal, aligned to each request's last key (NOTE 1)
    width: int  # L
    queries: int  # Q, the group's most query tokens


@dataclass(frozen=True)
class PrefillPart:
    """One request with more than one query token: rows ``start .. end-1``, its blocks."""

    start: int
    end: int
    blocks: torch.Tensor  # [cdiv(seq_len, S)] int32
    seq_len: int


@dataclass(frozen=True)
class StepPlan:
    """What every layer of one step needs, computed once on the host (NOTE 6)."""

    num_rows: int  # query_start_loc[-1]: rows past it are padding
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillPart, ...]
    chunk_groups: tuple[ChunkGroup, ...] = ()


def plan_step(
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    block_size: int,
    cascade_min_saved_keys: int | None = None,  # NOTE 7; None: CASCADE_MIN_SAVED_KEYS
) -> StepPlan:
    """Split the step's requests into decode groups and prefills (host reads: NEVER)."""
    if cascade_min_saved_keys is None:
        cascade_min_saved_keys = CASCADE_MIN_SAVED_KEYS
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    device = seq_lens.device
    num_reqs = len(lens)
    decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
    groups = []
    for members in group_by_length(lens, decodes):
        reqs = torch.tensor(members, device=device)  # [G]
        table = block_table.index_select(0, reqs)  # [G, max_blocks]
        # NOTE 7: blocks before every member's last position, equal in every row: full, shared.
        # The bound is checked on the longest possible prefix first: most groups share nothing,
        # and the host arithmetic spares them the tensor ops of the search.
        limit = min((lens[r] - 1) // block_size for r in members)  # blocks before every last position
        saved_per_block = (len(members) - 1) * block_size  # keys saved by each shared block
        num_shared = 0
        if len(members) > 1 and device.type == "cpu" and saved_per_block * limit >= cascade_min_saved_keys:
            num_shared = shared_prefix_blocks(table[:, :limit])
            if saved_per_block * num_shared < cascade_min_saved_keys:
                num_shared = 0
        prefix_len = num_shared * block_size
        num_blocks = cdiv(lens[members[0]] - prefix_len, block_size)
        width = num_blocks * block_size
        group_lens = seq_lens.index_select(0, reqs) - prefix_len  # [G]: keys after the prefix
        blocks = decode_blocks(table[:, num_shared:], group_lens, block_size, num_blocks)  # [G, L/S]
        same = all(lens[r] - prefix_len == width for r in members)
        keep = None if same else key_padding_mask(group_lens, width)  # [G, L]
        mask = None if keep is None else keep[:, None, None, :]  # [G, 1, 1, L]
        stale = None if keep is None else stale_positions(keep)
        rows = torch.tensor([starts[r] for r in members], device=device)  # [G]
        prefix = table[0, :num_shared].long() if num_shared else None  # [P / S]
        bias = None  # [G, 1, 1, L]: the flash kernel takes an additive mask, not a boolean one
        if prefix is not None and mask is not None:
            bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        groups.append(DecodeGroup(rows, blocks.flatten(), stale, mask, width, prefix, bias))
    short = [r for r in range(num_reqs) if 1 < starts[r + 1] - starts[r] <= SHORT_QUERY_MAX]
    chunks = tuple(plan_chunk_group(members, starts, lens, seq_lens, block_table, block_size)
                   for members in group_by_length(lens, short))  # fmt: skip
    prefills = tuple(
        PrefillPart(starts[r], starts[r + 1], block_table[r, : cdiv(lens[r], block_size)], lens[r])
        for r in range(num_reqs)
        if starts[r + 1] - starts[r] > SHORT_QUERY_MAX
    )  # fmt: skip
    return StepPlan(starts[-1], tuple(groups), prefills, chunks)


def plan_chunk_group(
    members: list[int], starts: list[int], lens: list[int], seq_lens: torch.Tensor, block_table: torch.Tensor,
    block_size: int,
) -> ChunkGroup:  # fmt: skip
    """One group of short queries (NOTE 8): padded rows, the gather's blocks, the causal mask."""
    device = seq_lens.device
    reqs = torch.tensor(members, device=device)  # [G]
    query_lens = torch.tensor([starts[r + 1] - starts[r] for r in members], device=device)  # [G]
    num_queries = int(query_lens.max())
    num_blocks = cdiv(lens[members[0]], block_size)
    width = num_blocks * block_size
    group_lens = seq_lens.index_select(0, reqs).long()  # [G]
    blocks = decode_blocks(block_table.index_select(0, reqs), group_lens, block_size, num_blocks)  # [G, L/S]
    j = torch.arange(num_queries, device=device)  # [Q]
    row_of = torch.minimum(j[None, :], query_lens[:, None] - 1)  # [G, Q]: a padded row repeats the last
    position = group_lens[:, None] - query_lens[:, None] + row_of  # [G, Q]: each row's position (NOTE 1)
    mask = torch.arange(width, device=device)[None, None, :] <= position[:, :, None]  # [G, Q, L]
    rows = (torch.tensor([starts[r] for r in members], device=device)[:, None] + row_of).flatten()  # [G * Q]
    valid = (j[None, :] < query_lens[:, None]).flatten().nonzero().squeeze(1)  # [n]
    stale = stale_positions(key_padding_mask(group_lens, width))
    return ChunkGroup(rows, valid, rows.index_select(0, valid), blocks.flatten(), stale, mask[:, None], width,
                      num_queries)  # fmt: skip


def plan_from_metadata(meta: AttentionMetadata, layout: AttentionLayout | None = None) -> StepPlan:
    """``plan_step`` over a step's attention metadata (what the model calls once per step).
    ``layout`` is not read: this plan depends on the lengths only, whatever the heads."""
    return plan_step(meta.query_start_loc, meta.seq_lens, meta.block_table, meta.block_size)
# --8<-- [end:plan]


# --8<-- [start:decode]
def gather_group(
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    blocks: torch.Tensor,  # [G * L / S] int64
    stale: torch.Tensor | None,  # [k] int64
    num_reqs: int,  # G
    width: int,  # L
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [G, Hkv, L, D] float32
    """A group's keys and values: one gather each, positions past a length zeroed (NOTE 2)."""
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    k = gather_rows(key_cache, blocks, "key").flatten(0, 1)  # [G * L, Hkv, D]
    v = gather_rows(value_cache, blocks, "value").flatten(0, 1)  # [G * L, Hkv, D]
    if stale is not None:  # positions past a request's length: zeros, not stale values (NOTE 2)
        k.index_fill_(0, stale, 0.0)
        v.index_fill_(0, stale, 0.0)
    k = k.view(num_reqs, width, num_kv_heads, head_size).transpose(1, 2).float()  # [G, Hkv, L, D]
    v = v.view(num_reqs, width, num_kv_heads, head_size).transpose(1, 2).float()  # [G, Hkv, L, D]
    return k, v


def decode_attention(
    query: torch.Tensor,  # [G, H, D]: one token per request of the group
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:  # [G, H, D] float32
    """A group's decode tokens at once: one gather each of K and V, one SDPA call."""
    k, v = gather_group(key_cache, value_cache, group.blocks, group.stale, query.shape[0], group.width)
    if group.prefix_blocks is not None:
        return cascade_decode(query, key_cache, value_cache, k, v, group, scale)
    q = query.float().unsqueeze(2)  # [G, H, 1, D]
    return sdpa(q, k, v, scale, attn_mask=group.mask).squeeze(2)  # [G, H, D]


def cascade_decode(
    query: torch.Tensor,  # [G, H, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    k: torch.Tensor,  # [G, Hkv, L, D] float32: each request's keys after the prefix
    v: torch.Tensor,  # [G, Hkv, L, D] float32
    group: DecodeGroup,
    scale: float,
) -> torch.Tensor:  # [G, H, D] float32
    """A group's decodes over a shared prefix, attended once, and their own keys (NOTE 7)."""
    num_reqs, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    per_kv = num_heads // num_kv_heads  # query heads per KV head: folded into the query rows
    prefix_len = group.prefix_blocks.numel() * key_cache.shape[1]
    # Part 1: all G * per_kv query rows of each KV head over the P prefix keys, one gather.
    kp = key_cache.index_select(0, group.prefix_blocks).view(1, prefix_len, num_kv_heads, head_size)
    vp = value_cache.index_select(0, group.prefix_blocks).view(1, prefix_len, num_kv_heads, head_size)
    q = query.float().view(num_reqs, num_kv_heads, per_kv, head_size)  # [G, Hkv, per_kv, D]
    q_all = q.transpose(0, 1).reshape(1, num_kv_heads, num_reqs * per_kv, head_size)  # [1, Hkv, G*per_kv, D]
    out_p, lse_p = attention_with_lse(q_all, kp.transpose(1, 2).float(), vp.transpose(1, 2).float(), scale)
    out_p = out_p.view(num_kv_heads, num_reqs, per_kv, head_size).transpose(0, 1)  # [G, Hkv, per_kv, D]
    lse_p = lse_p.view(num_kv_heads, num_reqs, per_kv).transpose(0, 1)  # [G, Hkv, per_kv]
    # Part 2: each request over its own keys after the prefix, as a group without one.
    out_s, lse_s = attention_with_lse(q, k, v, scale, group.bias)  # [G, Hkv, per_kv, D], [G, Hkv, per_kv]
    return merge_attention(out_p, lse_p, out_s, lse_s).reshape(num_reqs, num_heads, head_size)
# --8<-- [end:decode]


# --8<-- [start:chunks]
def chunk_attention(
    query: torch.Tensor,  # [N, H, D]: the step's query rows
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    group: ChunkGroup,
    scale: float,
) -> torch.Tensor:  # [n, H, D] float32: the group's real rows, in ``out_rows`` order
    """A group of short queries at once (NOTE 8): one gather each of K and V, one SDPA call."""
    num_reqs, num_queries = group.mask.shape[0], group.queries
    num_heads, head_size = query.shape[1], query.shape[2]
    k, v = gather_group(key_cache, value_cache, group.blocks, group.stale, num_reqs, group.width)
    q = query.index_select(0, group.rows).view(num_reqs, num_queries, num_heads, head_size)  # [G, Q, H, D]
    o = sdpa(q.transpose(1, 2).float(), k, v, scale, attn_mask=group.mask)  # [G, H, Q, D]
    return o.transpose(1, 2).reshape(num_reqs * num_queries, num_heads, head_size).index_select(0, group.valid)
# --8<-- [end:chunks]


# --8<-- [start:prefill]
def prefill_attention(
    query: torch.Tensor,  # [q, H, D]: one request's query tokens, q >= 1
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    blocks: torch.Tensor,  # [cdiv(L, S)]: the request's block ids, in order
    seq_len: int,  # L >= q
    scale: float,
) -> torch.Tensor:  # [q, H, D] float32
    """One request's query tokens over its L keys, causal from position ``L - q`` (NOTE 1)."""
    query_len = query.shape[0]
    blocks = blocks.long()
    k = key_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]  # [L, Hkv, D]
    v = value_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]  # [L, Hkv, D]
    q = query.float().transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    k = k.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    v = v.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    if query_len == seq_len:  # a whole prompt: top-left alignment is the right one
        o = sdpa(q, k, v, scale, is_causal=True)
    else:
        o = sdpa(q, k, v, scale, attn_mask=causal_mask(query_len, seq_len, query.device))
    return o.squeeze(0).transpose(0, 1)  # [q, H, D]
# --8<-- [end:prefill]


# --8<-- [start:paged_attention]
def paged_attention(
    query: torch.Tensor,  # [N, H, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [N, H, D]
    plan: StepPlan | None = None,  # NOTE 6: made here when not given
) -> torch.Tensor:
    """Causal paged attention; returns ``out`` (allocated if None), shaped like ``query``.
    Decodes run in length groups, each longer request alone; padding rows get zeros."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    out = torch.empty_like(query) if out is None else out
    if plan is None:
        plan = plan_step(query_start_loc, seq_lens, block_table, key_cache.shape[1])
    for group in plan.decode_groups:
        o = decode_attention(query.index_select(0, group.rows), key_cache, value_cache, group, scale)  # [G, H, D]
        out.index_copy_(0, group.rows, o.to(out.dtype))
    for chunks in plan.chunk_groups:
        out.index_copy_(0, chunks.out_rows, chunk_attention(query, key_cache, value_cache, chunks, scale).to(out.dtype))
    for part in plan.prefills:
        out[part.start : part.end] = prefill_attention(
            query[part.start : part.end], key_cache, value_cache, part.blocks, part.seq_len, scale
        )  # fmt: skip
    out[plan.num_rows :] = 0  # CUDA-graph padding rows
    return out
# --8<-- [end:paged_attention]
