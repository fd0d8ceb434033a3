"""Qwen3's q/k norms and the rotary embedding in one kernel: per head, RMSNorm, then rotate.

Concept: Qwen3 normalises each head of q and of k (an RMSNorm over the head size, its own
weight for q and for k) and then rotates them. With the one-kernel forms of
``rms_norm.py`` and ``rotary.py`` that is three launches a layer (the q norm, the k norm,
the rotary), and the norms' outputs make one more round trip through memory. Here one
program per token loads each of its heads once, normalises it in registers and rotates it,
and writes it back in place: one launch a layer, two fewer than the separate kernels
(56 fewer in a Qwen3-0.6B step). It is used when both separate forms would be kernels
(``qk_norm_rotary_applies``), so ``TINYVLLM_RMS_NORM=torch`` or ``TINYVLLM_ROTARY=torch``
turns it off with them.

Mirrors: vLLM's fused q/k norm and rotary for Qwen3 (``fused_qk_norm_rope``, a CUDA custom
op put in by an opt-in compile pass, ``enable_qk_norm_rope_fusion``, off by default), which
also normalises and rotates in place.

Invariants: the result is ``rotary(rms_norm(q), rms_norm(k))`` to within the norm's
rounding: the same roundings as the two kernels (the norm's in float32, then the dtype, then
the weight's multiply; the rotation's of ``rotary.py`` NOTE 2), with the squares summed
half by half (NOTE 1). q and k are written in place; v is only read. With the KV write
(NOTE 3) the cache gets the bits ``write_kv_cache`` would store, and nothing else.

NOTE 1 (the sum of squares): the rotation needs the two halves of a head apart, so the
kernel loads them as two ``[heads, D/2]`` blocks and sums the squares of each, then adds
the two sums: a different order from ``rms_norm.py``'s one sum over the row, so the two
can differ by a float32 ulp of the mean square, which the rounding to the dtype nearly
always hides (the tests allow two ulps of the dtype, as for the norm).
NOTE 2 (fusion off): launched with ``enable_fp_fusion=False``, as ``rotary.py`` is (its
NOTE 2): otherwise the compiler fuses the rotation's multiplies with its adds.
NOTE 3 (the KV write too, ``qk_norm_rotary_write_kv_triton``): the program that has just
rotated a token's k heads also stores them, and the token's v heads, at its cache slot
(``PAD_SLOT_ID``: nowhere), so a layer launches one kernel where it launched this one and
the backend's KV writer (28 fewer launches a Qwen3-0.6B step, and k is not read back);
``rotary.py`` NOTE 4 does the same for models without q/k norms. vLLM fuses the same on
ROCm, by compile passes (``fuse_rope_kvcache``, ``fuse_qk_norm_rope_kvcache``). llama.py
runs both at the attention split, where the cache and the slot mapping are, wherever the
rotation is a kernel (``fused_kv_write``: ``TINYVLLM_FUSED_KV_WRITE=0`` turns it off).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tinyvllm.attention.kv_cache_write import check_write_args, fused_write_args, store_token_kv
from tinyvllm.dependent_launch import launch_options, wait_for_the_kernel_ahead
from tinyvllm.models.rms_norm import rms_norm_torch
from tinyvllm.models.rotary import check_rotary_args, load_angles, rotary_torch, rotate_halves
from tinyvllm.platform import uses_kernel


# --8<-- [start:torch]
def qk_norm_rotary_torch(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The reference: each head of q and k normalised (``rms_norm_torch``), then rotated."""
    return rotary_torch(rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps), cos, sin)
# --8<-- [end:torch]


# --8<-- [start:kernel]
@triton.jit
def _norm_rotate_heads(
    x_ptr, w_ptr, eps, token, stride_n, stride_h, num_heads, cos1, sin1, cos2, sin2, dims, dim_ok,
    HALF: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    """Normalise then rotate every head of one token of x, in place."""
    heads = tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    mask = (heads < num_heads) & dim_ok  # [HEADS, B]
    first = x_ptr + token.to(tl.int64) * stride_n + heads * stride_h + dims  # [HEADS, B]
    x1 = tl.load(first, mask=mask, other=0.0)  # [HEADS, B]: dimensions i < D/2
    x2 = tl.load(first + HALF, mask=mask, other=0.0)  # [HEADS, B]: i + D/2
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [HEADS], NOTE 1
    rstd = tl.rsqrt(squares / (2 * HALF) + eps)[:, None]  # [HEADS, 1]
    w1 = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)  # [1, B]
    w2 = tl.load(w_ptr + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)
    # rms_norm.py's two roundings: the normalised value to the dtype, then the weight's multiply
    n1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    out1, out2 = rotate_halves(n1, n2, cos1, sin1, cos2, sin2, dt)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2  # [HEADS, B] each, in the dtype


@triton.jit
def _qk_norm_rotary_kernel(
    q_ptr,  # *T, [N, H, D]: normalised and rotated in place
    k_ptr,  # *T, [N, Hkv, D]: normalised and rotated in place
    q_weight_ptr,  # *T, [D]: the q norm's weight
    k_weight_ptr,  # *T, [D]: the k norm's weight
    cos_ptr,  # *T, [N, D]
    sin_ptr,  # *T, [N, D]
    eps,  # float32
    stride_q_n, stride_q_h,  # q strides: between tokens, between heads
    stride_k_n, stride_k_h,  # k strides
    stride_cos_n, stride_sin_n,  # cos and sin: between tokens
    num_q_heads,  # H
    num_k_heads,  # Hkv
    # With WRITE_KV (NOTE 3) only; otherwise unused:
    v_ptr,  # *T, [N, Hkv, D]: read, never written
    key_cache_ptr,  # *T, [B, S, Hkv, D]: this token's rotated k heads go to its slot
    value_cache_ptr,  # *T, [B, S, Hkv, D]: and its v heads
    slot_mapping_ptr,  # *int, [N]: the slot of each token, or PAD_SLOT
    stride_v_n, stride_v_h,  # v strides
    stride_kc_b, stride_kc_s, stride_kc_h,  # key_cache strides: blocks, slots, heads
    stride_vc_b, stride_vc_s, stride_vc_h,  # value_cache strides
    HALF: tl.constexpr,  # D / 2
    BLOCK_HALF: tl.constexpr,  # D / 2 rounded up to a power of two
    Q_HEADS: tl.constexpr,  # H rounded up to a power of two
    K_HEADS: tl.constexpr,  # Hkv rounded up to a power of two
    WRITE_KV: tl.constexpr = False,  # also store k and v into the cache (NOTE 3)
    BLOCK_SIZE: tl.constexpr = 1,  # S, tokens per cache block
    PAD_SLOT: tl.constexpr = -1,  # kv_cache_write.PAD_SLOT_ID: the row writes nothing
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (dependent_launch.py)
):
    """One program per token: its cos and sin once, then all its q heads and k heads; with
    ``WRITE_KV``, its k heads as rotated and its v heads into its cache slot."""
    wait_for_the_kernel_ahead(USE_PDL)
    token = tl.program_id(0)
    dims, dim_ok, cos1, sin1, cos2, sin2 = load_angles(cos_ptr, sin_ptr, token, stride_cos_n, stride_sin_n,
                                                       HALF, BLOCK_HALF)  # fmt: skip
    _norm_rotate_heads(q_ptr, q_weight_ptr, eps, token, stride_q_n, stride_q_h, num_q_heads,
                       cos1, sin1, cos2, sin2, dims, dim_ok, HALF, Q_HEADS)  # fmt: skip
    k1, k2 = _norm_rotate_heads(k_ptr, k_weight_ptr, eps, token, stride_k_n, stride_k_h, num_k_heads,
                                cos1, sin1, cos2, sin2, dims, dim_ok, HALF, K_HEADS)  # fmt: skip
    if WRITE_KV:
        store_token_kv(k1, k2, v_ptr, token, stride_v_n, stride_v_h, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                       stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                       num_k_heads, dims, dim_ok, HALF, K_HEADS, BLOCK_SIZE, PAD_SLOT)  # fmt: skip
# --8<-- [end:kernel]


def _check_args(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> None:  # fmt: skip
    """``rotary.py``'s checks, then each weight ``[D]`` and contiguous."""
    check_rotary_args(q, k, cos, sin, q_weight=q_weight, k_weight=k_weight)
    d = q.shape[2]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,) or not w.is_contiguous():
            raise ValueError(f"{name} {tuple(w.shape)} must be [{d}], contiguous")


# --8<-- [start:launcher]
def qk_norm_rotary_triton(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    cos: torch.Tensor,  # [N, D]
    sin: torch.Tensor,  # [N, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of ``qk_norm_rotary_torch``, written into q and k, which it returns."""
    _check_args(q, k, q_weight, k_weight, cos, sin)
    if q.shape[0]:
        _launch(q, k, q_weight, k_weight, eps, cos, sin, write=None)
    return q, k


def qk_norm_rotary_write_kv_triton(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    cos: torch.Tensor,  # [N, D]
    sin: torch.Tensor,  # [N, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rotary_triton`` and then ``write_kv_cache`` of the rotated k and of v, in one
    launch (NOTE 3): q and k written in place and returned, the caches at the mapped slots."""
    _check_args(q, k, q_weight, k_weight, cos, sin)
    check_write_args(k, v, key_cache, value_cache, slot_mapping)
    if q.shape[0]:
        _launch(q, k, q_weight, k_weight, eps, cos, sin, write=(v, key_cache, value_cache, slot_mapping))
    return q, k


def _launch(q, k, q_weight, k_weight, eps, cos, sin, write) -> None:
    d = q.shape[2]
    write_args, write_consts = fused_write_args(write, q)
    _qk_norm_rotary_kernel[(q.shape[0],)](
        q, k, q_weight, k_weight, cos, sin, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), q.shape[1], k.shape[1], *write_args,
        HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2),
        Q_HEADS=triton.next_power_of_2(q.shape[1]), K_HEADS=triton.next_power_of_2(k.shape[1]), **write_consts,
        enable_fp_fusion=False, **launch_options(q.device),  # NOTE 2
    )  # fmt: skip
# --8<-- [end:launcher]


FUSED_KV_WRITE_ENV = "TINYVLLM_FUSED_KV_WRITE"


# --8<-- [start:choose]
def fused_kv_write() -> bool:
    """Whether the layers fuse the KV write into the rotating kernel, this one or ``rotary.py``'s,
    where it runs (NOTE 3): yes unless ``TINYVLLM_FUSED_KV_WRITE`` is "0"; a value other than
    "0" or "1" is refused."""
    env = os.environ.get(FUSED_KV_WRITE_ENV)
    if env not in (None, "0", "1"):
        raise ValueError(f"{FUSED_KV_WRITE_ENV}={env!r}: must be '0' or '1'")
    return env != "0"


def qk_norm_rotary_applies(q: torch.Tensor, norm_impl: str, rotary_impl: str) -> bool:
    """True when the norms and the rotary would each be a kernel (``rms_norm.rms_norm`` and
    ``rotary.rotary``'s rules for these tensors): then one fused kernel replaces the three."""
    on_cuda = q.is_cuda and q.stride(-1) == 1
    return uses_kernel(norm_impl, on_cuda) and uses_kernel(rotary_impl, on_cuda)
# --8<-- [end:choose]
