"""bench/plain_flash.py, the prefill sweep's baseline: causal attention of one sequence, the
same as SDPA's (under the interpreter on the CPU, on the device on a GPU), and its refusals."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from plain_flash import plain_causal_flash  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sdpa_causal(q, k, v):
    group = q.shape[1] // k.shape[1]
    heads = [t.transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))]
    return torch.nn.functional.scaled_dot_product_attention(*heads, is_causal=True).transpose(0, 1)


@pytest.mark.parametrize(
    "length, heads, kv_heads, block_m, block_n",
    [(40, 4, 2, 32, 16), (16, 2, 2, 16, 16), (37, 4, 1, 32, 32), (5, 2, 1, 32, 16)],
)  # fmt: skip
def test_plain_flash_is_causal_attention(length, heads, kv_heads, block_m, block_n):
    """Grouped-query heads, a length that is not a multiple of the tile (and one below a tile),
    the diagonal tiles past the end: every row as SDPA's."""
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(length, h, 16, generator=g).to(DEVICE) for h in (heads, kv_heads, kv_heads))
    out = plain_causal_flash(q, k, v, block_m, block_n, num_warps=4, num_stages=1)
    torch.testing.assert_close(out, sdpa_causal(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "shapes, block_m, block_n, message",
    [(((8, 4, 16), (8, 3, 16)), 16, 16, "H a multiple of Hkv"), (((8, 4, 16), (7, 2, 16)), 16, 16, "one length"),
     (((8, 4, 16), (8, 2, 16)), 16, 32, "block_m 16, block_n 32")],
)  # fmt: skip
def test_plain_flash_refuses_what_it_cannot_compute(shapes, block_m, block_n, message):
    q, k = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        plain_causal_flash(q, k, k.clone(), block_m, block_n)
