"""Paged attention batched for torch's SDPA: the default attention backend on the CPU.

Concept: the same math and signature as ``reference.paged_attention``, computed with few
large torch ops instead of about fifteen small ones per request. The batch is split by
query length. Requests with one query token (decodes) go together: one gather for the
keys and one for the values pull them out of the paged cache, through the block table,
into padded ``[R, L, Hkv, D]`` tensors (``L`` the longest of their lengths), and one call
to ``torch.nn.functional.scaled_dot_product_attention`` (SDPA) attends over them, with a
key-padding mask hiding each request's positions past its own length. Each request with
more than one query token (a prefill or a chunk of one) gets its own gather and SDPA call,
with a causal mask aligned to the end of its keys (NOTE 1). Requests with no query tokens
are skipped. A pure decode batch thus costs about twenty small torch ops and one SDPA call
per layer, whatever R is.

Follows: seed 003 "KV cache物理内存分配" (the per-layer cache ``(2, num_blocks, block_size,
num_kv_heads, head_size)``; attention finds each request's blocks in the attention
metadata); seed 000 "Attention 后端对 CUDA 图的兼容性" (declares ``NEVER``, see below).
Cousin of: vLLM's CPU backend ``TorchSDPABackend`` (``vllm/attention/backends/torch_sdpa.py``
in V0, ``vllm/v1/attention/backends/cpu_attn.py`` in V1), which also runs prompts through
torch SDPA but decodes with a paged-attention C++ kernel; here decodes use SDPA too, after
the gather.

Invariants: the result has the query's shape and dtype and matches the reference within
float32 rounding (both compute in float32 and cast the result back); rows at and after
``query_start_loc[-1]`` are CUDA-graph padding and are set to zero; every cache slot read
belongs to its request and lies before its length (NOTE 2), so whatever the other slots
hold (stale keys, NaN) never reaches the result.

NOTE 1 (the causal mask of a chunk): query token j of a request with q query tokens and
L keys sits at position ``L - q + j`` and may read keys ``0 .. L - q + j``. SDPA's
``is_causal=True`` aligns the mask top-left (token j reads keys ``0 .. j``), which is right
only when ``q == L``, a whole prompt at once. A later chunk of a chunked prefill has
``q < L`` and gets an explicit boolean mask, ``causal_mask(q, L)``.
NOTE 2 (padded gather): the decode gather reads ``L`` slots for every request, more than
a short request owns. Position ``p`` of a request of length ``n`` reads the slot of
position ``min(p, n - 1)``, one of its own, and the key-padding mask drops every
``p >= n``. So no slot of another request, nor an unused one, is read, and block-table
entries past a request's own blocks are never looked at.
NOTE 3 (GQA): with ``enable_gqa=True`` (torch 2.5 and later) SDPA lets query head h read KV
head ``h // (H // Hkv)`` itself. Older torch gets the KV heads expanded, which copies them
``H // Hkv`` times (``expand_kv_heads``).
NOTE 4 (a reused gather buffer): a decode gather is large (32 requests of 288 tokens with
4 KV heads of 64 floats: 9.4 MB each for K and V), and a fresh tensor that large gets
fresh pages from the operating system, which the copy then faults in one by one. On a
two-core VM that was 4,500 page faults per call and made the call 2.6 times slower. So
the gather writes into a buffer that each thread keeps and reuses (one per device, dtype
and inference mode), grown to a power of two elements when too small. It holds as many
bytes as the largest decode gather so far, about one layer's share of the running
requests' KV cache.

Not CUDA-graph safe (``NEVER``): the split by query length and the width ``L`` come from
``query_start_loc`` and ``seq_lens`` read on the host (``.tolist()``), which a graph cannot
capture; its KV writer (``write_kv_cache_torch``) indexes with a boolean mask.

Left out: sliding windows, ALiBi, soft-capping, sinks, fp8 caches, cross-attention;
batching prefills together (each runs alone); bounding the decode gather, which holds all
decodes' keys and values at once (NOTE 4); freeing the gather buffers; gradients through
the decode gather (it writes into a buffer with ``out=``, which autograd refuses).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.core.kv_cache_manager import cdiv

# Seed 000 "Attention 后端对 CUDA 图的兼容性": query lengths and sequence lengths are read on
# the host to split the batch and size the gather, which a CUDA graph cannot capture.
CUDAGRAPH_SUPPORT = AttentionCGSupport.NEVER

# NOTE 3: SDPA takes ``enable_gqa`` from torch 2.5 on.
SDPA_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

# NOTE 4: each thread's reusable gather buffers, keyed by (name, device, dtype, whether
# inference mode is on: a tensor made under it cannot be written outside it).
_scratch = threading.local()


# --8<-- [start:helpers]
def decode_slots(
    block_table: torch.Tensor,  # [R, max_blocks] int32
    seq_lens: torch.Tensor,  # [R] int32, each >= 1
    block_size: int,
    width: int,  # L, at least max(seq_lens)
) -> torch.Tensor:  # [R, L] int64
    """The cache slot (``block * block_size + offset``) of positions ``0 .. L-1`` of each
    request; positions at or past a request's length repeat its last slot (NOTE 2)."""
    positions = torch.arange(width, device=seq_lens.device)  # [L]
    last = (seq_lens.long() - 1).clamp(min=0)  # [R]
    clamped = torch.minimum(positions[None, :], last[:, None])  # [R, L]
    blocks = block_table.gather(1, clamped // block_size).long()  # [R, L]
    return blocks * block_size + clamped % block_size


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
    rows: torch.Tensor,  # [B * S, Hkv, D]: a cache viewed as one row per slot
    slots: torch.Tensor,  # [n] int64
    name: str,  # which buffer: "key" or "value"
) -> torch.Tensor:  # [n, Hkv, D]
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


# --8<-- [start:decode]
def decode_attention(
    query: torch.Tensor,  # [R, H, D]: one token per request
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    seq_lens: torch.Tensor,  # [R] int32, each >= 1
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    width: int,  # L = max(seq_lens)
) -> torch.Tensor:  # [R, H, D] float32
    """R decode tokens at once: one gather of K/V through the block table, one SDPA call."""
    num_reqs = query.shape[0]
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    slots = decode_slots(block_table, seq_lens, key_cache.shape[1], width).flatten()  # [R * L]
    k = gather_rows(key_cache.flatten(0, 1), slots, "key")  # [R * L, Hkv, D]
    v = gather_rows(value_cache.flatten(0, 1), slots, "value")  # [R * L, Hkv, D]
    k = k.view(num_reqs, width, num_kv_heads, head_size).transpose(1, 2).float()  # [R, Hkv, L, D]
    v = v.view(num_reqs, width, num_kv_heads, head_size).transpose(1, 2).float()  # [R, Hkv, L, D]
    mask = key_padding_mask(seq_lens, width)[:, None, None, :]  # [R, 1, 1, L]
    q = query.float().unsqueeze(2)  # [R, H, 1, D]
    return sdpa(q, k, v, scale, attn_mask=mask).squeeze(2)  # [R, H, D]
# --8<-- [end:decode]


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
) -> torch.Tensor:
    """Causal paged attention; returns ``out`` (allocated if None), shaped like ``query``.
    Decodes run batched, each longer request alone; padding rows get zeros."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of KV heads {num_kv_heads}")
    out = torch.empty_like(query) if out is None else out
    starts = query_start_loc.tolist()  # host reads: CUDAGRAPH_SUPPORT is NEVER
    lens = seq_lens.tolist()
    num_reqs = len(lens)
    decodes = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
    if len(decodes) == num_reqs and num_reqs:  # a pure decode batch: rows 0 .. R-1, no index
        out[:num_reqs] = decode_attention(
            query[:num_reqs], key_cache, value_cache, seq_lens, block_table, scale, max(lens)
        )  # fmt: skip
    elif decodes:  # decodes among prefills: pick their rows and requests out
        rows = torch.tensor([starts[r] for r in decodes], device=query.device)  # [R_dec]
        reqs = torch.tensor(decodes, device=query.device)  # [R_dec]
        o = decode_attention(
            query.index_select(0, rows), key_cache, value_cache, seq_lens.index_select(0, reqs),
            block_table.index_select(0, reqs), scale, max(lens[r] for r in decodes),
        )  # fmt: skip
        out.index_copy_(0, rows, o.to(out.dtype))
    block_size = key_cache.shape[1]
    for r in range(num_reqs):
        start, end = starts[r], starts[r + 1]
        if end - start > 1:
            blocks = block_table[r, : cdiv(lens[r], block_size)]
            out[start:end] = prefill_attention(query[start:end], key_cache, value_cache, blocks, lens[r], scale)
    out[starts[-1] :] = 0  # CUDA-graph padding rows
    return out
# --8<-- [end:paged_attention]
