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
NOTE 4 (a launch plan per step): the checks of the step's metadata, the tile and split
choices, the grid, the constexprs and the partial-result buffers depend on the step and the
model's ``AttentionLayout``, not on the layer; ``plan_step`` makes them once into a frozen
``LaunchPlan`` (the model calls it once per forward, as vLLM's ``TritonAttentionMetadataBuilder``
builds once per step) and each layer only checks its own tensors' shapes against it and
launches. Without a plan ``paged_attention`` makes one, so it keeps the reference's signature.
NOTE 5 (a pre-bound launch, opt-in): ``kernel[grid](...)`` binds the arguments, computes
Triton's specialization key (dtypes, 16-byte alignment, ints equal to 1 or divisible by 16)
and looks the compiled kernel up, on every call. With ``TINYVLLM_TRITON_LAUNCH=prebound`` on
CUDA the plan keeps, per key of what Triton specializes on (strides, pointer alignment), the
kernel ``JITFunction.warmup`` compiled and launches it directly. Triton has no supported API
for this (its ``CompiledKernel`` launch is internal, the same in 3.6 and 3.7), so the JIT
stays the default until a GPU run shows the gain (docs: Paged attention, "Host cost").

Left out: sliding windows, ALiBi, soft-capping, sinks, fp8 KV, head sizes that are not a
power of two, autotuning (one configuration per shape class).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.arith import cdiv
from tinyvllm.attention.metadata import AttentionLayout, AttentionMetadata
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
LAUNCH_ENV = "TINYVLLM_TRITON_LAUNCH"  # "prebound": NOTE 5's launch on CUDA; "jit" (unset): Triton's own
DECODE_KV_TILE = 32  # every request has one query token: bound by memory
PREFILL_KV_TILE = 32  # a batch with prompt rows: bound by arithmetic


# --8<-- [start:choose]
def choose_num_segments(num_tokens: int, num_reqs: int, num_kv_heads: int, max_context: int) -> int:
    """How many KV segments per request (NOTE 2): 16 for few, long, pure-decode requests."""
    decode_only = num_tokens == num_reqs
    few_programs = num_reqs * num_kv_heads < SPLIT_KV_MAX_PROGRAMS
    long_context = max_context >= SPLIT_KV_MIN_CONTEXT
    return SPLIT_KV_SEGMENTS if decode_only and few_programs and long_context else 1


def choose_query_tile(num_queries_per_kv: int, decode_only: bool) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)``: tokens per query tile and rows per tile (G heads per token).
    About 16 rows for decode (one token per request), 64 for prefill; ``tl.dot`` needs 16."""
    target_rows = 16 if decode_only else 64
    block_q = max(1, target_rows // num_queries_per_kv)
    return block_q, max(16, triton.next_power_of_2(block_q * num_queries_per_kv))


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
    ``-inf - -inf`` appears. Split path: the program covers only the tiles of its segment
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

    # Keys this tile can see: up to its last token's position (causal), at most seq_len.
    tile_end = tl.minimum(tile_start + BLOCK_Q, q_end)
    kv_len = tl.maximum(tl.minimum(seq_len, context_len + tile_end - q_begin), 0)
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_segment = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SEGMENTS)
    tile_lo = segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [M] running max
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [M] running denominator
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)  # [M, D] running numerator
    keys = tl.arange(0, TILE_N)  # [T]
    if DOT_FP32:
        q = q.to(tl.float32)
    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE_N + keys  # [T]
        k_valid = k_pos < kv_len  # [T]
        block_id = tl.load(block_table_ptr + r * stride_bt_r + k_pos // BLOCK_SIZE, mask=k_valid, other=0)  # [T]
        slot = k_pos % BLOCK_SIZE  # [T]
        k_row = block_id.to(tl.int64) * stride_k_b + slot * stride_k_s  # [T]
        v_row = block_id.to(tl.int64) * stride_v_b + slot * stride_v_s  # [T]
        k = tl.load(
            key_cache_ptr + k_row[None, :] + kv_head * stride_k_h + dims[:, None],
            mask=k_valid[None, :], other=0.0,
        )  # [D, T]  # fmt: skip
        v = tl.load(
            value_cache_ptr + v_row[:, None] + kv_head * stride_v_h + dims[None, :],
            mask=k_valid[:, None], other=0.0,
        )  # [T, D]  # fmt: skip
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=INPUT_PRECISION) * scale  # [M, T]
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [M, T]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [M]
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # [M]
        p = tl.exp(s - m_safe[:, None])  # [M, T]
        alpha = tl.exp(m - m_safe)  # [M]
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m = m_new

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


def _check_layer_tensors(query, key_cache, value_cache, out) -> AttentionLayout:
    """One layer's own tensors, in full; returns their layout for ``plan_step`` to check."""
    if query.dim() != 3:
        raise ValueError(f"query {tuple(query.shape)} must be [N, H, D]")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "must both be [num_blocks, block_size, Hkv, D]"
        )
    if key_cache.shape[3] != query.shape[2]:
        raise ValueError(f"cache head size {key_cache.shape[3]} != query head size {query.shape[2]}")
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"query {query.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}: "
            f"must be one dtype among {SUPPORTED_DTYPES}"
        )
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match query {tuple(query.shape)} {query.dtype}")
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    tensors |= {} if out is None else {"out": out}
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    _, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    return AttentionLayout(num_heads, num_kv_heads, head_size, block_size, query.dtype, query.device)


def _check_step(query_start_loc, seq_lens, block_table, layout: AttentionLayout) -> None:
    """What a step's plan rests on: the layout the kernel supports, the metadata's tensors."""
    if layout.num_heads % layout.num_kv_heads:
        raise ValueError(f"query heads {layout.num_heads} are not a multiple of KV heads {layout.num_kv_heads}")
    for name, size in (("head size", layout.head_size), ("block size", layout.block_size)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} {size} must be a power of two >= 16")
    if layout.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {layout.dtype} must be one dtype among {SUPPORTED_DTYPES}")
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
    devices = {layout.device, query_start_loc.device, seq_lens.device, block_table.device}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    if not triton_can_run_on(layout.device):
        raise ValueError(f"device {layout.device}: Triton needs CUDA or TRITON_INTERPRET=1")


# --8<-- [start:plan]
@dataclass(frozen=True)
class LaunchPlan:
    """One step's launch of the kernel, the same for every layer (NOTE 4): made by ``plan_step``."""

    query_start_loc: torch.Tensor  # [R + 1] int32: the step's metadata, which every layer passes
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    layout: AttentionLayout  # what every layer's query and cache look like
    num_tokens: int  # N: query rows, padding included
    grid: tuple[int, int, int]  # (tiles, Hkv, NUM_SEGMENTS), NOTE 1
    constexprs: dict[str, object]  # the kernel's compile-time parameters, in its order (never mutated)
    part_acc: torch.Tensor  # [N, H, NSEG, D] fp32, or [1, 1, 1, D] unused when NSEG == 1
    part_max: torch.Tensor  # [N, H, NSEG] fp32
    part_sum: torch.Tensor  # [N, H, NSEG] fp32
    launchers: dict | None = None  # NOTE 5: pre-bound launches by argument key, filled by the layers; None: JIT
    options: dict[str, object] = field(default_factory=dict)  # Triton's launch options (num_warps, ...), if any

    @property
    def num_segments(self) -> int:
        return self.grid[2]


def plan_step(
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    num_tokens: int,  # N: every layer's query rows, padding included
    layout: AttentionLayout,
    *,
    num_segments: int | None = None,  # None: choose_num_segments; 1: no split
    kv_tile: int | None = None,  # keys per KV tile; None: choose_kv_tile
) -> LaunchPlan:
    """Check the step's metadata and layout, choose the tiles and the split, size the grid and
    allocate the partial results: all that depends on the step, not the layer (NOTE 4)."""
    _check_step(query_start_loc, seq_lens, block_table, layout)
    num_reqs, num_kv_heads, block_size = seq_lens.shape[0], layout.num_kv_heads, layout.block_size
    if num_segments is None:
        num_segments = choose_num_segments(num_tokens, num_reqs, num_kv_heads, block_table.shape[1] * block_size)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments {num_segments} must be a power of two >= 1")
    decode_only = num_tokens == num_reqs
    kv_tile = choose_kv_tile(decode_only) if kv_tile is None else kv_tile
    if kv_tile < 16 or kv_tile & (kv_tile - 1):
        raise ValueError(f"kv_tile {kv_tile} must be a power of two >= 16")
    group = layout.num_heads // num_kv_heads
    block_q, block_m = choose_query_tile(group, decode_only=decode_only)
    fp32 = layout.dtype == torch.float32
    constexprs = dict(
        QUERIES_PER_KV=group, BLOCK_SIZE=block_size, TILE_N=kv_tile, HEAD_SIZE=layout.head_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, NUM_SEGMENTS=num_segments,
        DOT_FP32=layout.device.type != "cuda" or fp32, INPUT_PRECISION="ieee" if fp32 else "tf32",
    )  # fmt: skip
    launch = os.environ.get(LAUNCH_ENV, "jit")
    if launch not in ("jit", "prebound"):
        raise ValueError(f"{LAUNCH_ENV}={launch!r}: must be 'jit' or 'prebound'")
    part_shape = (num_tokens, layout.num_heads, num_segments) if num_segments > 1 else (1, 1, 1)
    new = dict(dtype=torch.float32, device=layout.device)
    return LaunchPlan(
        query_start_loc, seq_lens, block_table, layout, num_tokens,
        grid=(cdiv(num_tokens, block_q) + num_reqs, num_kv_heads, num_segments),  # NOTE 1
        constexprs=constexprs, part_acc=torch.empty((*part_shape, layout.head_size), **new),
        part_max=torch.empty(part_shape, **new), part_sum=torch.empty(part_shape, **new),
        launchers={} if launch == "prebound" and layout.device.type == "cuda" else None,
    )  # fmt: skip


def plan_from_metadata(meta: AttentionMetadata, layout: AttentionLayout) -> LaunchPlan:
    """``plan_step`` over a step's attention metadata (what the model calls once per step)."""
    return plan_step(meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_padded_tokens, layout)


def _check_against_plan(plan: LaunchPlan, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out):
    """A layer's own tensors against the step's plan: shapes, dtypes, devices and the unit
    stride along D, no more (NOTE 4). A mismatch is a ValueError naming both."""
    layout = plan.layout
    given = (query_start_loc, seq_lens, block_table)
    if any(a is not b for a, b in zip(given, (plan.query_start_loc, plan.seq_lens, plan.block_table))):
        raise ValueError("query_start_loc, seq_lens and block_table must be the tensors the plan was made from")
    want = (plan.num_tokens, layout.num_heads, layout.head_size)
    if query.shape != want or query.dtype != layout.dtype or query.device != layout.device:
        raise ValueError(f"query {tuple(query.shape)} {query.dtype} on {query.device}: the plan is for {want} "
                         f"{layout.dtype} on {layout.device}")  # fmt: skip
    cache = (layout.block_size, layout.num_kv_heads, layout.head_size)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        shape = t.shape
        if len(shape) != 4 or shape[1:] != cache or t.dtype != layout.dtype or t.device != layout.device:
            raise ValueError(f"{name} {tuple(shape)} {t.dtype} on {t.device}: the plan is for "
                             f"[num_blocks, *{cache}] {layout.dtype} on {layout.device}")  # fmt: skip
    if out is not None and (out.shape != want or out.dtype != layout.dtype or out.device != layout.device):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} must match query {want} {layout.dtype}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if t is not None and t.stride()[-1] != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")
# --8<-- [end:plan]


def prebound_launcher(plan: LaunchPlan, args: tuple) -> Callable[..., None]:
    """The compiled kernel for these arguments (``JITFunction.warmup`` compiles or finds it,
    launching nothing), as a launcher that takes every parameter in order (NOTE 5)."""
    names = _paged_attention_kernel.arg_names[len(args) :]
    if names != list(plan.constexprs):
        raise RuntimeError(f"the kernel's parameters after its {len(args)} arguments are {names}, "
                           f"not the plan's constexprs {list(plan.constexprs)}")  # fmt: skip
    return _paged_attention_kernel.warmup(*args, grid=plan.grid, **plan.constexprs, **plan.options)[plan.grid]


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
    num_segments: int | None = None,  # None: choose_num_segments; 1: no split (without a plan)
    kv_tile: int | None = None,  # keys per KV tile; None: choose_kv_tile (without a plan)
    plan: LaunchPlan | None = None,  # the step's (NOTE 4); made here when not given
) -> torch.Tensor:
    """Causal paged attention with the Triton kernel; same contract as the reference."""
    if plan is None:
        layout = _check_layer_tensors(query, key_cache, value_cache, out)
        plan = plan_step(query_start_loc, seq_lens, block_table, query.shape[0], layout,
                         num_segments=num_segments, kv_tile=kv_tile)  # fmt: skip
    elif num_segments is not None or kv_tile is not None:
        raise ValueError(f"num_segments {num_segments} and kv_tile {kv_tile}: give them to plan_step, not with a plan")
    else:
        _check_against_plan(plan, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out)
    out = torch.empty_like(query) if out is None else out
    if plan.num_tokens == 0:
        return out
    layout, q_stride, o_stride = plan.layout, query.stride(), out.stride()
    k_stride, v_stride = key_cache.stride(), value_cache.stride()  # one call each: stride(i) is slower
    args = (
        out, plan.part_acc, plan.part_max, plan.part_sum, query, key_cache, value_cache,
        plan.query_start_loc, plan.seq_lens, plan.block_table, scale, plan.num_tokens, plan.seq_lens.shape[0],
        layout.num_heads, q_stride[0], q_stride[1], o_stride[0], o_stride[1],
        k_stride[0], k_stride[1], k_stride[2], v_stride[0], v_stride[1], v_stride[2],
        plan.block_table.stride()[0],
    )  # fmt: skip
    if plan.launchers is None:
        _paged_attention_kernel[plan.grid](*args, **plan.constexprs, **plan.options)  # the JIT: binds, keys, finds
    else:
        aligned = tuple(t.data_ptr() % 16 for t in (out, query, key_cache, value_cache))
        key = (q_stride, o_stride, k_stride, v_stride, aligned)
        launch = plan.launchers.get(key)
        if launch is None:  # NOTE 5: the same arguments Triton would specialize on, compiled once a step
            launch = plan.launchers[key] = prebound_launcher(plan, args)
        launch(*args, *plan.constexprs.values())
    if plan.num_segments > 1:
        _merge_segments_kernel[(plan.num_tokens, layout.num_heads)](
            out, plan.part_acc, plan.part_max, plan.part_sum, o_stride[0], o_stride[1], layout.num_heads,
            NUM_SEGMENTS=plan.num_segments, HEAD_SIZE=layout.head_size,
        )  # fmt: skip
    return out
# --8<-- [end:launcher]
