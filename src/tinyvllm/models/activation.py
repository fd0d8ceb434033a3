"""SiLU-and-multiply in one kernel: ``silu(gate) * up``, the gated MLP's activation.

Concept: a gated MLP (Llama, Qwen2, Qwen3) computes ``gate`` and ``up`` in one matmul, an
``[N, 2 * I]`` tensor (``llama.py`` NOTE 1), then ``down(silu(gate) * up)``. Written with
torch ops that is two kernels on a GPU: ``silu_`` writes the gate half back, ``mul_`` reads
it again with the up half and writes the product. ``silu_and_mul_triton`` reads both halves
once and writes the product once: one kernel a layer instead of two, 28 fewer kernels in a
Qwen3-0.6B step (each a node of its CUDA graph) and one pass over ``[N, I]`` less.

``silu_and_mul`` picks the kernel for CUDA tensors and the torch ops otherwise;
``TINYVLLM_SILU_AND_MUL=torch`` (or ``triton``) forces one of them, for an A/B run of a
benchmark on the same machine (``silu_and_mul_impl``; ``platform.py``).

Mirrors: vLLM's ``SiluAndMul`` (``vllm/model_executor/layers/activation.py``), whose
``forward_cuda`` calls its fused CUDA kernel ``silu_and_mul`` and ``forward_native`` the
torch ops.

Invariants: both write the product into the gate half of their input, in place, and return
that half as an ``[N, I]`` view (``llama.py`` NOTE 7); the up half is left as it was; on
CUDA the kernel's result is the torch ops' bit for bit (NOTE 1).

NOTE 1 (rounding): torch's ``silu`` computes ``x / (1 + exp(-x))`` in float32 and rounds it
to the dtype; the multiply by ``up`` computes in float32 and rounds again. The kernel rounds
at the same two places, and computes the exponential with libdevice's ``expf`` and the
quotient with a correctly rounded division (``div_rn``), as torch's CUDA kernel does (it is
compiled without fast math), not with Triton's faster approximations: so on CUDA the bits
are the same. The interpreter on the CPU has no libdevice: there ``tl.exp`` (numpy's) stands in,
and may differ from torch's in the last bit of a float32 (the tests allow that in float32).
NOTE 2 (the grid): one program per (row, block of ``BLOCK`` columns): a decode batch has
few rows, and blocks of columns give each row several programs (three at ``I`` = 3,072).
Left out: other gated activations (GELU-tanh and friends), quantised outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn
from triton.language.extra import libdevice

from tinyvllm.dependent_launch import launch_options, wait_for_the_kernel_ahead
from tinyvllm.platform import impl_from_env, triton_can_run_on, uses_kernel

IMPL_ENV = "TINYVLLM_SILU_AND_MUL"
BLOCK = 1024  # columns of one half per program (NOTE 2)


# --8<-- [start:torch]
def silu_and_mul_torch(gate_up: torch.Tensor, size: int) -> torch.Tensor:  # [N, 2 * size] -> [N, size]
    """The reference: ``silu_`` on the gate half, ``mul_`` by the up half, two kernels on a GPU."""
    gate, up = gate_up.split(size, dim=-1)  # [N, size] views
    return nn.functional.silu(gate, inplace=True).mul_(up)
# --8<-- [end:torch]


# --8<-- [start:kernel]
@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # *T, [N, 2 * SIZE]: gate then up; the product overwrites gate
    stride_n,  # elements between rows
    SIZE: tl.constexpr,  # I, the columns of each half
    BLOCK: tl.constexpr,  # columns per program (NOTE 2)
    LIBDEVICE: tl.constexpr,  # libdevice's expf (CUDA); the interpreter has only tl.exp (NOTE 1)
    USE_PDL: tl.constexpr,  # programmatic dependent launch (dependent_launch.py)
):
    """One program per (row, column block): both halves loaded once, the product stored over
    the gate, with torch's two roundings (NOTE 1)."""
    wait_for_the_kernel_ahead(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < SIZE
    gate_ptrs = x_ptr + row * stride_n + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + SIZE, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    exp = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    silu = tl.math.div_rn(g, 1.0 + exp).to(gate.dtype)  # rounded, as torch's silu
    tl.store(gate_ptrs, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)
# --8<-- [end:kernel]


# --8<-- [start:launcher]
def silu_and_mul_triton(gate_up: torch.Tensor, size: int) -> torch.Tensor:  # [N, 2 * size] -> [N, size]
    """The Triton version of ``silu_and_mul_torch``: same arguments, same result (NOTE 1)."""
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * size or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up {tuple(gate_up.shape)} with strides {gate_up.stride()} must be [N, 2 * {size}], unit stride last"
        )
    if not triton_can_run_on(gate_up.device):
        raise ValueError(f"device {gate_up.device}: Triton needs CUDA or TRITON_INTERPRET=1")
    if gate_up.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(gate_up.shape[0], triton.cdiv(size, block))](
            gate_up, gate_up.stride(0), SIZE=size, BLOCK=block, LIBDEVICE=gate_up.is_cuda, **launch_options(gate_up.device)
        )  # fmt: skip
    return gate_up[:, :size]
# --8<-- [end:launcher]


# --8<-- [start:choose]
def silu_and_mul_impl() -> str:
    """The implementation ``TINYVLLM_SILU_AND_MUL`` asks for ("auto" when unset; ``platform.py``)."""
    return impl_from_env(IMPL_ENV)


def silu_and_mul(gate_up: torch.Tensor, size: int, impl: str = "auto") -> torch.Tensor:
    """``silu_and_mul_triton`` for CUDA tensors it takes (or when ``impl`` is "triton"),
    ``silu_and_mul_torch`` otherwise (or when ``impl`` is "torch")."""
    if uses_kernel(impl, gate_up.is_cuda and gate_up.dim() == 2 and gate_up.stride(-1) == 1):
        return silu_and_mul_triton(gate_up, size)
    return silu_and_mul_torch(gate_up, size)
# --8<-- [end:choose]
