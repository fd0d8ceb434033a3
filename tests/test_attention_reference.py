"""The torch reference against a naive per-token, per-head computation written here."""

import math

import pytest
import torch

from paged_cases import make_case

from tinyvllm.attention.reference import paged_attention


def naive_attention(query, key_cache, value_cache, query_lens, seq_lens, block_ids, scale):
    """Token by token, head by head, in float64: look every key up through the block table."""
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    rows = []
    row = 0
    for q_len, seq_len, ids in zip(query_lens, seq_lens, block_ids):
        for j in range(q_len):
            pos = seq_len - q_len + j
            heads = []
            for h in range(query.shape[1]):
                q = query[row, h].double()
                keys = [key_cache[ids[p // block_size], p % block_size, h // group].double() for p in range(pos + 1)]
                vals = [value_cache[ids[p // block_size], p % block_size, h // group].double() for p in range(pos + 1)]
                scores = [float(q @ k) * scale for k in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                heads.append(sum(w / total * v for w, v in zip(weights, vals)))
            rows.append(torch.stack(heads))
            row += 1
    return torch.stack(rows)


@pytest.mark.parametrize(
    "query_lens, seq_lens, num_heads, num_kv_heads, block_size",
    [
        ([1], [1], 2, 2, 4),  # the very first token: attends to itself only
        ([5], [5], 4, 2, 4),  # a prefill over two blocks, GQA 2
        ([1, 3, 2], [9, 3, 7], 4, 1, 4),  # decode + prefill + chunked prefill, GQA 4 (MQA)
        ([2, 1], [17, 17], 8, 1, 16),  # context 17 with block size 16, GQA 8
    ],
)
def test_reference_matches_naive(query_lens, seq_lens, num_heads, num_kv_heads, block_size):
    query, kc, vc, qsl, sl, table, block_ids = make_case(query_lens, seq_lens, num_heads, num_kv_heads, 8, block_size)
    scale = 8**-0.5
    out = paged_attention(query, kc, vc, qsl, sl, table, scale)
    expected = naive_attention(query, kc, vc, query_lens, seq_lens, block_ids, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_writes_into_out_zeroes_padding_and_keeps_dtype():
    query, kc, vc, qsl, sl, table, _ = make_case([2, 1], [4, 6], 2, 1, 8, 4)
    padded = torch.cat([query, torch.randn(3, 2, 8)]).half()
    out = torch.full_like(padded, float("nan"))
    result = paged_attention(padded, kc.half(), vc.half(), qsl, sl, table, 0.3, out=out)
    assert result is out and out.dtype == torch.float16
    assert not out.isnan().any()
    assert (out[3:] == 0).all()


def test_reference_rejects_head_counts_that_do_not_divide():
    query, kc, vc, qsl, sl, table, _ = make_case([1], [1], 3, 2, 8, 4)
    with pytest.raises(ValueError, match="query heads 3 are not a multiple of KV heads 2"):
        paged_attention(query, kc, vc, qsl, sl, table, 1.0)
