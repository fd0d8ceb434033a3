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
half by half (NOTE 1). q and k are written in place; v is never touched.

NOTE 1 (the sum of squares): the rotation needs the two halves of a head apart, so the
kernel loads them as two ``[heads, D/2]`` blocks and sums the squares of each, then adds
the two sums: a different order from ``rms_norm.py``'s one sum over the row, so the two
can differ by a float32 ulp of the mean square, which the rounding to the dtype nearly
always hides (the tests allow two ulps of the dtype, as for the norm).
NOTE 2 (fusion off): launched with ``enable_fp_fusion=False``, as ``rotary.py`` is (its
NOTE 2): otherwise the compiler fuses the rotation's multiplies with its adds.
Left out: the same fusion for models without q/k norms (there is nothing to fuse but the
rotary, which ``rotary.py`` already is).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    HALF: tl.constexpr,  # D / 2
    BLOCK_HALF: tl.constexpr,  # D / 2 rounded up to a power of two
    Q_HEADS: tl.constexpr,  # H rounded up to a power of two
    K_HEADS: tl.constexpr,  # Hkv rounded up to a power of two
):
    """One program per token: its cos and sin once, then all its q heads and k heads."""
    token = tl.program_id(0)
    dims, dim_ok, cos1, sin1, cos2, sin2 = load_angles(cos_ptr, sin_ptr, token, stride_cos_n, stride_sin_n,
                                                       HALF, BLOCK_HALF)  # fmt: skip
    _norm_rotate_heads(q_ptr, q_weight_ptr, eps, token, stride_q_n, stride_q_h, num_q_heads,
                       cos1, sin1, cos2, sin2, dims, dim_ok, HALF, Q_HEADS)  # fmt: skip
    _norm_rotate_heads(k_ptr, k_weight_ptr, eps, token, stride_k_n, stride_k_h, num_k_heads,
                       cos1, sin1, cos2, sin2, dims, dim_ok, HALF, K_HEADS)  # fmt: skip
# --8<-- [end:kernel]


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
    check_rotary_args(q, k, cos, sin, q_weight=q_weight, k_weight=k_weight)
    n, _, d = q.shape
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,) or not w.is_contiguous():
            raise ValueError(f"{name} {tuple(w.shape)} must be [{d}], contiguous")
    if n:
        _qk_norm_rotary_kernel[(n,)](
            q, k, q_weight, k_weight, cos, sin, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), sin.stride(0), q.shape[1], k.shape[1],
            HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2),
            Q_HEADS=triton.next_power_of_2(q.shape[1]), K_HEADS=triton.next_power_of_2(k.shape[1]),
            enable_fp_fusion=False,  # NOTE 2
        )  # fmt: skip
    return q, k
# --8<-- [end:launcher]


# --8<-- [start:choose]
def qk_norm_rotary_applies(q: torch.Tensor, norm_impl: str, rotary_impl: str) -> bool:
    """True when the norms and the rotary would each be a kernel (``rms_norm.rms_norm`` and
    ``rotary.rotary``'s rules for these tensors): then one fused kernel replaces the three."""
    on_cuda = q.is_cuda and q.stride(-1) == 1
    return uses_kernel(norm_impl, on_cuda) and uses_kernel(rotary_impl, on_cuda)
# --8<-- [end:choose]
