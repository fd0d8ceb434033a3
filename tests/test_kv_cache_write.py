"""write_kv_cache: the Triton kernel against torch, padding rows untouched, bad input."""

import pytest
import torch

from tinyvllm.attention.kv_cache_write import (
    PAD_SLOT_ID,
    write_kv_cache,
    write_kv_cache_torch,
    write_kv_cache_triton,
)

WRITERS = [write_kv_cache_torch, write_kv_cache_triton]
# CUDA when present (the Triton writer needs it there); the CPU under the interpreter otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer_cache(num_blocks, block_size, num_kv_heads, head_size, dtype):
    """One layer's cache as seed 003 allocates it, filled with a marker value 7."""
    kv = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), 7.0, dtype=dtype, device=DEVICE)
    return kv, kv[0], kv[1]


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize("writer", WRITERS)
def test_slot_is_block_times_block_size_plus_offset(writer):
    kv, kc, vc = layer_cache(4, 4, 2, 16, torch.float32)
    key = torch.arange(3 * 2 * 16, dtype=torch.float32, device=DEVICE).reshape(3, 2, 16)
    value = -key
    writer(key, value, kc, vc, torch.tensor([13, 2, PAD_SLOT_ID], device=DEVICE))
    assert torch.equal(kv[0, 3, 1], key[0]) and torch.equal(kv[1, 3, 1], value[0])  # 13 = 3*4 + 1
    assert torch.equal(kv[0, 0, 2], key[1]) and torch.equal(kv[1, 0, 2], value[1])  # 2 = 0*4 + 2
    written = torch.zeros(4, 4, dtype=torch.bool, device=DEVICE)
    written[3, 1] = written[0, 2] = True
    assert (kv[:, ~written] == 7).all(), "the padding row or an unnamed slot was written"


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_triton_matches_torch(dtype, num_kv_heads):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, head_size, n = 6, 16, 32, 20
    key = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[3, 11, 19]] = PAD_SLOT_ID
    kv_t, kc_t, vc_t = layer_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    kv_k, kc_k, vc_k = layer_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    key, value, slots = key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE)
    write_kv_cache_torch(key, value, kc_t, vc_t, slots)
    write_kv_cache_triton(key, value, kc_k, vc_k, slots.to(torch.int32))
    assert torch.equal(kv_t, kv_k)
    assert (kv_t != 7).any(dim=(-1, -2)).sum() == 2 * 17  # 17 real rows, in K and in V


def test_write_kv_cache_dispatches_and_writes():
    kv, kc, vc = layer_cache(2, 4, 1, 16, torch.float32)
    key = torch.ones(1, 1, 16, device=DEVICE)
    write_kv_cache(key, 2 * key, kc, vc, torch.tensor([5], device=DEVICE))
    assert (kv[0, 1, 1] == 1).all() and (kv[1, 1, 1] == 2).all()


def _args():
    _, kc, vc = layer_cache(2, 4, 2, 16, torch.float32)
    key = torch.zeros(3, 2, 16, device=DEVICE)
    return dict(key=key, value=key.clone(), key_cache=kc, value_cache=vc, slot_mapping=torch.zeros(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(value=a["value"][..., :8]), "must both be"),
        (lambda a: a.update(key_cache=a["key_cache"][:, :, :1]), "must both be"),
        (lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]), "cache heads/dim"),
        (lambda a: a.update(slot_mapping=torch.zeros(4, dtype=torch.int64)), r"slot_mapping \(4,\)"),
        (lambda a: a.update(slot_mapping=torch.zeros(3)), "slot_mapping dtype torch.float32"),
        (lambda a: a.update(key=a["key"].half(), value=a["value"].half()), "dtypes differ"),
        (lambda a: a.update(key=torch.zeros(3, 16, 2, device=DEVICE).transpose(1, 2)), "unit stride along D"),
    ],
)
def test_launcher_checks(writer, change, message):
    args = _args()
    change(args)
    with pytest.raises(ValueError, match=message):
        writer(**args)


def test_triton_rejects_head_size_not_power_of_two():
    _, kc, vc = layer_cache(2, 4, 1, 12, torch.float32)
    key = torch.zeros(1, 1, 12, device=DEVICE)
    with pytest.raises(ValueError, match="head size 12"):
        write_kv_cache_triton(key, key, kc, vc, torch.zeros(1, dtype=torch.int64, device=DEVICE))
