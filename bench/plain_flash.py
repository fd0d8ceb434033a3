"""A baseline for the prefill sweep: the plainest causal flash attention Triton compiles.

What it is: one sequence, ``q`` ``[L, H, D]`` and ``k``, ``v`` ``[L, Hkv, D]`` contiguous, a
program per (query tile, query head), the online softmax in float32 and base 2, the keys
before the tile's first row in unmasked tiles and the diagonal ones masked, the longest tiles
started first. None of the paged kernel's features: no block table, no cache, no batch of
requests, no query heads packed into one tile, no split. It is written here, from the
algorithm (FlashAttention-2's forward), to answer one question on a GPU: how close to SDPA does
Triton itself get at these shapes? ``bench/attention.py --prefill-sweep`` times it at the
longest length beside the paged kernel's configs and SDPA, in the same run
(``plain_flash_*`` in each shape's longest row): if the plain kernel is far from SDPA too,
the prefill goal is set by what Triton compiles for this GPU; if it is close, the paged
kernel's own work is the gap, and ``bench/attention_sass.py`` counts it (the two kernels'
loops, one config, side by side).

Not used by the engine. ``BLOCK_M`` must be a multiple of ``BLOCK_N`` (the diagonal tiles
start at the tile's first row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# (rows per query tile, keys per KV tile, warps, stages): the kinds of config Triton's
# fused-attention tutorial autotunes its forward over, for head size 128.
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)]


@triton.jit
def _tile_step(q, k_ptrs, v_ptrs, m, l, acc, scale, mask, MASKED: tl.constexpr):
    """One KV tile: scores, the online softmax update, ``acc += p @ v`` (all float32)."""
    k = tl.load(k_ptrs)  # [D, BLOCK_N]
    s = tl.dot(q, k) * scale  # [BLOCK_M, BLOCK_N], base-2 units
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs)  # [BLOCK_N, D]
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def _plain_causal_flash_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # q, out [L, H, D]; k, v [L, Hkv, D]; contiguous along D
    seq_len, scale,  # scale: softmax scale * log2(e)
    stride_q_n, stride_q_h, stride_k_n, stride_k_h, stride_v_n, stride_v_h, stride_o_n, stride_o_h,
    GROUP: tl.constexpr,  # H // Hkv
    HEAD_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (query tile, head): the tiles before the query tile unmasked, the diagonal masked."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest tiles first
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    keys = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    q = tl.load(q_ptr + rows[:, None] * stride_q_n + head * stride_q_h + dims[None, :],
                mask=rows[:, None] < seq_len, other=0.0)  # fmt: skip
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], tl.float32)
    k_base = k_ptr + kv_head * stride_k_h + dims[:, None]  # [D, 1]
    v_base = v_ptr + kv_head * stride_v_h + dims[None, :]  # [1, D]
    for start_n in range(0, start_m, BLOCK_N):  # every key before the tile's first row: no mask
        cols = start_n + keys
        m, l, acc = _tile_step(q, k_base + cols[None, :] * stride_k_n, v_base + cols[:, None] * stride_v_n,
                               m, l, acc, scale, None, False)  # fmt: skip
    for start_n in range(start_m, start_m + BLOCK_M, BLOCK_N):  # the diagonal: causal and length masks
        cols = start_n + keys
        visible = (cols[None, :] <= rows[:, None]) & (cols[None, :] < seq_len)
        inside = cols < seq_len
        m, l, acc = _tile_step(q, k_base + tl.where(inside, cols, 0)[None, :] * stride_k_n,
                               v_base + tl.where(inside, cols, 0)[:, None] * stride_v_n, m, l, acc, scale, visible, True)  # fmt: skip
    out = acc / l[:, None]
    tl.store(out_ptr + rows[:, None] * stride_o_n + head * stride_o_h + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] < seq_len)  # fmt: skip


def plain_causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 128, block_n: int = 64,
                       num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:  # fmt: skip
    """Causal attention of one sequence: ``q`` [L, H, D], ``k``/``v`` [L, Hkv, D] -> [L, H, D]."""
    seq_len, heads, head_size = q.shape
    if k.shape != v.shape or k.shape[0] != seq_len or heads % k.shape[1] or block_m % block_n:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, block_m {block_m}, "
                         f"block_n {block_n}: need one length, H a multiple of Hkv, block_m a multiple of block_n")  # fmt: skip
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k and v must be contiguous along D")
    out = torch.empty_like(q)
    _plain_causal_flash_kernel[(triton.cdiv(seq_len, block_m), heads)](
        q, k, v, out, seq_len, head_size**-0.5 * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), GROUP=heads // k.shape[1], HEAD_SIZE=head_size,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
