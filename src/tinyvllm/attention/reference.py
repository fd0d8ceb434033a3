"""Paged attention in plain torch: the executable specification.

Concept: ``query`` holds the new tokens of R requests back to back (``query_start_loc``);
each request's keys and values live in the paged cache, in the blocks its row of
``block_table`` lists. Query token j of request r sits at position
``seq_lens[r] - query_len[r] + j`` and attends causally to every cached position up to and
including its own. Query head h reads KV head ``h // (H // Hkv)`` (grouped-query attention).
One loop over requests: gather the request's K/V through its block table, then ordinary
masked softmax attention in float32. Short and obviously right, not fast.

Follows: seed 003 "KV cache物理内存分配" (the per-layer cache ``(2, num_blocks, block_size,
num_kv_heads, head_size)``; attention reads block ids from the attention metadata).
Mirrors: the math of ``vllm/attention/ops/triton_unified_attention.py``, without its tiling.

Invariants: the result has the query's shape and dtype; rows at and after
``query_start_loc[-1]`` are CUDA-graph padding and are set to zero.

Left out: sliding windows, ALiBi, soft-capping, sinks, fp8 caches, cross-attention.
"""

from __future__ import annotations

import torch

from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.arith import cdiv

# Seed 000 "Attention 后端对 CUDA 图的兼容性": the loop over requests reads ``seq_lens`` and
# ``query_start_loc`` on the host (``.tolist()``), which a CUDA graph cannot capture.
CUDAGRAPH_SUPPORT = AttentionCGSupport.NEVER


# --8<-- [start:reference]
def paged_attention(
    query: torch.Tensor,  # [N, H, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [N, H, D]
) -> torch.Tensor:
    """Causal paged attention; returns ``out`` (allocated if None), shaped like ``query``."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    block_size = key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[r] : starts[r + 1]].float()  # [q, H, D]
        blocks = block_table[r, : cdiv(seq_len, block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].float()  # [L, Hkv, D]
        v = value_cache[blocks].flatten(0, 1)[:seq_len].float()  # [L, Hkv, D]
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)  # [L, H, D]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)  # [q]
        k_pos = torch.arange(seq_len, device=q.device)  # [L]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q, L]
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [H, q, L]
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    out[starts[-1] :] = 0  # CUDA-graph padding rows
    return out
# --8<-- [end:reference]
