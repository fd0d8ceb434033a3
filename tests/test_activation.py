"""SiLU-and-multiply in one kernel: the Triton version against the torch ops (under the
interpreter on the CPU, compiled on a GPU), in place, the kernels it saves, the choice between
them, bad input, and a whole engine with it (models/activation.py)."""

from __future__ import annotations

import pytest
import torch
from engine_compare import assert_same_tokens_and_logprobs, generate_each_way
from kernel_counting import CountKernels, Launches

from tinyvllm.models import activation as act
from tinyvllm.models.activation import silu_and_mul, silu_and_mul_torch, silu_and_mul_triton
from tinyvllm.models.llama import MLP
from tinyvllm.models.loader import load_model_spec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel under the interpreter
# Under the interpreter numpy's exp stands in for libdevice's expf (module NOTE 1): a float32
# may differ in its last bit, and a float16 rounded from it by one ulp, rarely.
ULPS = {torch.float32: 2 * 2.0**-23, torch.float16: 2.0**-10}


def gate_up(rows: int, size: int, dtype: torch.dtype, device: str = DEVICE, seed: int = 0, scale: float = 4.0):
    """An ``[rows, 2 * size]`` gate/up output, values over silu's whole curve (-scale*3 .. scale*3)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * size, generator=g) * scale).to(dtype).to(device)


def check_against_torch(rows: int, size: int, dtype: torch.dtype, device: str = DEVICE, exact: bool = False, **kw):
    x = gate_up(rows, size, dtype, device, **kw)
    expected, up = silu_and_mul_torch(x.clone(), size).clone(), x[:, size:].clone()
    out = silu_and_mul_triton(x, size)
    assert out.shape == (rows, size) and out.data_ptr() == x.data_ptr(), "the gate half, in place (module invariants)"
    assert torch.equal(x[:, size:], up), "the up half is left as it was"
    if exact:
        assert torch.equal(out, expected), "module NOTE 1: the same bits"
    else:
        torch.testing.assert_close(out, expected, rtol=ULPS[dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bfloat16 down; GPU twin
@pytest.mark.parametrize("rows, size", [(3, 48), (2, 1100), (0, 16), (1, 8)])  # 1100: two column blocks, the last part empty
def test_kernel_writes_silu_of_gate_times_up_over_the_gate_half(dtype, rows, size):
    check_against_torch(rows, size, dtype)


def test_the_torch_ops_are_two_kernels_and_the_kernel_one_launch(monkeypatch):
    """Module concept: ``silu_`` then ``mul_``, each a pass over ``[N, I]``; the kernel is one
    launch, one program per (row, block of columns), no torch op."""
    x = gate_up(4, 1500, torch.bfloat16, "cpu")
    with CountKernels() as counted:
        silu_and_mul_torch(x, 1500)
    assert counted.ops == ["silu_", "mul_"]
    launches = Launches()
    monkeypatch.setattr(act, "_silu_and_mul_kernel", launches)
    with CountKernels() as counted:
        silu_and_mul_triton(x, 1500)
    assert counted.ops == [] and launches.calls == [((4, 2), dict(SIZE=1500, BLOCK=1024, LIBDEVICE=False, USE_PDL=False))]


def test_auto_picks_silu_and_mul_for_cuda_tensors_only_and_the_env_forces_either(monkeypatch, tiny_model_dirs):
    x = gate_up(3, 8, torch.float32, "cpu")
    launches = Launches()
    monkeypatch.setattr(act, "_silu_and_mul_kernel", launches)
    silu_and_mul(x.clone(), 8)  # CPU tensors: the torch ops
    assert launches.calls == []
    silu_and_mul(x.clone(), 8, impl="triton")  # forced: on the CPU, the interpreter
    assert len(launches.calls) == 1
    spec = load_model_spec(tiny_model_dirs["qwen3"])
    monkeypatch.setenv("TINYVLLM_SILU_AND_MUL", "torch")
    assert MLP(spec).act_impl == "torch"
    monkeypatch.setenv("TINYVLLM_SILU_AND_MUL", "fused")
    with pytest.raises(ValueError, match="TINYVLLM_SILU_AND_MUL='fused'"):
        MLP(spec)


@pytest.mark.parametrize(
    "make, size, message",
    [
        (lambda: gate_up(2, 8, torch.float32, "cpu")[:, :15], 8, r"gate_up \(2, 15\) .* must be \[N, 2 \* 8\]"),
        (lambda: gate_up(2, 8, torch.float32, "cpu").t().contiguous().t(), 8, r"strides \(1, 2\) .* unit stride last"),
        (lambda: gate_up(2, 8, torch.float32, "cpu")[0], 8, r"gate_up \(16,\)"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_is_written(make, size, message):
    x = make()
    before = x.clone()
    with pytest.raises(ValueError, match=message):
        silu_and_mul_triton(x, size)
    assert torch.equal(x, before)


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
@pytest.mark.slow
def test_the_engine_gives_the_same_tokens_with_the_kernel(tiny_model_dirs, monkeypatch, mode):
    """Every layer's MLP through the kernel (forced, under the interpreter), eager and in
    emulated graphs: the same greedy tokens as the torch ops, and logprobs within float32's
    last bits (the interpreter's exp, module NOTE 1)."""

    def check(llm, impl):
        assert {m.act_impl for m in llm.engine.model_runner.model.modules() if isinstance(m, MLP)} == {impl}

    runs = generate_each_way(tiny_model_dirs["qwen3"], monkeypatch, "TINYVLLM_SILU_AND_MUL", mode, check)
    assert_same_tokens_and_logprobs(runs["torch"], runs["triton"], abs_tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_silu_and_mul_matches_the_torch_ops_bit_for_bit_at_qwen3s_mlp(dtype):
    """Qwen3-0.6B's MLP (I = 3072) in a prefill chunk of 8192 tokens and a decode batch of 32,
    bit for bit in every dtype (module NOTE 1: libdevice's expf and a rounded division)."""
    check_against_torch(8192, 3072, dtype, "cuda", exact=True)
    check_against_torch(32, 3072, dtype, "cuda", exact=True, seed=1, scale=20.0)
    x = gate_up(32, 3072, dtype, "cuda", seed=2)
    expected = silu_and_mul_torch(x.clone(), 3072)
    assert torch.equal(silu_and_mul(x, 3072), expected)  # auto: the kernel on CUDA
