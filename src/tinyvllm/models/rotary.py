"""Rotary embedding of q and k in one kernel: ``x * cos + rotate_half(x) * sin`` per head.

Concept: written with torch ops, rotating one tensor is five kernels on a GPU (a negation
and a concatenation build ``rotate_half(x)``, two multiplies, an add), so q and k are ten
kernels a layer, each a pass over the whole tensor: in a Qwen3 layer more kernels than
anything else but the four norms, which ``rms_norm.py`` already made one each (NOTE 1).
``rotary_triton`` rotates q and k together, in place, one program per token: load the
token's cos and sin once, then every q head and every k head, both halves of each.

``rotary`` picks the kernel for CUDA tensors (the only place it pays) and the torch ops
otherwise; ``TINYVLLM_ROTARY=torch`` (or ``triton``) forces one of them, for an A/B run of
a benchmark on the same machine (``rotary_impl``).

Mirrors: vLLM's ``RotaryEmbedding`` (``vllm/model_executor/layers/rotary_embedding``),
whose ``forward_cuda`` calls its CUDA kernel ``rotary_embedding`` on q and k in place and
``forward_native`` the torch ops; transformers' ``apply_rotary_pos_emb`` is the torch form.

Invariants: the "neox" layout, dimension ``i`` paired with ``i + D/2`` (two halves, not
interleaved pairs); ``cos`` and ``sin`` are ``[N, D]`` in the model's dtype, one row per
token; the kernel's result equals the torch ops' bit for bit, in every dtype
(NOTE 2); the torch version returns new tensors, the kernel writes into q and k.

NOTE 1 (the count): ``tests/test_rotary.py`` counts five operations for each rotated
tensor (``neg``, ``cat``, ``mul``, ``mul``, ``add``) in the torch form, and one launch for q
and k together in the kernel's: with 28 layers, 280 kernels of a Qwen3-0.6B decode step
become 28.
NOTE 2 (the same roundings): the torch ops round each product to the model's dtype, then
round their sum. The kernel computes each product in float32 and rounds it to the dtype,
then adds the two rounded values in float32 and rounds once more: the same three
roundings, so the same bits (a float32 product of two bfloat16 or float16 values is exact,
and so is the negation). Left to itself the compiler would undo that: it narrows the
float32 arithmetic to the 16-bit dtype (exact) and then fuses each multiply with the add
that follows into one fused multiply-add, which rounds once instead of twice, in every
dtype (24 of them in the sm_90 PTX at Qwen3's shape). The launch turns fusion off
(``enable_fp_fusion=False``); ``tests/test_triton_aot.py`` counts none in the compiled PTX.
NOTE 3 (in place): q and k are either views into the fused qkv projection's output (Llama,
Qwen2) or the q/k norms' fresh outputs (Qwen3); nothing reads them unrotated afterwards,
so writing the rotated values back costs no new tensor. v, the third part of the qkv
output, is never touched.
NOTE 4 (the KV write too, ``rotary_write_kv_triton``): with ``WRITE_KV`` each program
stores its token's rotated k heads, and its v heads, at the token's cache slot
(``kv_cache_write.store_token_kv``): the layer's KV writer is one launch fewer, and k is
not read back. llama.py runs it at the attention split (``qk_norm_rotary.py`` NOTE 3).
Left out: the interleaved ("GPT-J") layout, partial rotary (a rotary dimension below the
head size), and computing cos and sin inside the kernel from the positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyvllm.attention.kv_cache_write import check_write_args, fused_write_args, store_token_kv
from tinyvllm.dependent_launch import launch_options, wait_for_the_kernel_ahead
from tinyvllm.platform import impl_from_env, triton_can_run_on, uses_kernel

IMPL_ENV = "TINYVLLM_ROTARY"


# --8<-- [start:torch]
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x ([N, heads, D]) by its token's angle: ``x*cos + rotate_half(x)*sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [N, heads, D]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: five kernels for q and five for k on a GPU (NOTE 1); new tensors."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
# --8<-- [end:torch]


# --8<-- [start:kernel]
@triton.jit
def load_angles(cos_ptr, sin_ptr, token, stride_cos_n, stride_sin_n, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One token's cos and sin in float32, each half as a [1, B] row: the lanes ``dims``
    (masked past D/2 by ``dim_ok``) and the first and second halves of each."""
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, B]
    dim_ok = dims < HALF
    c = cos_ptr + token.to(tl.int64) * stride_cos_n + dims
    s = sin_ptr + token.to(tl.int64) * stride_sin_n + dims
    cos1 = tl.load(c, mask=dim_ok, other=0.0).to(tl.float32)  # [1, B]
    cos2 = tl.load(c + HALF, mask=dim_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(s, mask=dim_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(s + HALF, mask=dim_ok, other=0.0).to(tl.float32)
    return dims, dim_ok, cos1, sin1, cos2, sin2


@triton.jit
def rotate_halves(x1, x2, cos1, sin1, cos2, sin2, dt: tl.constexpr):
    """``x * cos + cat(-x2, x1) * sin`` on the two halves (float32 values of dtype ``dt``),
    each product rounded to ``dt`` first, then the sum (NOTE 2): the rotated halves in ``dt``."""
    out1 = (x1 * cos1).to(dt).to(tl.float32) + (-x2 * sin1).to(dt).to(tl.float32)
    out2 = (x2 * cos2).to(dt).to(tl.float32) + (x1 * sin2).to(dt).to(tl.float32)
    return out1.to(dt), out2.to(dt)


@triton.jit
def _rotate_heads(
    x_ptr, token, stride_n, stride_h, num_heads, cos1, sin1, cos2, sin2, dims, dim_ok,
    HALF: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    """Rotate every head of one token of x in place; cos1/sin1 [1, B] pair the first half."""
    heads = tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    mask = (heads < num_heads) & dim_ok  # [HEADS, B]
    first = x_ptr + token.to(tl.int64) * stride_n + heads * stride_h + dims  # [HEADS, B]
    x1 = tl.load(first, mask=mask, other=0.0)  # [HEADS, B]: dimensions i < D/2
    x2 = tl.load(first + HALF, mask=mask, other=0.0)  # [HEADS, B]: their partners i + D/2
    out1, out2 = rotate_halves(x1.to(tl.float32), x2.to(tl.float32), cos1, sin1, cos2, sin2, x1.dtype)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2  # [HEADS, B] each, in the dtype


@triton.jit
def _rotary_kernel(
    q_ptr,  # *T, [N, H, D]: rotated in place
    k_ptr,  # *T, [N, Hkv, D]: rotated in place
    cos_ptr,  # *T, [N, D]
    sin_ptr,  # *T, [N, D]
    stride_q_n, stride_q_h,  # q strides: between tokens, between heads
    stride_k_n, stride_k_h,  # k strides
    stride_cos_n, stride_sin_n,  # cos and sin: between tokens
    num_q_heads,  # H
    num_k_heads,  # Hkv
    # With WRITE_KV (NOTE 4) only; otherwise unused:
    v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,  # v [N, Hkv, D], caches [B, S, Hkv, D], slots [N]
    stride_v_n, stride_v_h, stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    HALF: tl.constexpr,  # D / 2
    BLOCK_HALF: tl.constexpr,  # D / 2 rounded up to a power of two
    Q_HEADS: tl.constexpr,  # H rounded up to a power of two
    K_HEADS: tl.constexpr,  # Hkv rounded up to a power of two
    WRITE_KV: tl.constexpr = False,  # also store k and v at the token's cache slot (NOTE 4)
    BLOCK_SIZE: tl.constexpr = 1,  # S, tokens per cache block
    PAD_SLOT: tl.constexpr = -1,  # kv_cache_write.PAD_SLOT_ID
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (dependent_launch.py)
):
    """One program per token: its cos and sin once, then all its q heads and k heads; with
    ``WRITE_KV``, its rotated k heads and its v heads at its cache slot."""
    wait_for_the_kernel_ahead(USE_PDL)
    token = tl.program_id(0)
    dims, dim_ok, cos1, sin1, cos2, sin2 = load_angles(cos_ptr, sin_ptr, token, stride_cos_n, stride_sin_n,
                                                       HALF, BLOCK_HALF)  # fmt: skip
    _rotate_heads(q_ptr, token, stride_q_n, stride_q_h, num_q_heads, cos1, sin1, cos2, sin2, dims, dim_ok,
                  HALF, Q_HEADS)  # fmt: skip
    k1, k2 = _rotate_heads(k_ptr, token, stride_k_n, stride_k_h, num_k_heads, cos1, sin1, cos2, sin2, dims, dim_ok,
                           HALF, K_HEADS)  # fmt: skip
    if WRITE_KV:
        store_token_kv(k1, k2, v_ptr, token, stride_v_n, stride_v_h, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                       stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
                       num_k_heads, dims, dim_ok, HALF, K_HEADS, BLOCK_SIZE, PAD_SLOT)  # fmt: skip
# --8<-- [end:kernel]


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **more) -> None:
    """The rotating launchers' checks, before anything is written: q ``[N, H, D]`` and k
    ``[N, Hkv, D]`` with unit stride along an even D, cos and sin ``[N, D]``; one dtype and one
    device for them and for ``more`` (named tensors a launcher adds), a device Triton runs on."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [N, H, D] and [N, Hkv, D]")
    n, _, d = q.shape
    if d % 2:
        raise ValueError(f"head size {d} must be even: rotary pairs dimension i with i + D/2")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, d) or t.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(t.shape)} with strides {t.stride()} must be [{n}, {d}], unit stride last")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q strides {q.stride()} and k strides {k.stride()} must be unit along D")
    named = {"q": q, "k": k, "cos": cos, "sin": sin, **more}
    if len({t.dtype for t in named.values()}) != 1:
        raise ValueError(", ".join(f"{name} {t.dtype}" for name, t in named.items()) + ": must be one dtype")
    if len({t.device for t in named.values()}) != 1:
        raise ValueError(", ".join(f"{name} on {t.device}" for name, t in named.items()) + ": must be one device")
    if not triton_can_run_on(q.device):
        raise ValueError(f"device {q.device}: Triton needs CUDA or TRITON_INTERPRET=1")


# --8<-- [start:launcher]
def rotary_triton(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, Hkv, D]
    cos: torch.Tensor,  # [N, D]
    sin: torch.Tensor,  # [N, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of ``rotary_torch``: the same values (NOTE 2), written into q and
    k, which it returns (NOTE 3)."""
    check_rotary_args(q, k, cos, sin)
    if q.shape[0]:
        _launch(q, k, cos, sin, write=None)
    return q, k


def rotary_write_kv_triton(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    cos: torch.Tensor,  # [N, D]
    sin: torch.Tensor,  # [N, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    slot_mapping: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_triton`` and then ``write_kv_cache`` of the rotated k and of v, in one launch
    (NOTE 4): q and k rotated in place and returned, the caches at the mapped slots."""
    check_rotary_args(q, k, cos, sin)
    check_write_args(k, v, key_cache, value_cache, slot_mapping)
    if q.shape[0]:
        _launch(q, k, cos, sin, write=(v, key_cache, value_cache, slot_mapping))
    return q, k


def _launch(q, k, cos, sin, write) -> None:
    d = q.shape[2]
    write_args, write_consts = fused_write_args(write, q)
    _rotary_kernel[(q.shape[0],)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q.shape[1], k.shape[1], *write_args, HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2),
        Q_HEADS=triton.next_power_of_2(q.shape[1]), K_HEADS=triton.next_power_of_2(k.shape[1]), **write_consts,
        enable_fp_fusion=False, **launch_options(q.device),  # NOTE 2
    )  # fmt: skip
# --8<-- [end:launcher]


# --8<-- [start:choose]
def rotary_impl() -> str:
    """The implementation ``TINYVLLM_ROTARY`` asks for ("auto" when unset; ``platform.py``)."""
    return impl_from_env(IMPL_ENV)


def rotary_applies(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "auto") -> bool:
    """Whether ``rotary`` runs the kernel: for CUDA tensors it takes, or when ``impl`` is "triton"."""
    takes = q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    return uses_kernel(impl, q.is_cuda and takes and q.dtype == cos.dtype)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_triton`` where ``rotary_applies``, ``rotary_torch`` otherwise (or when
    ``impl`` is "torch")."""
    if rotary_applies(q, k, cos, sin, impl):
        return rotary_triton(q, k, cos, sin)
    return rotary_torch(q, k, cos, sin)
# --8<-- [end:choose]
