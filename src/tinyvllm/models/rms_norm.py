"""RMSNorm in one kernel: ``weight * (x / sqrt(mean(x^2) + eps))``, the mean in float32.

Concept: written with torch ops, one RMSNorm is eight kernels on a GPU (a cast up,
``pow``, ``mean``, ``+ eps``, ``rsqrt``, a multiply, a cast down, the weight's
multiply), each reading and writing the whole tensor. A Qwen3 layer has four norms (before
attention, after it, and the per-head q and k norms): 32 kernels, where everything else in
the layer is about 21 (NOTE 1). Under a full CUDA graph each small kernel still takes its
own slot on the device, so at batch 1 a decode step is mostly such kernels.
``rms_norm_triton`` does the same arithmetic in one program per row: load the row, sum
its squares in float32, scale, cast, multiply by the weight, store.

``rms_norm`` picks the kernel for CUDA tensors (the only place it pays) and the torch ops
otherwise; ``TINYVLLM_RMS_NORM=torch`` (or ``triton``) forces one of them, for an A/B run
of a benchmark on the same machine (``rms_norm_impl``).

Mirrors: vLLM's ``RMSNorm`` (``vllm/model_executor/layers/layernorm.py``), whose
``forward_cuda`` calls its fused CUDA kernel ``rms_norm`` and ``forward_native`` the torch
ops; the row-wise reduction of the Triton tutorials' layer-norm kernel.

Invariants: the result has ``x``'s shape and dtype and is contiguous; each row of the last
dimension is normalised on its own; the Triton and torch versions agree to float32
rounding (NOTE 2).

NOTE 1 (the count): ``tests/test_rms_norm.py`` counts the operations of one bfloat16
decode forward of the tiny Qwen3: eight for each of its nine norms. The rest of a layer,
read off ``llama.py`` with the Triton attention backend: the qkv, o, gate-up and down
projections (4), rotary on q and on k (5 each as torch ops), the KV write and the attention
kernel (2, 3 with split KV), two residual adds, ``silu`` and its multiply (2): about 21.
(On CUDA the rotary and the residual adds are now kernels of their own or folded into the
norms: ``rotary.py``, ``qk_norm_rotary.py`` and NOTE 3.)
NOTE 2 (rounding): both compute in float32 and round once to the model's dtype before
the weight's multiply, as transformers does; they differ only in the order in which the
squares are summed, a few float32 ulps, which bfloat16 rounding nearly always hides.
NOTE 3 (the residual add, fused): after attention a layer adds ``o_proj``'s output to the
residual stream and normalises the sum: two kernels, the sum written to memory and read
back. ``add_rms_norm_triton`` (vLLM's ``fused_add_rms_norm``) loads both rows, adds them in
float32 and rounds to the dtype (the torch add's bits: the float32 sum of two bfloat16 or
float16 values, rounded once), stores the sum as the new residual stream and normalises
it from registers: one kernel, bit for bit ``(rms_norm_triton(x + delta), x + delta)``.
``llama.py`` uses it for both residual adds of a layer: the one before
``post_attention_layernorm``, and the one after the MLP, which the next layer's
``input_layernorm`` (or the final norm) does (``llama.py`` NOTE 9).
Left out: quantised outputs, writing in place (vLLM's kernel overwrites its inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.dependent_launch import launch_options, wait_for_the_kernel_ahead
from tinyvllm.platform import impl_from_env, triton_can_run_on, uses_kernel

IMPL_ENV = "TINYVLLM_RMS_NORM"


# --8<-- [start:torch]
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., size]
    """The reference: eight kernels on a GPU (module header)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, size] each
    """The residual add, then the norm of the sum (NOTE 3): ``(norm(x + delta), x + delta)``."""
    total = x + delta
    return rms_norm_torch(total, weight, eps), total
# --8<-- [end:torch]


# --8<-- [start:kernel]
@triton.jit
def _normalize_row(x32, w, eps, SIZE: tl.constexpr, dt: tl.constexpr):
    """One row in float32 (masked lanes 0) -> ``w * (x / rms(x))`` in ``dt``, with the two
    roundings of the torch ops: the normalised row to ``dt``, then the weight's multiply."""
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / SIZE + eps)
    normed = (x32 * rstd).to(dt)  # rounded to the model's dtype first, as the torch ops do
    return (w.to(tl.float32) * normed.to(tl.float32)).to(dt)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # *T, [N, H, SIZE] (H = 1 for a plain [N, SIZE] tensor)
    weight_ptr,  # *T, [SIZE]
    out_ptr,  # *T, [N * H, SIZE], contiguous
    stride_x_n,  # elements between tokens of x
    stride_x_h,  # elements between heads of x
    num_heads,  # H
    eps,  # float32
    SIZE: tl.constexpr,  # the normalised dimension
    BLOCK: tl.constexpr,  # SIZE rounded up to a power of two
    USE_PDL: tl.constexpr,  # programmatic dependent launch (dependent_launch.py)
):
    """One program per row (token, head): its mean square in float32, then the scaled row."""
    wait_for_the_kernel_ahead(USE_PDL)
    row = tl.program_id(0)
    token, head = row // num_heads, row % num_heads
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < SIZE
    x = tl.load(x_ptr + token.to(tl.int64) * stride_x_n + head * stride_x_h + cols, mask=mask, other=0.0)
    w = tl.load(weight_ptr + cols, mask=mask)
    tl.store(out_ptr + row.to(tl.int64) * SIZE + cols, _normalize_row(x.to(tl.float32), w, eps, SIZE, x.dtype), mask=mask)
# --8<-- [end:kernel]


# --8<-- [start:add_kernel]
@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # *T, [N, SIZE]: the residual stream
    delta_ptr,  # *T, [N, SIZE]: what a sublayer adds to it
    weight_ptr,  # *T, [SIZE]
    out_ptr,  # *T, [N, SIZE], contiguous: the norm of the sum
    sum_ptr,  # *T, [N, SIZE], contiguous: the sum, the new residual stream
    stride_x_n,  # elements between rows of x
    stride_delta_n,  # elements between rows of delta
    eps,  # float32
    SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (dependent_launch.py)
):
    """One program per row: ``x + delta`` rounded to the dtype (the torch add's bits), stored,
    and normalised from registers (NOTE 3)."""
    wait_for_the_kernel_ahead(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < SIZE
    x = tl.load(x_ptr + row * stride_x_n + cols, mask=mask, other=0.0)
    delta = tl.load(delta_ptr + row * stride_delta_n + cols, mask=mask, other=0.0)
    total = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)  # [BLOCK]
    tl.store(sum_ptr + row * SIZE + cols, total, mask=mask)
    w = tl.load(weight_ptr + cols, mask=mask)
    tl.store(out_ptr + row * SIZE + cols, _normalize_row(total.to(tl.float32), w, eps, SIZE, x.dtype), mask=mask)
# --8<-- [end:add_kernel]


def _check_weight_and_device(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The launchers' shared checks: a weight of x's row size, dtype and device; a device Triton runs on."""
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} must be [{x.shape[-1]}] {x.dtype} on {x.device}"
        )
    if not triton_can_run_on(x.device):
        raise ValueError(f"device {x.device}: Triton needs CUDA or TRITON_INTERPRET=1")


# --8<-- [start:launcher]
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [N, SIZE] or [N, H, SIZE]
    """The Triton version of ``rms_norm_torch``: same arguments, same result (NOTE 2)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} with strides {x.stride()} must be [N, size] or [N, H, size], unit stride last")
    _check_weight_and_device(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    if rows:
        _rms_norm_kernel[(rows,)](
            x, weight, out, x.stride(0), x.stride(1) if x.dim() == 3 else 0, heads, eps,
            SIZE=x.shape[-1], BLOCK=triton.next_power_of_2(x.shape[-1]), **launch_options(x.device),
        )  # fmt: skip
    return out
# --8<-- [end:launcher]


# --8<-- [start:add_launcher]
def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, size] each
    """The Triton version of ``add_rms_norm_torch``: the sum has the torch add's bits, the norm
    ``rms_norm_triton``'s of that sum (NOTE 3); both outputs new and contiguous."""
    if x.dim() != 2 or x.shape != delta.shape or x.stride(-1) != 1 or delta.stride(-1) != 1:
        raise ValueError(
            f"x {tuple(x.shape)} and delta {tuple(delta.shape)} with strides {x.stride()}, {delta.stride()} "
            "must be one [N, size] shape, unit stride last"
        )
    if delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(f"delta {delta.dtype} on {delta.device} must be {x.dtype} on {x.device}")
    _check_weight_and_device(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, delta, weight, out, total, x.stride(0), delta.stride(0), eps,
            SIZE=x.shape[-1], BLOCK=triton.next_power_of_2(x.shape[-1]), **launch_options(x.device),
        )  # fmt: skip
    return out, total
# --8<-- [end:add_launcher]


# --8<-- [start:choose]
def rms_norm_impl() -> str:
    """The implementation ``TINYVLLM_RMS_NORM`` asks for ("auto" when unset; ``platform.py``)."""
    return impl_from_env(IMPL_ENV)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """``rms_norm_triton`` for CUDA tensors it takes (or when ``impl`` is "triton"),
    ``rms_norm_torch`` otherwise (or when ``impl`` is "torch")."""
    if uses_kernel(impl, x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1 and weight.dtype == x.dtype):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + delta), x + delta)``: ``add_rms_norm_triton`` where ``rms_norm`` would take
    the kernel (and both are rows with unit stride), ``add_rms_norm_torch`` otherwise."""
    rows = x.dim() == 2 and x.shape == delta.shape and x.stride(-1) == 1 and delta.stride(-1) == 1
    if uses_kernel(impl, x.is_cuda and rows and weight.dtype == x.dtype == delta.dtype):
        return add_rms_norm_triton(x, delta, weight, eps)
    return add_rms_norm_torch(x, delta, weight, eps)
# --8<-- [end:choose]
