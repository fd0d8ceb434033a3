"""Paged attention in Triton: one unified kernel for mixed prefill and decode batches.

Concept: the same math as ``reference.paged_attention`` (same signature, same result),
computed in tiles. A program owns one *query tile* (``BLOCK_Q`` consecutive tokens of one
request) and one KV head, and packs the ``G = H // Hkv`` query heads that read that KV head
into the tile's rows (``BLOCK_M >= BLOCK_Q * G``), so each key/value tile loaded from the
cache serves all of them. It walks the request's keys in order, ``TILE_N`` keys per KV tile,
with an online softmax in float32; each key's cache block comes from the block table, so a
tile may span several blocks or part of one (NOTE 3). A split-KV path cuts each request's
tiles into ``NUM_SEGMENTS`` segments handled by separate programs, then a second small
kernel merges the partial results (NOTE 2).

Follows: seed 003 "KV cache物理内存分配" (the cache layout and the block ids in the attention
metadata); seed 000 "Attention 后端对 CUDA 图的兼容性" (this backend is CUDA-graph safe: ``ALWAYS``).
Mirrors: ``vllm/attention/ops/triton_unified_attention.py`` (``kernel_unified_attention_2d``,
``_3d`` and ``reduce_segments``) and ``vllm/v1/attention/backends/triton_attn.py``.

Invariants: identical results to the reference within the dtype's tolerance; every output
row is written (padding rows past ``query_start_loc[-1]`` get zeros); the grid depends only
on tensor shapes, never on their values, so a CUDA graph can replay it (NOTE 1).

NOTE 1 (grid from shapes): request r owns tiles ``query_start_loc[r] // BLOCK_Q + r`` up to
the next request's first tile; the padding rows after ``query_start_loc[R]`` own the tiles
after that. ``cdiv(N, BLOCK_Q) + R`` tiles always cover both; spare programs find no row.
A program finds its request by binary search over ``query_start_loc``.
NOTE 2 (when to split): a decode batch with few requests launches ``R * Hkv`` programs, too
few to fill a GPU's SMs, and each walks the whole context alone. ``choose_num_segments``
splits the context into 16 segments when the batch is pure decode (``N == R``), the block
table can hold a long context, and ``R * Hkv`` is below ``SPLIT_KV_MAX_PROGRAMS``.
NOTE 3 (keys per tile): a KV tile is ``TILE_N`` consecutive key positions, not one cache
block. Key ``k`` lives in slot ``k % S`` of block ``block_table[r, k // S]``, so the kernel
gathers each key row's block id (``TILE_N / S`` distinct ids, read from cache). A wider
tile means fewer loop trips and more bytes in flight per trip (decode is bound by memory)
and a wider ``tl.dot`` (prefill is bound by arithmetic); ``choose_kv_tile`` picks it from
measurements on an H100 (docs: Paged attention, "How fast").
NOTE 4 (full and diagonal tiles): a KV tile whose keys all lie at or before the query tile's
first position, and inside what it may see, is visible to every row: it needs neither the
causal mask nor the bounds mask. ``_num_full_kv_tiles`` counts those leading tiles; they run
unmasked, the few diagonal tiles after them masked (a split-KV segment takes its share of
each). A spare tile past its request's last row sees no key at all.
NOTE 5 (prefill tiles and launch): rows per query tile, keys per KV tile, ``num_warps`` and
``num_stages`` come from ``choose_*`` functions, each overridable on ``paged_attention`` so
``bench/attention.py`` can sweep them on a GPU; the defaults stay until a sweep says otherwise.

Left out: sliding windows, ALiBi, soft-capping, sinks, fp8 KV, head sizes that are not a
power of two, autotuning (one configuration per shape class).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.arith import cdiv
from tinyvllm.platform import triton_can_run_on

# Seed 000 "Attention 后端对 CUDA 图的兼容性": the grid, the tile sizes and the split-KV choice
# depend on tensor shapes only, and the launcher never reads a tensor's value on the host,
# so a CUDA graph of any batch (mixed prefill and decode included) replays correctly.
CUDAGRAPH_SUPPORT = AttentionCGSupport.ALWAYS

SPLIT_KV_SEGMENTS = 16  # segments per request on the split-KV path (a power of two)
SPLIT_KV_MIN_CONTEXT = 512  # tokens the block table must be able to hold before splitting
SPLIT_KV_MAX_PROGRAMS = 128  # split only when R * Hkv programs would be fewer than this
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Keys per KV tile (NOTE 3), from bench/attention.py's sweep of 16-128 on an H100 (Llama-3-8B
# attention shape, bf16, blocks of 16): 32 was the fastest, or within 2%, at decode batches
# 4, 64 and 256 and at prefill lengths 128 and 1024-4096 (mostly 1.2-1.3x faster than 16, one
# block a tile). 128 won where too few programs each walk a long context (batch 16 without
# a split, batch 1 at 2048+): a question for the split rule, not the tile. One constant per
# kind of batch, because the two are bound by different things and another shape may split them.
DECODE_KV_TILE = 32  # every request has one query token: bound by memory
PREFILL_KV_TILE = 32  # a batch with prompt rows: bound by arithmetic
# Rows per query tile (BLOCK_M's target, NOTE 5): about 16 for decode (one token per request),
# 64 for prefill; the GPU sweep in bench/attention.py tries 64 and 128 for prefill.
DECODE_QUERY_ROWS = 16
PREFILL_QUERY_ROWS = 64
# (num_warps, num_stages) per kind of batch (NOTE 5): Triton's defaults for a CUDA launch, the
# launch options vLLM's unified attention kernel uses (it passes none); not yet measured here.
DECODE_LAUNCH = (4, 3)
PREFILL_LAUNCH = (4, 3)
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)  # Triton needs a power of two; 16 warps = 512 threads


# --8<-- [start:choose]
def choose_num_segments(num_tokens: int, num_reqs: int, num_kv_heads: int, max_context: int) -> int:
    """How many KV segments per request (NOTE 2): 16 for few, long, pure-decode requests."""
    decode_only = num_tokens == num_reqs
    few_programs = num_reqs * num_kv_heads < SPLIT_KV_MAX_PROGRAMS
    long_context = max_context >= SPLIT_KV_MIN_CONTEXT
    return SPLIT_KV_SEGMENTS if decode_only and few_programs and long_context else 1


def choose_query_tile(num_queries_per_kv: int, decode_only: bool, rows: int | None = None) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)``: tokens per query tile and rows per tile (G heads per token).
    ``rows`` (a power of two, default ``DECODE_QUERY_ROWS`` or ``PREFILL_QUERY_ROWS``) is the
    target; BLOCK_M exceeds it only when one token's G heads do. ``tl.dot`` needs 16."""
    target_rows = rows if rows is not None else DECODE_QUERY_ROWS if decode_only else PREFILL_QUERY_ROWS
    block_q = max(1, target_rows // num_queries_per_kv)
    return block_q, max(16, triton.next_power_of_2(block_q * num_queries_per_kv))


def choose_launch_options(decode_only: bool) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the attention kernel's launch (NOTE 5)."""
    return DECODE_LAUNCH if decode_only else PREFILL_LAUNCH


def choose_kv_tile(decode_only: bool) -> int:
    """Keys per KV tile (NOTE 3): a power of two >= 16, whatever the cache's block size."""
    return DECODE_KV_TILE if decode_only else PREFILL_KV_TILE
# --8<-- [end:choose]


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """The largest r in [0, R] whose first tile ``query_start_loc[r] // BLOCK_Q + r`` is
    <= ``tile``. r == R means the tile lies in the padding after the last request."""
    lo: tl.int32 = 0  # typed: an int argument equal to 1 arrives as a constexpr
    hi: tl.int32 = num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# --8<-- [start:kernel]
# --8<-- [start:num_full]
@triton.jit
def _num_full_kv_tiles(first_pos, kv_len, TILE_N: tl.constexpr):
    """KV tiles ``0 .. n - 1`` whose every key is visible to every row of a query tile whose
    first token sits at ``first_pos`` and which sees ``kv_len`` keys (NOTE 4): all their
    keys are ``<= first_pos`` and ``< kv_len``. Tile ``n`` on is diagonal (masked)."""
    return tl.maximum(tl.minimum(first_pos + 1, kv_len), 0) // TILE_N
# --8<-- [end:num_full]


@triton.jit
def _attend_kv_tile(
    q, m, l, acc,  # [M, D] the query tile; [M], [M], [M, D] the running max, denominator, numerator
    j, kv_len, q_pos,  # the KV tile's index; keys the query tile may see; [M] each row's position
    scale, block_table_row_ptr, key_head_ptr, value_head_ptr,  # the request's block ids; caches at the KV head
    stride_k_b, stride_k_s, stride_v_b, stride_v_s,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_SIZE: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row (NOTE 4)
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One step of the online softmax over KV tile ``j`` (keys ``j*TILE_N ..``): returns the
    updated ``(m, l, acc)``. ``MASKED`` tiles mask keys past ``kv_len`` and keys after a
    row's position to ``-inf``; full tiles skip both masks and the ``-inf`` guard."""
    keys = tl.arange(0, TILE_N)  # [T]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    k_pos = j * TILE_N + keys  # [T]
    if MASKED:
        k_valid = k_pos < kv_len  # [T]
        block_id = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0)  # [T]
    else:
        block_id = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE)  # [T]
    slot = k_pos % BLOCK_SIZE  # [T]
    k_ptrs = key_head_ptr + (block_id.to(tl.int64) * stride_k_b + slot * stride_k_s)[None, :] + dims[:, None]
    v_ptrs = value_head_ptr + (block_id.to(tl.int64) * stride_v_b + slot * stride_v_s)[:, None] + dims[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=k_valid[None, :], other=0.0)  # [D, T]
        v = tl.load(v_ptrs, mask=k_valid[:, None], other=0.0)  # [T, D]
    else:
        k = tl.load(k_ptrs)  # [D, T]
        v = tl.load(v_ptrs)  # [T, D]
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=INPUT_PRECISION) * scale  # [M, T]
    if MASKED:
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [M, T]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [M]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # [M]: a row with no key yet
    else:
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [M]: finite, every key is visible
        m_safe = m_new
    p = tl.exp(s - m_safe[:, None])  # [M, T]
    alpha = tl.exp(m - m_safe)  # [M]
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # *T, [N, H, D]: the result (written when NUM_SEGMENTS == 1)
    part_acc_ptr,  # *fp32, [N, H, NUM_SEGMENTS, D]: unnormalised segment outputs (split path)
    part_max_ptr,  # *fp32, [N, H, NUM_SEGMENTS]: each segment's running max m (split path)
    part_sum_ptr,  # *fp32, [N, H, NUM_SEGMENTS]: each segment's softmax denominator l
    query_ptr,  # *T, [N, H, D]: this step's queries, requests back to back
    key_cache_ptr,  # *T, [B, S, Hkv, D]: the layer's key cache
    value_cache_ptr,  # *T, [B, S, Hkv, D]: the layer's value cache
    query_start_loc_ptr,  # *int32, [R + 1]: first query row of each request, then N_actual
    seq_lens_ptr,  # *int32, [R]: tokens in the cache per request, this step's included
    block_table_ptr,  # *int32, [R, max_blocks]: each request's block ids in token order
    scale,  # float: softmax scale, usually D ** -0.5
    num_tokens,  # N: query rows, padding included
    num_reqs,  # R
    num_heads,  # H (indexes the partial buffers)
    stride_q_n, stride_q_h,  # query strides: between tokens, between heads
    stride_o_n, stride_o_h,  # out strides: between tokens, between heads
    stride_k_b, stride_k_s, stride_k_h,  # key_cache strides: block, slot, head
    stride_v_b, stride_v_s, stride_v_h,  # value_cache strides: block, slot, head
    stride_bt_r,  # block_table stride between requests
    QUERIES_PER_KV: tl.constexpr,  # G = H // Hkv, query heads packed into one tile
    BLOCK_SIZE: tl.constexpr,  # S: tokens per cache block
    TILE_N: tl.constexpr,  # keys per KV tile (NOTE 3), a power of two >= 16
    HEAD_SIZE: tl.constexpr,  # D (a power of two)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile, a power of two >= BLOCK_Q * G and >= 16
    NUM_SEGMENTS: tl.constexpr,  # 1: write out directly; > 1: write partials for the merge
    DOT_FP32: tl.constexpr,  # upcast operands to fp32 before tl.dot (interpreter, fp32 input)
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision for fp32 operands ("ieee" or "tf32")
):
    """Causal attention for one (query tile, KV head, segment) of a paged batch.

    Row i of the tile is query token ``t = i // G`` with head ``kv_head * G + i % G``, at
    position ``pos[i] = context_len + t`` (``context_len = seq_len - query_len``). For each
    KV tile j (keys at positions ``j*TILE_N .. j*TILE_N + TILE_N - 1``) the scores
    ``s = scale * q @ K_j^T`` are masked to ``-inf`` where ``key_pos > pos[i]`` or
    ``key_pos >= seq_len``, and the online softmax updates, in float32,

        m_new = max(m, rowmax(s))
        p     = exp(s - m_new)
        l     = l * exp(m - m_new) + rowsum(p)
        acc   = acc * exp(m - m_new) + p @ V_j
        m     = m_new

    starting from ``m = -inf, l = 0, acc = 0``; the output is ``acc / l``. A fully masked
    tile leaves ``m = -inf``; ``m_new`` is then replaced by 0 in the exponents so that no
    ``-inf - -inf`` appears. The leading full tiles (NOTE 4) skip the masks. Split path: the program covers only the tiles of its segment
    and stores ``(acc, m, l)``; ``_merge_segments_kernel`` combines the segments.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    # Which request (or the padding, r == R) owns this tile, and which rows it holds.
    r = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
    is_request = r < num_reqs
    q_begin = tl.load(query_start_loc_ptr + r)
    q_end = tl.load(query_start_loc_ptr + r + 1, mask=is_request, other=num_tokens)
    seq_len = tl.load(seq_lens_ptr + r, mask=is_request, other=0)
    context_len = seq_len - (q_end - q_begin)
    tile_start = q_begin + (tile - (q_begin // BLOCK_Q + r)) * BLOCK_Q

    rows = tl.arange(0, BLOCK_M)  # [M]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    token = tile_start + rows // QUERIES_PER_KV  # [M] query row in [0, N)
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV  # [M] query head
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (token < q_end)  # [M]
    q_pos = context_len + token - q_begin  # [M] position of each row's token
    q = tl.load(
        query_ptr + token[:, None] * stride_q_n + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None], other=0.0,
    )  # [M, D]  # fmt: skip

    # Keys this tile can see: up to its last token's position (causal), at most seq_len;
    # none for a spare tile past the request's last row (it stores nothing).
    tile_end = tl.minimum(tile_start + BLOCK_Q, q_end)
    kv_len = tl.maximum(tl.minimum(seq_len, context_len + tile_end - q_begin), 0)
    kv_len = tl.where(tile_start < q_end, kv_len, 0)
    first_pos = context_len + tile_start - q_begin  # position of the tile's first token
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_segment = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SEGMENTS)
    tile_lo = segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [M] running max
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [M] running denominator
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)  # [M, D] running numerator
    if DOT_FP32:
        q = q.to(tl.float32)
    # --8<-- [start:full_diagonal]
    # NOTE 4: full tiles first (no key can be masked), then the diagonal ones (masked).
    num_full = _num_full_kv_tiles(first_pos, kv_len, TILE_N)
    for j in range(tile_lo, tl.minimum(tile_hi, num_full)):
        m, l, acc = _attend_kv_tile(
            q, m, l, acc, j, kv_len, q_pos, scale, block_table_ptr + r * stride_bt_r,
            key_cache_ptr + kv_head * stride_k_h, value_cache_ptr + kv_head * stride_v_h,
            stride_k_b, stride_k_s, stride_v_b, stride_v_s,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, False, DOT_FP32, INPUT_PRECISION,
        )  # fmt: skip
    for j in range(tl.maximum(tile_lo, num_full), tile_hi):
        m, l, acc = _attend_kv_tile(
            q, m, l, acc, j, kv_len, q_pos, scale, block_table_ptr + r * stride_bt_r,
            key_cache_ptr + kv_head * stride_k_h, value_cache_ptr + kv_head * stride_v_h,
            stride_k_b, stride_k_s, stride_v_b, stride_v_s,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, True, DOT_FP32, INPUT_PRECISION,
        )  # fmt: skip
    # --8<-- [end:full_diagonal]

    if NUM_SEGMENTS == 1:
        o = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # padding rows: 0 / 1
        o_ptrs = out_ptr + token[:, None] * stride_o_n + head[:, None] * stride_o_h + dims[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part = (token * num_heads + head).to(tl.int64) * NUM_SEGMENTS + segment  # [M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_SIZE + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_max_ptr + part, m, mask=row_valid)
        tl.store(part_sum_ptr + part, l, mask=row_valid)
# --8<-- [end:kernel]


# --8<-- [start:merge]
@triton.jit
def _merge_segments_kernel(
    out_ptr,  # *T, [N, H, D]: the result
    part_acc_ptr,  # *fp32, [N, H, NUM_SEGMENTS, D]: unnormalised segment outputs
    part_max_ptr,  # *fp32, [N, H, NUM_SEGMENTS]: segment maxima m_s
    part_sum_ptr,  # *fp32, [N, H, NUM_SEGMENTS]: segment denominators l_s
    stride_o_n, stride_o_h,  # out strides: between tokens, between heads
    num_heads,  # H
    NUM_SEGMENTS: tl.constexpr,  # segments per request (a power of two)
    HEAD_SIZE: tl.constexpr,  # D
):
    """One program per (token, head): with ``M = max_s m_s`` and ``w_s = exp(m_s - M)``,
    ``out = sum_s w_s * acc_s / sum_s w_s * l_s``. Empty segments have ``m_s = -inf`` and
    weigh 0; a row with no keys at all (padding) gets 0."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)  # [NSEG]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    base = (token * num_heads + head).to(tl.int64) * NUM_SEGMENTS
    m = tl.load(part_max_ptr + base + segs)  # [NSEG]
    l = tl.load(part_sum_ptr + base + segs)  # [NSEG]
    acc = tl.load(part_acc_ptr + (base + segs[:, None]) * HEAD_SIZE + dims[None, :])  # [NSEG, D]
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # [NSEG]
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)  # [D]
    tl.store(out_ptr + token * stride_o_n + head * stride_o_h + dims, o.to(out_ptr.dtype.element_ty))
# --8<-- [end:merge]


def _check_attention_args(query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out):
    if query.dim() != 3:
        raise ValueError(f"query {tuple(query.shape)} must be [N, H, D]")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "must both be [num_blocks, block_size, Hkv, D]"
        )
    num_heads, head_size = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if key_cache.shape[3] != head_size:
        raise ValueError(f"cache head size {key_cache.shape[3]} != query head size {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    if head_size < 16 or head_size & (head_size - 1):
        raise ValueError(f"head size {head_size} must be a power of two >= 16")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size {block_size} must be a power of two >= 16")
    if query.dtype not in SUPPORTED_DTYPES or not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"query {query.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}: "
            f"must be one dtype among {SUPPORTED_DTYPES}"
        )
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} must be [R] and query_start_loc "
            f"{tuple(query_start_loc.shape)} must be [R + 1]"
        )
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [R, max_blocks] with R = {num_reqs}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} dtype {t.dtype} must be torch.int32")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table strides {block_table.stride()} must be unit along max_blocks")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("query_start_loc and seq_lens must be contiguous")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match query {tuple(query.shape)} {query.dtype}")
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    tensors |= {} if out is None else {"out": out}
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")
    all_tensors = [*tensors.values(), query_start_loc, seq_lens, block_table]
    devices = {t.device for t in all_tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    if not triton_can_run_on(query.device):
        raise ValueError(f"device {query.device}: Triton needs CUDA or TRITON_INTERPRET=1")


def _check_launch_overrides(block_m, num_warps, num_stages) -> None:
    """The sweepable launch choices (NOTE 5): each None (the default) or a legal value."""
    for name, value in (("block_m", block_m), ("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m {block_m} must be a power of two >= 16")
    if num_warps is not None and num_warps not in NUM_WARPS_CHOICES:
        raise ValueError(f"num_warps {num_warps} must be one of {NUM_WARPS_CHOICES}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages {num_stages} must be >= 1 (1: no software pipelining)")


# --8<-- [start:launcher]
def paged_attention(
    query: torch.Tensor,  # [N, H, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [N, H, D]
    *,
    num_segments: int | None = None,  # None: choose_num_segments; 1: no split
    kv_tile: int | None = None,  # keys per KV tile; None: choose_kv_tile
    block_m: int | None = None,  # rows per query tile (target); None: choose_query_tile
    num_warps: int | None = None,  # None: choose_launch_options
    num_stages: int | None = None,  # software-pipelining depth; None: choose_launch_options
) -> torch.Tensor:
    """Causal paged attention with the Triton kernel; same contract as the reference. The
    keyword overrides exist so that ``bench/attention.py`` can sweep tile shapes (NOTE 5)."""
    _check_attention_args(query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out)
    _check_launch_overrides(block_m, num_warps, num_stages)
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if num_segments is None:
        num_segments = choose_num_segments(num_tokens, num_reqs, num_kv_heads, block_table.shape[1] * block_size)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments {num_segments} must be a power of two >= 1")
    decode_only = num_tokens == num_reqs
    kv_tile = choose_kv_tile(decode_only) if kv_tile is None else kv_tile
    if kv_tile < 16 or kv_tile & (kv_tile - 1):
        raise ValueError(f"kv_tile {kv_tile} must be a power of two >= 16")
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    block_q, block_m = choose_query_tile(group, decode_only=decode_only, rows=block_m)
    warps, stages = choose_launch_options(decode_only)
    num_warps = warps if num_warps is None else num_warps
    num_stages = stages if num_stages is None else num_stages
    interpreting = query.device.type != "cuda"
    part_shape = (num_tokens, num_heads, num_segments) if num_segments > 1 else (1, 1, 1)
    part_acc = query.new_empty((*part_shape, head_size), dtype=torch.float32)  # [N, H, NSEG, D]
    part_max = query.new_empty(part_shape, dtype=torch.float32)  # [N, H, NSEG]
    part_sum = query.new_empty(part_shape, dtype=torch.float32)  # [N, H, NSEG]
    grid = (cdiv(num_tokens, block_q) + num_reqs, num_kv_heads, num_segments)  # NOTE 1
    _paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum, query, key_cache, value_cache,
        query_start_loc, seq_lens, block_table, scale, num_tokens, num_reqs, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        QUERIES_PER_KV=group, BLOCK_SIZE=block_size, TILE_N=kv_tile, HEAD_SIZE=head_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, NUM_SEGMENTS=num_segments,
        DOT_FP32=interpreting or query.dtype == torch.float32,
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1), num_heads,
            NUM_SEGMENTS=num_segments, HEAD_SIZE=head_size,
        )  # fmt: skip
    return out
# --8<-- [end:launcher]
