"""RMSNorm in one kernel: the Triton version against the torch ops (under the interpreter on
the CPU, compiled on a GPU), the kernels it saves, the choice between them, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from engine_compare import assert_same_tokens_and_logprobs, generate_each_way
from kernel_counting import CountKernels, Launches

from tinyvllm import LLM, SamplingParams
from tinyvllm.models import rms_norm as rms
from tinyvllm.models.llama import RMSNorm
from tinyvllm.models.rms_norm import (
    add_rms_norm,
    add_rms_norm_torch,
    add_rms_norm_triton,
    rms_norm,
    rms_norm_torch,
    rms_norm_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel under the interpreter
ULP = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # a few ulps, relative


def assert_close_to_torch(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
    """Within a couple of ulps of the model's dtype (module NOTE 2: the sums' order differs)."""
    ref = rms_norm_torch(x, w, eps)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    tol = 2 * ULP[x.dtype] * ref.float().abs().clamp_min(1.0)
    assert ((out.float() - ref.float()).abs() <= tol).all(), (out - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bfloat16 down; GPU twin
def test_kernel_matches_the_torch_ops_on_rows_and_on_heads_of_a_fused_projection(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 40, dtype=dtype, device=DEVICE)  # [N, hidden], a size that is no power of two
    w = torch.randn(40, dtype=dtype, device=DEVICE)
    assert_close_to_torch(rms_norm_triton(x, w, 1e-5), x, w, 1e-5)
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16, dtype=dtype, device=DEVICE)  # [N, H*D + 2*Hkv*D], as qkv_proj writes
    q = qkv[:, : 4 * 16].view(5, 4, 16)  # [N, H, D]: rows 96 elements apart, not contiguous
    wq = torch.randn(16, dtype=dtype, device=DEVICE)
    assert not q.is_contiguous()
    assert_close_to_torch(rms_norm_triton(q, wq, 1e-6), q, wq, 1e-6)


@given(
    tokens=st.integers(0, 5), heads=st.integers(1, 3), size=st.sampled_from([8, 16, 24, 40]),
    pad=st.integers(0, 8), eps=st.sampled_from([1e-6, 1e-5, 0.5]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
)  # fmt: skip
def test_kernel_matches_the_torch_ops_on_any_strided_view(tokens, heads, size, pad, eps, scale):
    g = torch.Generator().manual_seed(tokens * 1000 + heads * 100 + size + pad)
    wide = torch.randn(tokens, heads * size + pad, generator=g).to(DEVICE) * scale  # [N, H*size + pad]
    x = wide[:, pad:].view(tokens, heads, size)  # an offset, strided view
    w = torch.randn(size, generator=g).to(DEVICE)
    assert_close_to_torch(rms_norm_triton(x, w, eps), x, w, eps)


def test_the_torch_ops_are_eight_kernels_and_the_kernel_one_launch(monkeypatch):
    """Module NOTE 1: one bfloat16 norm is eight operations that each read and write the
    whole tensor; the kernel is one launch, one program per row, into a fresh output."""
    x = torch.randn(4, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(32, dtype=torch.bfloat16, device=DEVICE)
    with CountKernels() as counted:
        rms_norm_torch(x, w, 1e-6)
    assert counted.ops == ["_to_copy", "pow", "mean", "add", "rsqrt", "mul", "_to_copy", "mul"]
    launches = Launches()
    monkeypatch.setattr(rms, "_rms_norm_kernel", launches)
    with CountKernels() as counted:
        rms_norm_triton(x, w, 1e-6)
    assert counted.ops == [] and launches.calls == [((4,), {"SIZE": 32, "BLOCK": 32, "USE_PDL": False})]


def test_a_bfloat16_decode_forward_runs_eight_operations_a_norm(tiny_model_dirs, monkeypatch):
    """Module NOTE 1, counted in one decode forward of the tiny Qwen3 in bfloat16 with the
    torch ops: nine norms (four in each of two layers, and the final one), eight operations
    each, over a third of the forward's operations even with the CPU's attention backend
    (about forty operations a layer, where the Triton backend launches two kernels)."""
    monkeypatch.setenv("TINYVLLM_RMS_NORM", "torch")
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", dtype="bfloat16", attention_backend="torch", max_model_len=64)
    runner = llm.engine.model_runner
    counter, per_norm = CountKernels(), []
    norm_forward, add_forward, model_forward = RMSNorm.forward, RMSNorm.add_forward, runner.model.forward

    def counted_norm(self, x):
        before = len(counter.ops)
        out = norm_forward(self, x)
        per_norm.append(len(counter.ops) - before)
        return out

    def counted_add_norm(self, x, delta):  # the residual add, then the norm (NOTE 3)
        before = len(counter.ops)
        out = add_forward(self, x, delta)
        assert counter.ops[before] == "add"
        per_norm.append(len(counter.ops) - before - 1)
        return out

    def counted_model(*args, **kwargs):
        with counter:
            return model_forward(*args, **kwargs)

    monkeypatch.setattr(RMSNorm, "forward", counted_norm)
    monkeypatch.setattr(RMSNorm, "add_forward", counted_add_norm)
    monkeypatch.setattr(runner.model, "forward", counted_model)
    llm.engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.engine.step()  # the prefill
    counter.ops.clear(), per_norm.clear()
    llm.engine.step()  # one decode forward
    assert per_norm == [8] * 9
    assert sum(per_norm) / len(counter.ops) > 1 / 3


def check_add_norm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, eps: float) -> None:
    """NOTE 3: the sum has the torch add's bits, the norm ``rms_norm_triton``'s of that sum."""
    out, total = add_rms_norm_triton(x, delta, w, eps)
    assert torch.equal(total, x + delta) and total.is_contiguous()
    assert torch.equal(out, rms_norm_triton(x + delta, w, eps))
    assert_close_to_torch(out, x + delta, w, eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bfloat16: the GPU twin
def test_the_residual_add_and_the_norm_in_one_kernel_give_the_two_kernels_bits(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 40, dtype=dtype, device=DEVICE)  # the residual stream [N, hidden]
    wide = torch.randn(7, 48, dtype=dtype, device=DEVICE)
    delta = wide[:, 8:]  # o_proj's output as a strided view: rows 48 apart
    w = torch.randn(40, dtype=dtype, device=DEVICE)
    check_add_norm(x, delta, w, 1e-5)


@given(tokens=st.integers(0, 5), size=st.sampled_from([8, 24, 40]), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_the_fused_residual_add_matches_on_any_rows(tokens, size, scale):
    g = torch.Generator().manual_seed(tokens * 100 + size)
    x, delta = ((torch.randn(tokens, size, generator=g) * scale).to(DEVICE) for _ in range(2))
    check_add_norm(x, delta, torch.randn(size, generator=g).to(DEVICE), 1e-6)


def test_the_add_and_the_norm_are_nine_operations_and_the_fused_kernel_one_launch(monkeypatch):
    x, delta = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.randn(32, dtype=torch.bfloat16)
    with CountKernels() as counted:
        add_rms_norm_torch(x, delta, w, 1e-6)
    assert counted.ops == ["add", "_to_copy", "pow", "mean", "add", "rsqrt", "mul", "_to_copy", "mul"]
    launches = Launches()
    monkeypatch.setattr(rms, "_add_rms_norm_kernel", launches)
    xd, dd, wd = x.to(DEVICE), delta.to(DEVICE), w.to(DEVICE)
    with CountKernels() as counted:
        add_rms_norm_triton(xd, dd, wd, 1e-6)
    assert counted.ops == [] and launches.calls == [((4,), {"SIZE": 32, "BLOCK": 32, "USE_PDL": False})]
    assert torch.equal(add_rms_norm(x, delta, w, 1e-6)[1], x + delta)  # CPU tensors: the torch ops


@pytest.mark.parametrize(
    "x, delta, w, message",
    [
        (torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8), "must be one \\[N, size\\] shape"),
        (torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), "must be one \\[N, size\\] shape"),
        (torch.randn(2, 8), torch.randn(2, 8).half(), torch.randn(8), "delta torch.float16"),
        (torch.randn(2, 8), torch.randn(2, 8), torch.randn(4), "must be \\[8\\]"),
    ],
)
def test_bad_input_to_the_fused_residual_add_is_refused(x, delta, w, message):
    with pytest.raises(ValueError, match=message):
        add_rms_norm_triton(x, delta, w, 1e-6)


def test_auto_picks_the_kernel_for_cuda_tensors_only_and_the_env_forces_either(monkeypatch):
    x = torch.randn(3, 16)
    w = torch.randn(16)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))  # a CPU tensor: the torch ops, exactly
    xd, wd = x.to(DEVICE), w.to(DEVICE)
    assert_close_to_torch(rms_norm(xd, wd, 1e-6, impl="triton"), xd, wd, 1e-6)  # on the CPU, the interpreter
    monkeypatch.setenv("TINYVLLM_RMS_NORM", "torch")
    assert RMSNorm(16, 1e-6).impl == "torch"
    monkeypatch.setenv("TINYVLLM_RMS_NORM", "fused")
    with pytest.raises(ValueError, match="TINYVLLM_RMS_NORM='fused'"):
        RMSNorm(16, 1e-6)


@pytest.mark.parametrize(
    "x, w, message",
    [
        (torch.randn(2, 3, 4, 8), torch.randn(8), "must be \\[N, size\\] or \\[N, H, size\\]"),
        (torch.randn(8, 2).t(), torch.randn(2), "unit stride last"),
        (torch.randn(2, 8), torch.randn(4), "must be \\[8\\]"),
        (torch.randn(2, 8), torch.randn(8, dtype=torch.float64), "must be \\[8\\] torch.float32"),
    ],
)
def test_bad_input_is_refused_before_any_launch(x, w, message):
    with pytest.raises(ValueError, match=message):
        rms_norm_triton(x, w, 1e-6)


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
@pytest.mark.slow
def test_the_engine_gives_the_same_tokens_with_the_kernel_as_with_the_torch_ops(tiny_model_dirs, monkeypatch, mode):
    """Every norm of the tiny Qwen3 (before and after attention, q and k per head, the final
    one) through the kernel, eager and in emulated graphs: the same greedy tokens, logprobs
    within float32 rounding."""

    def check(llm, impl):
        norms = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, RMSNorm)]
        assert len(norms) == 2 * 4 + 1 and {m.impl for m in norms} == {impl}

    runs = generate_each_way(tiny_model_dirs["qwen3"], monkeypatch, "TINYVLLM_RMS_NORM", mode, check)
    assert_same_tokens_and_logprobs(runs["torch"], runs["triton"], abs_tol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_kernel_matches_the_torch_ops_at_the_model_shapes(dtype):
    """Qwen3-0.6B's shapes: a prefill's [8192, 1024] and the q heads [N, 16, 128] of qkv."""
    torch.manual_seed(0)
    x = torch.randn(8192, 1024, dtype=dtype, device="cuda")
    w = torch.randn(1024, dtype=dtype, device="cuda")
    assert_close_to_torch(rms_norm_triton(x, w, 1e-6), x, w, 1e-6)
    qkv = torch.randn(300, 16 * 128 + 2 * 8 * 128, dtype=dtype, device="cuda")
    q = qkv[:, : 16 * 128].view(300, 16, 128)
    wq = torch.randn(128, dtype=dtype, device="cuda")
    assert_close_to_torch(rms_norm_triton(q, wq, 1e-6), q, wq, 1e-6)
    assert_close_to_torch(rms_norm(q, wq, 1e-6), q, wq, 1e-6)  # auto: the kernel on CUDA
    delta = torch.randn(8192, 1024, dtype=dtype, device="cuda")
    check_add_norm(x, delta, w, 1e-6)  # the residual add fused (NOTE 3), bfloat16 included
