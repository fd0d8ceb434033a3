"""Paged attention test cases shared by the reference and Triton tests."""

import torch


def make_case(
    query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
    seed=0, dtype=torch.float32, device="cpu", pad_tokens=0,
):  # fmt: skip
    """A paged batch: a shuffled pool of blocks, each request's own blocks holding random K/V
    at its positions and NaN in every slot it does not use (so reading one shows up).
    Returns query (with ``pad_tokens`` random padding rows), the caches, query_start_loc,
    seq_lens, a block table one column wider than needed, and the block ids as lists."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids, start = [], 0
    for n in blocks_per_req:
        block_ids.append(perm[start : start + n])
        start += n
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    for ids, seq_len in zip(block_ids, seq_lens):
        for cache in (key_cache, value_cache):
            kv = torch.randn(len(ids) * block_size, num_kv_heads, head_size, generator=gen)
            kv[seq_len:] = float("nan")
            cache[torch.tensor(ids)] = kv.view(len(ids), block_size, num_kv_heads, head_size)
    query = torch.randn(sum(query_lens) + pad_tokens, num_heads, head_size, generator=gen)
    width = max(blocks_per_req) + 1
    table = torch.tensor([ids + [0] * (width - len(ids)) for ids in block_ids], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    tensors = [t.to(device) for t in (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), qsl, sl, table)]
    return (*tensors, block_ids)


def make_shared_prefix_case(
    seq_lens, num_shared_blocks, num_heads, num_kv_heads, head_size, block_size, seed=0,
):  # fmt: skip
    """Decodes (one query token each) whose first ``num_shared_blocks`` blocks are the same
    cache blocks, as prefix caching leaves them; each request's other blocks are its own.
    Slots no request has written hold NaN. Returns what ``make_case`` returns."""
    gen = torch.Generator().manual_seed(seed)
    own = [-(-s // block_size) - num_shared_blocks for s in seq_lens]
    num_blocks = num_shared_blocks + sum(own) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared, start, block_ids = perm[:num_shared_blocks], num_shared_blocks, []
    for n in own:
        block_ids.append(shared + perm[start : start + n])
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache, value_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for cache in (key_cache, value_cache):
        prefix = torch.randn(num_shared_blocks * block_size, num_kv_heads, head_size, generator=gen)
        for ids, seq_len in zip(block_ids, seq_lens):
            own_kv = torch.randn(len(ids) * block_size - len(prefix), num_kv_heads, head_size, generator=gen)
            kv = torch.cat([prefix, own_kv])
            kv[seq_len:] = float("nan")
            cache[torch.tensor(ids)] = kv.view(len(ids), block_size, num_kv_heads, head_size)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
    width = max(len(ids) for ids in block_ids) + 1
    table = torch.tensor([ids + [0] * (width - len(ids)) for ids in block_ids], dtype=torch.int32)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    return query, key_cache, value_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), table, block_ids


def step_rows(key_cache, value_cache, query_start_loc, seq_lens, block_table, num_tokens):
    """The step's own key and value rows ``[N, Hkv, D]`` (what a layer writes into the cache
    before attending, triton_kernels.py NOTE 1), read back from the cache: request r's query
    rows hold the keys at its last ``query_len`` positions; padding rows hold NaN."""
    qsl, sl, bt = query_start_loc.tolist(), seq_lens.tolist(), block_table.long()
    block_size = key_cache.shape[1]
    rows = [torch.full((num_tokens, *key_cache.shape[2:]), float("nan"), dtype=key_cache.dtype, device=key_cache.device)
            for _ in range(2)]  # fmt: skip
    for r, seq_len in enumerate(sl):
        begin, end = qsl[r], qsl[r + 1]
        positions = torch.arange(seq_len - (end - begin), seq_len, device=key_cache.device)
        blocks, slots = bt[r, positions // block_size], positions % block_size
        for out, cache in zip(rows, (key_cache, value_cache)):
            out[begin:end] = cache[blocks, slots]
    return rows[0], rows[1]
