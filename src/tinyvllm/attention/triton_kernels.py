"""The Triton kernels of paged attention: the unified kernel and the merge of split-KV segments.

Concept: the device code alone, as ``@triton.jit`` functions; ``triton_attention.py`` chooses
the tiles, plans each step's launch and launches them (its header has the mechanism: query
tiles of ``BLOCK_Q`` tokens times ``G`` heads, KV tiles of ``TILE_N`` keys gathered through
the block table, the online softmax, the split-KV path and its merge, full and diagonal KV
tiles, the step's own keys read from its rows). ``_paged_attention_kernel`` computes one
(query tile, KV head, segment); ``_merge_segments_kernel`` combines a split request's
segments; ``_cached_kv_tile`` and ``_step_kv_tile`` load a KV tile from the cache or from the
step's rows, ``_attend_kv_tile`` folds one into the online softmax, ``_attend_cached_keys``
and ``_attend_step_keys`` walk the full tiles then the diagonal ones.

Mirrors: ``vllm/attention/ops/triton_unified_attention.py`` (``kernel_unified_attention_2d``,
``_3d`` and ``reduce_segments``).

Invariants: what ``triton_attention.py`` states for the kernel (identical results to the
reference within the dtype's tolerance, every output row written, a grid that depends on
shapes only); every parameter after the tensors' strides is a ``tl.constexpr``, in the order
the launch plan passes them (``triton_attention.py`` NOTE 5).

NOTE 1 (the step's own keys): a request's keys this step are rows ``q_begin .. q_end - 1``
of the ``key``/``value`` the layer just wrote into the cache, so with ``STEP_KV`` the kernel
reads only the context (positions before ``context_len``, visible to every row) through the
block table, and the step's keys from those rows: key ``u`` of the step is visible to row
``t`` when ``u <= t``. Why: rows at a fixed stride need no block id, so the step's whole walk
is one software pipeline with no id to gather (NOTE 3) and fewer instructions a tile, and a
fresh prompt's prefill reads the cache not at all (FlashInfer's ragged prefill; vLLM's MLA
backends split the context and the new tokens the same way). Not on the split-KV path: it
serves decode, whose one new key is not worth a second walk.
NOTE 2 (base-2 units): scores are scaled by ``scale * log2(e)`` and exponentiated with
``exp2``, the hardware's own exponential: ``exp(x) == exp2(x * log2(e))``. The scale is taken
into the exponent's argument, ``exp2(s * c - m)``, one fused multiply-add a score, and into the
row max as ``max(s) * c`` (the same value for ``c > 0``), as Triton's fused-attention tutorial
does. The running maxima (and the split path's stored ones) are in base-2 units.
NOTE 3 (block ids outside the copies' pipeline): in the cache walk a key's address needs its
block id; loaded in the tile's own iteration, it is a load the K/V loads wait on, and Triton's
pipeliner then drains every copy in flight before each tile (``cp.async.wait_group 0``):
no load overlaps the tile before it. So the full tiles go in groups of
``ID_GROUP``: one load brings the group's block ids into registers before the group's loop,
and each tile picks its keys' ids with ``tl.gather``, arithmetic on registers. The loop over
the group's tiles loads nothing but K and V, and keeps copies in flight; each group starts its
pipeline anew. ``ID_GROUP * cdiv(TILE_N, BLOCK_SIZE)`` ids cover a group even when its first
tile starts inside a block. The few diagonal tiles still load their ids.
NOTE 4 (tensor descriptors, ``KV_DESC``): the step's full tiles (NOTE 1) can be loaded through
host-made tensor descriptors of ``key``/``value`` seen as ``[N, Hkv * D]``: the tile of rows
``q_begin + j * TILE_N ..`` at column ``kv_head * D``, one ``[TILE_N, D]`` box. On sm_90 a
descriptor load is one TMA copy that a single thread issues and an mbarrier completes: no
thread computes an address, no register holds one, and Triton pipelines the copies over
mbarriers rather than ``cp.async`` groups (Triton's fused-attention tutorial loads its K and V
this way on Hopper). Before sm_90 Triton lowers it to ordinary loads. Only full tiles: a box
reads whole rows, so the diagonal tiles, whose rows past the request may be another
request's or padding (NaN, say, which ``0 * NaN`` would spread), keep their masked loads.
NOTE 5 (work the pipeliner does past a loop's end): for ``num_stages`` s, Triton computes the
addresses of tiles ``j + 1 .. j + s - 1`` ahead and masks only the copies, so anything that
indexes on-chip memory must stay in bounds for tiles past the loop: a gather index outside the
group's ids read shared memory out of range (an illegal address on an H200, float16 tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyvllm.dependent_launch import wait_for_the_kernel_ahead

ID_GROUP = tl.constexpr(16)  # full KV tiles whose block ids one load brings (NOTE 3)


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
    first token sits at ``first_pos`` and which sees ``kv_len`` keys (``triton_attention.py`` NOTE 6): all their
    keys are ``<= first_pos`` and ``< kv_len``. Tile ``n`` on is diagonal (masked)."""
    return tl.maximum(tl.minimum(first_pos + 1, kv_len), 0) // TILE_N
# --8<-- [end:num_full]


@triton.jit
def _load_kv(k_ptrs, v_ptrs, valid, MASKED: tl.constexpr):
    """A KV tile's keys ``[D, T]`` and values ``[T, D]``; ``MASKED``: zeros where not ``valid`` [T]."""
    if MASKED:
        return tl.load(k_ptrs, mask=valid[None, :], other=0.0), tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    return tl.load(k_ptrs), tl.load(v_ptrs)


@triton.jit
def _cached_kv_tile(
    j, kv_len, block_id,  # the KV tile's index (keys ``j*TILE_N ..``); keys the query tile may see; [T] their blocks
    key_head_ptr, value_head_ptr,  # the caches at the KV head
    stride_k_b, stride_k_s, stride_v_b, stride_v_s,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_SIZE: tl.constexpr, MASKED: tl.constexpr,
):
    """KV tile ``j`` gathered from the paged cache, each key from its block ``block_id``:
    ``(k [D, T], v [T, D], k_pos [T], k_valid [T])``. ``MASKED`` tiles read no key past ``kv_len``."""
    keys = tl.arange(0, TILE_N)  # [T]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    k_pos = j * TILE_N + keys  # [T]
    k_valid = k_pos < kv_len  # [T]
    slot = k_pos % BLOCK_SIZE  # [T]
    k_ptrs = key_head_ptr + (block_id.to(tl.int64) * stride_k_b + slot * stride_k_s)[None, :] + dims[:, None]
    v_ptrs = value_head_ptr + (block_id.to(tl.int64) * stride_v_b + slot * stride_v_s)[:, None] + dims[None, :]
    k, v = _load_kv(k_ptrs, v_ptrs, k_valid, MASKED)
    return k, v, k_pos, k_valid


# --8<-- [start:step_tile]
@triton.jit
def _step_kv_tile(
    j, num_new,  # the tile's index among the step's keys; the request's keys this step
    key_rows_ptr, value_rows_ptr,  # the request's first row of this step's keys / values, at the KV head
    stride_kn_n, stride_vn_n,  # between rows (tokens) of key / value
    TILE_N: tl.constexpr, HEAD_SIZE: tl.constexpr, MASKED: tl.constexpr,
):
    """KV tile ``j`` of the keys this step computed (NOTE 1), read from
    the step's own key and value rows: consecutive rows, so the addresses advance by a fixed
    stride from tile to tile and the loads can be software-pipelined. Returns ``(k [D, T],
    v [T, D], u [T], u_valid [T])``, ``u`` the keys' indices among the step's keys."""
    keys = tl.arange(0, TILE_N)  # [T]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    u = j * TILE_N + keys  # [T]
    u_valid = u < num_new  # [T]
    k_ptrs = key_rows_ptr + (u.to(tl.int64) * stride_kn_n)[None, :] + dims[:, None]
    v_ptrs = value_rows_ptr + (u.to(tl.int64) * stride_vn_n)[:, None] + dims[None, :]
    k, v = _load_kv(k_ptrs, v_ptrs, u_valid, MASKED)
    return k, v, u, u_valid
# --8<-- [end:step_tile]


@triton.jit
def _attend_kv_tile(
    q, m, l, acc,  # [M, D] the query tile; [M], [M], [M, D] the running max, denominator, numerator
    k, v, visible,  # [D, T] keys, [T, D] values; [M, T] which keys each row sees (MASKED only)
    qk_scale,  # the softmax scale times log2(e): scores in base-2 units (NOTE 2)
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row (``triton_attention.py`` NOTE 6)
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One step of the online softmax over one KV tile: returns the updated ``(m, l, acc)``.
    ``MASKED`` tiles set invisible scores to ``-inf``; full tiles skip the mask and the
    ``-inf`` guard."""
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=INPUT_PRECISION)  # [M, T] unscaled: the scale goes into one fma below
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # [M]; scale > 0 keeps the max the max
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # [M]: a row with no key yet
    else:
        m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # [M]: finite, every key is visible
        m_safe = m_new
    p = tl.exp2(s * qk_scale - m_safe[:, None])  # [M, T]: a multiply-add a score
    alpha = tl.exp2(m - m_safe)  # [M]
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l, acc


# --8<-- [start:id_slots]
@triton.jit
def _id_slots(j, first_block, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """[T] where KV tile ``j``'s keys find their block ids among a group's ``ID_GROUP *
    cdiv(TILE_N, BLOCK_SIZE)`` (NOTE 3), the group's first block at ``first_block``. Clamped to
    the last: the pipeliner computes tile ``j + 1 ..`` ahead of its loop's end and only masks
    the copies, so a tile past the group must still gather inside it (NOTE 5)."""
    num_slots: tl.constexpr = ID_GROUP * ((TILE_N + BLOCK_SIZE - 1) // BLOCK_SIZE)
    return tl.minimum((j * TILE_N + tl.arange(0, TILE_N)) // BLOCK_SIZE - first_block, num_slots - 1)
# --8<-- [end:id_slots]


# --8<-- [start:full_diagonal]
@triton.jit
def _attend_cached_keys(
    q, m, l, acc, tile_lo, tile_hi, num_full, kv_len, q_pos, qk_scale,
    block_table_row_ptr, key_head_ptr, value_head_ptr, stride_k_b, stride_k_s, stride_v_b, stride_v_s,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """The KV tiles ``tile_lo .. tile_hi - 1`` from the paged cache: the full tiles before
    ``num_full`` unmasked, the diagonal ones after it masked (``triton_attention.py`` NOTE 6).
    The full tiles go in groups of ``ID_GROUP`` whose block ids are loaded before the group's
    loop, each tile taking its own with ``tl.gather`` (NOTE 3)."""
    keys = tl.arange(0, TILE_N)  # [T]
    hi = tl.minimum(tile_hi, num_full)
    num_blocks = tl.cdiv(hi * TILE_N, BLOCK_SIZE)  # the blocks the full tiles read
    for group in range(tile_lo, hi, ID_GROUP):
        first_block = group * TILE_N // BLOCK_SIZE
        index = first_block + tl.arange(0, ID_GROUP * ((TILE_N + BLOCK_SIZE - 1) // BLOCK_SIZE))  # [I] table columns
        ids = tl.load(block_table_row_ptr + index, mask=index < num_blocks, other=0)  # [I]: the group's block ids
        for j in range(group, tl.minimum(group + ID_GROUP, hi)):
            block_id = tl.gather(ids, _id_slots(j, first_block, TILE_N, BLOCK_SIZE), 0)  # [T]: no load
            k, v, k_pos, k_valid = _cached_kv_tile(
                j, kv_len, block_id, key_head_ptr, value_head_ptr, stride_k_b, stride_k_s, stride_v_b, stride_v_s,
                BLOCK_SIZE, TILE_N, HEAD_SIZE, False,
            )  # fmt: skip
            m, l, acc = _attend_kv_tile(q, m, l, acc, k, v, None, qk_scale, False, DOT_FP32, INPUT_PRECISION)
    for j in range(tl.maximum(tile_lo, num_full), tile_hi):
        k_pos = j * TILE_N + keys  # [T]
        block_id = tl.load(block_table_row_ptr + k_pos // BLOCK_SIZE, mask=k_pos < kv_len, other=0)  # [T]
        k, v, k_pos, k_valid = _cached_kv_tile(
            j, kv_len, block_id, key_head_ptr, value_head_ptr, stride_k_b, stride_k_s, stride_v_b, stride_v_s,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, True,
        )  # fmt: skip
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [M, T]
        m, l, acc = _attend_kv_tile(q, m, l, acc, k, v, visible, qk_scale, True, DOT_FP32, INPUT_PRECISION)
    return m, l, acc


@triton.jit
def _attend_step_keys(
    q, m, l, acc, t_first, t_end, num_new, t, qk_scale,  # t: [M] each row's index among the step's tokens
    key_rows_ptr, value_rows_ptr, stride_kn_n, stride_vn_n,
    key_desc, value_desc, desc_row, desc_col,  # NOTE 4 (KV_DESC): descriptors, the request's first row, the head's column
    TILE_N: tl.constexpr, HEAD_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    KV_DESC: tl.constexpr,
):
    """NOTE 1: the step's own keys, for query rows ``t_first .. t_end - 1``
    of the step's ``num_new``: the tiles of keys before row ``t_first`` unmasked, the diagonal
    ones (up to row ``t_end - 1``) masked. A spare tile (``t_end <= t_first``) sees none.
    ``KV_DESC``: the full tiles come through the tensor descriptors (NOTE 4)."""
    num_tiles = tl.where(t_end > t_first, tl.cdiv(t_end, TILE_N), 0)
    num_full = tl.minimum(tl.maximum(t_first + 1, 0) // TILE_N, num_tiles)
    for j in range(0, num_full):
        # --8<-- [start:kv_desc_load]
        if KV_DESC:
            k = tl.trans(key_desc.load([desc_row + j * TILE_N, desc_col]))  # [D, T]
            v = value_desc.load([desc_row + j * TILE_N, desc_col])  # [T, D]
        # --8<-- [end:kv_desc_load]
        else:
            k, v, u, u_valid = _step_kv_tile(j, num_new, key_rows_ptr, value_rows_ptr, stride_kn_n, stride_vn_n, TILE_N, HEAD_SIZE, False)
        m, l, acc = _attend_kv_tile(q, m, l, acc, k, v, None, qk_scale, False, DOT_FP32, INPUT_PRECISION)
    for j in range(num_full, num_tiles):
        k, v, u, u_valid = _step_kv_tile(j, num_new, key_rows_ptr, value_rows_ptr, stride_kn_n, stride_vn_n, TILE_N, HEAD_SIZE, True)
        visible = u_valid[None, :] & (u[None, :] <= t[:, None])  # [M, T]
        m, l, acc = _attend_kv_tile(q, m, l, acc, k, v, visible, qk_scale, True, DOT_FP32, INPUT_PRECISION)
    return m, l, acc
# --8<-- [end:full_diagonal]


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # *T, [N, H, D]: the result (written when NUM_SEGMENTS == 1)
    part_acc_ptr,  # *fp32, [N, H, NUM_SEGMENTS, D]: unnormalised segment outputs (split path)
    part_max_ptr,  # *fp32, [N, H, NUM_SEGMENTS]: each segment's running max m (split path)
    part_sum_ptr,  # *fp32, [N, H, NUM_SEGMENTS]: each segment's softmax denominator l
    query_ptr,  # *T, [N, H, D]: this step's queries, requests back to back
    key_cache_ptr,  # *T, [B, S, Hkv, D]: the layer's key cache
    value_cache_ptr,  # *T, [B, S, Hkv, D]: the layer's value cache
    key_ptr,  # *T, [N, Hkv, D]: this step's keys, as written to the cache (read when STEP_KV)
    value_ptr,  # *T, [N, Hkv, D]: this step's values (read when STEP_KV)
    key_desc,  # tensor descriptor of key as [N, Hkv * D], boxes [TILE_N, D] (KV_DESC, NOTE 4), else None
    value_desc,  # the same of value
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
    stride_kn_n, stride_kn_h, stride_vn_n, stride_vn_h,  # key / value strides: between tokens, between heads
    QUERIES_PER_KV: tl.constexpr,  # G = H // Hkv, query heads packed into one tile
    BLOCK_SIZE: tl.constexpr,  # S: tokens per cache block
    TILE_N: tl.constexpr,  # keys per KV tile (``triton_attention.py`` NOTE 3), a power of two >= 16
    HEAD_SIZE: tl.constexpr,  # D (a power of two)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # rows per tile, a power of two >= BLOCK_Q * G and >= 16
    NUM_SEGMENTS: tl.constexpr,  # 1: write out directly; > 1: write partials for the merge
    DOT_FP32: tl.constexpr,  # upcast operands to fp32 before tl.dot (interpreter, fp32 input)
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision for fp32 operands ("ieee" or "tf32")
    STEP_KV: tl.constexpr,  # the step's keys from key/value, the context's from the cache (NOTE 1)
    KV_DESC: tl.constexpr,  # the step's full tiles through key_desc/value_desc (NOTE 4); needs STEP_KV
    USE_PDL: tl.constexpr,  # programmatic dependent launch (dependent_launch.py): wait first
):
    """Causal attention for one (query tile, KV head, segment) of a paged batch.

    Row i of the tile is query token ``t = i // G`` with head ``kv_head * G + i % G``, at
    position ``pos[i] = context_len + t`` (``context_len = seq_len - query_len``). For each
    KV tile j (keys at positions ``j*TILE_N .. j*TILE_N + TILE_N - 1``) the scores
    ``s = scale * log2(e) * q @ K_j^T`` (base-2 units, NOTE 2) are masked to ``-inf`` where
    ``key_pos > pos[i]`` or ``key_pos >= seq_len``, and the online softmax updates, in float32,

        m_new = max(m, rowmax(s))
        p     = exp2(s - m_new)
        l     = l * exp2(m - m_new) + rowsum(p)
        acc   = acc * exp2(m - m_new) + p @ V_j
        m     = m_new

    starting from ``m = -inf, l = 0, acc = 0``; the output is ``acc / l``. A fully masked
    tile leaves ``m = -inf``; ``m_new`` is then replaced by 0 in the exponents so that no
    ``-inf - -inf`` appears. The leading full tiles (``triton_attention.py`` NOTE 6) skip the
    masks. ``STEP_KV`` (NOTE 1) reads the keys this step computed from ``key``/``value`` and
    only the context's from the cache. Split path: the program covers only the tiles of its
    segment and stores ``(acc, m, l)``; ``_merge_segments_kernel`` combines the segments.
    """
    wait_for_the_kernel_ahead(USE_PDL)
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

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [M] running max, base-2 units (NOTE 2)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # [M] running denominator
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)  # [M, D] running numerator
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2(e))
    table_row = block_table_ptr + r * stride_bt_r  # the request's block ids
    key_head, value_head = key_cache_ptr + kv_head * stride_k_h, value_cache_ptr + kv_head * stride_v_h
    tl.static_assert(STEP_KV or not KV_DESC, "KV_DESC loads the step's rows: it needs STEP_KV")
    if STEP_KV:  # NOTE 1: the context from the cache, the step's keys from its own rows
        tl.static_assert(NUM_SEGMENTS == 1, "STEP_KV needs one segment")
        context = tl.where(tile_start < q_end, tl.maximum(context_len, 0), 0)  # every row sees all of it
        m, l, acc = _attend_cached_keys(
            q, m, l, acc, 0, tl.cdiv(context, TILE_N), context // TILE_N, context, q_pos, qk_scale, table_row, key_head, value_head,
            stride_k_b, stride_k_s, stride_v_b, stride_v_s, BLOCK_SIZE, TILE_N, HEAD_SIZE, DOT_FP32, INPUT_PRECISION,
        )  # fmt: skip
        m, l, acc = _attend_step_keys(
            q, m, l, acc, tile_start - q_begin, tl.where(is_request, tile_end - q_begin, 0), q_end - q_begin, token - q_begin, qk_scale,
            key_ptr + q_begin.to(tl.int64) * stride_kn_n + kv_head * stride_kn_h,
            value_ptr + q_begin.to(tl.int64) * stride_vn_n + kv_head * stride_vn_h,
            stride_kn_n, stride_vn_n, key_desc, value_desc, q_begin, kv_head * HEAD_SIZE,
            TILE_N, HEAD_SIZE, DOT_FP32, INPUT_PRECISION, KV_DESC,
        )  # fmt: skip
    else:
        num_full = _num_full_kv_tiles(first_pos, kv_len, TILE_N)
        m, l, acc = _attend_cached_keys(
            q, m, l, acc, tile_lo, tile_hi, num_full, kv_len, q_pos, qk_scale, table_row, key_head, value_head,
            stride_k_b, stride_k_s, stride_v_b, stride_v_s, BLOCK_SIZE, TILE_N, HEAD_SIZE, DOT_FP32, INPUT_PRECISION,
        )  # fmt: skip

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
    USE_PDL: tl.constexpr,  # programmatic dependent launch (dependent_launch.py): wait first
):
    """One program per (token, head): with ``M = max_s m_s`` and ``w_s = exp2(m_s - M)`` (the
    maxima are in base-2 units, NOTE 2),
    ``out = sum_s w_s * acc_s / sum_s w_s * l_s``. Empty segments have ``m_s = -inf`` and
    weigh 0; a row with no keys at all (padding) gets 0."""
    wait_for_the_kernel_ahead(USE_PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    segs = tl.arange(0, NUM_SEGMENTS)  # [NSEG]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    base = (token * num_heads + head).to(tl.int64) * NUM_SEGMENTS
    m = tl.load(part_max_ptr + base + segs)  # [NSEG]
    l = tl.load(part_sum_ptr + base + segs)  # [NSEG]
    acc = tl.load(part_acc_ptr + (base + segs[:, None]) * HEAD_SIZE + dims[None, :])  # [NSEG, D]
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # [NSEG]
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)  # [D]
    tl.store(out_ptr + token * stride_o_n + head * stride_o_h + dims, o.to(out_ptr.dtype.element_ty))
# --8<-- [end:merge]
