"""Writing this step's keys and values into the paged KV cache, through the slot mapping.

Concept: each layer owns one cache tensor shaped ``(2, num_blocks, block_size, Hkv, D)``
(index 0 keys, 1 values). Token i of the step goes to slot ``slot_mapping[i]``, that is
block ``slot // block_size``, offset ``slot % block_size``. ``write_kv_cache_torch`` does it
with one indexed copy; ``write_kv_cache_triton`` does it with one program per token; they
share a signature and an equivalence test. ``write_kv_cache`` picks Triton for CUDA tensors
and torch otherwise.

Follows: seed 003 "KV cache物理内存分配" (the per-layer tensor of shape
``(2, num_gpu_blocks, block_size, num_kv_heads, head_size)``).
Mirrors: ``vllm/_custom_ops.py`` ``reshape_and_cache_flash`` and its CUDA kernel in
``csrc/cache_kernels.cu``; the Triton version of ``vllm/attention/ops/triton_reshape_and_cache_flash.py``.

Invariants: rows whose slot is ``PAD_SLOT_ID`` write nothing; every other cache entry not
named by the slot mapping is left as it was. The caller guarantees slots are unique (the
metadata builders do; a duplicate slot has no defined winner).

Also here, for the kernels that rotate k (``rotary.py``, ``qk_norm_rotary.py``) and store it
at its slot in the same launch: ``store_token_kv`` (one token's k and v at its slot) and
``fused_write_args`` (the launch arguments it needs, or placeholders when it is off).

Left out: fp8 caches and their scales, layouts other than NHD.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.dependent_launch import launch_options, wait_for_the_kernel_ahead
from tinyvllm.platform import triton_can_run_on

# A slot mapping entry meaning "this row is padding: write nothing" (CUDA-graph padding).
PAD_SLOT_ID = -1


def check_write_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be [N, Hkv, D]")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "must both be [num_blocks, block_size, Hkv, D]"
        )
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache heads/dim {tuple(key_cache.shape[2:])} != key heads/dim {tuple(key.shape[1:])}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [N] with N = {key.shape[0]}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping dtype {slot_mapping.dtype} must be int32 or int64")
    if not key.dtype == value.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"dtypes differ: key {key.dtype}, value {value.dtype}, "
            f"key_cache {key_cache.dtype}, value_cache {value_cache.dtype}"
        )
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")


# --8<-- [start:torch]
def write_kv_cache_torch(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [N]
) -> None:
    """Scatter each row i of key/value to ``slot_mapping[i]``; skip ``PAD_SLOT_ID`` rows."""
    check_write_args(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping != PAD_SLOT_ID  # [N]
    slots = slot_mapping[keep].long()
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]  # [B * S, Hkv, D] view
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]
# --8<-- [end:torch]


# --8<-- [start:kernel]
@triton.jit
def cache_slot_offset(slot, stride_b, stride_s, BLOCK_SIZE: tl.constexpr):
    """Elements from a cache's start to slot ``slot`` (int64): block ``slot // S``, offset
    ``slot % S``. Also the fused write's (``qk_norm_rotary.py``)."""
    return (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_s


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # *T, [N, Hkv, D]: this step's keys
    value_ptr,  # *T, [N, Hkv, D]: this step's values
    key_cache_ptr,  # *T, [B, S, Hkv, D]: the layer's key cache
    value_cache_ptr,  # *T, [B, S, Hkv, D]: the layer's value cache
    slot_mapping_ptr,  # *int, [N]: the slot of each row, or PAD_SLOT_ID
    stride_k_n,  # elements between consecutive rows of key
    stride_k_h,  # elements between heads of key
    stride_v_n,  # elements between consecutive rows of value
    stride_v_h,  # elements between heads of value
    stride_kc_b,  # elements between blocks of key_cache
    stride_kc_s,  # elements between slots of one block of key_cache
    stride_kc_h,  # elements between heads of key_cache
    stride_vc_b,  # the same three strides for value_cache
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,  # Hkv
    HEAD_SIZE: tl.constexpr,  # D (a power of two)
    BLOCK_SIZE: tl.constexpr,  # S, tokens per cache block
    HEADS_PADDED: tl.constexpr,  # Hkv rounded up to a power of two (tile height)
    PAD_SLOT: tl.constexpr,  # PAD_SLOT_ID
    USE_PDL: tl.constexpr,  # programmatic dependent launch (dependent_launch.py)
):
    """One program per row i: copy ``key[i]`` and ``value[i]`` (an [Hkv, D] tile each) to
    block ``slot // S``, offset ``slot % S`` of the caches, unless ``slot == PAD_SLOT``."""
    wait_for_the_kernel_ahead(USE_PDL)
    i = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + i).to(tl.int64)
    heads = tl.arange(0, HEADS_PADDED)  # [Hkv_pad]
    dims = tl.arange(0, HEAD_SIZE)  # [D]
    mask = (heads[:, None] < NUM_KV_HEADS) & (slot != PAD_SLOT)  # [Hkv_pad, 1]
    k = tl.load(key_ptr + i * stride_k_n + heads[:, None] * stride_k_h + dims[None, :], mask=mask)
    v = tl.load(value_ptr + i * stride_v_n + heads[:, None] * stride_v_h + dims[None, :], mask=mask)
    kc = key_cache_ptr + cache_slot_offset(slot, stride_kc_b, stride_kc_s, BLOCK_SIZE)
    vc = value_cache_ptr + cache_slot_offset(slot, stride_vc_b, stride_vc_s, BLOCK_SIZE)
    kc = kc + heads[:, None] * stride_kc_h + dims[None, :]  # [Hkv_pad, D]
    vc = vc + heads[:, None] * stride_vc_h + dims[None, :]
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)
# --8<-- [end:kernel]


# --8<-- [start:store_token_kv]
@triton.jit
def store_token_kv(
    k1, k2,  # [HEADS, B] each: the token's k heads, first and second halves, as they are to be stored
    v_ptr, token, stride_v_n, stride_v_h,  # the token's v heads are read from v
    key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    num_heads, dims, dim_ok,  # Hkv; the lanes [1, B] of a half, and which are < D/2
    HALF: tl.constexpr, HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAD_SLOT: tl.constexpr,
):  # fmt: skip
    """One token's k (given) and v (loaded) at its cache slot, as ``_write_kv_cache_kernel``
    stores them; a ``PAD_SLOT`` row stores nothing."""
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    mask = (heads < num_heads) & dim_ok & (slot != PAD_SLOT)  # [HEADS, B]
    kc = key_cache_ptr + cache_slot_offset(slot, stride_kc_b, stride_kc_s, BLOCK_SIZE) + heads * stride_kc_h + dims
    tl.store(kc, k1, mask=mask)
    tl.store(kc + HALF, k2, mask=mask)
    vs = v_ptr + token.to(tl.int64) * stride_v_n + heads * stride_v_h + dims  # [HEADS, B]
    vc = value_cache_ptr + cache_slot_offset(slot, stride_vc_b, stride_vc_s, BLOCK_SIZE) + heads * stride_vc_h + dims
    tl.store(vc, tl.load(vs, mask=mask), mask=mask)
    tl.store(vc + HALF, tl.load(vs + HALF, mask=mask), mask=mask)
# --8<-- [end:store_token_kv]


def write_kv_cache_triton(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [N]
) -> None:
    """The Triton version of ``write_kv_cache_torch``: same arguments, same result."""
    check_write_args(key, value, key_cache, value_cache, slot_mapping)
    head_size = key.shape[2]
    if head_size & (head_size - 1):
        raise ValueError(f"head size {head_size} must be a power of two for the Triton kernel")
    if not triton_can_run_on(key.device):
        raise ValueError(f"device {key.device}: Triton needs CUDA or TRITON_INTERPRET=1")
    if key.shape[0] == 0:
        return
    _write_kv_cache_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=key.shape[1], HEAD_SIZE=head_size, BLOCK_SIZE=key_cache.shape[1],
        HEADS_PADDED=triton.next_power_of_2(key.shape[1]), PAD_SLOT=PAD_SLOT_ID, **launch_options(key.device),
    )  # fmt: skip


def fused_write_args(write: tuple | None, placeholder: torch.Tensor) -> tuple[tuple, dict]:
    """A rotating kernel's KV-write arguments: ``write`` is ``(v, key_cache, value_cache,
    slot_mapping)``, checked already, or None (then ``placeholder`` stands in for the tensors,
    unread). Returns the positional arguments (the four tensors, v's two strides, each
    cache's three) and the constexprs ``WRITE_KV``, ``BLOCK_SIZE``, ``PAD_SLOT``."""
    if write is None:
        return (placeholder,) * 4 + (0,) * 8, dict(WRITE_KV=False, BLOCK_SIZE=1, PAD_SLOT=PAD_SLOT_ID)
    v, key_cache, value_cache, slot_mapping = write
    strides = (*v.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3])
    return (v, key_cache, value_cache, slot_mapping, *strides), dict(
        WRITE_KV=True, BLOCK_SIZE=key_cache.shape[1], PAD_SLOT=PAD_SLOT_ID
    )


def write_kv_cache(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [N]
) -> None:
    """Write K/V into the cache: the Triton kernel for CUDA tensors, torch otherwise."""
    if key.device.type == "cuda":
        write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_cache_torch(key, value, key_cache, value_cache, slot_mapping)
