"""Qwen3's q/k norms and rotary in one kernel: against the torch ops and against the two
separate kernels (under the interpreter on the CPU, compiled on a GPU), in place, when the
engine uses it, bad input, and the engine's tokens with it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from engine_compare import assert_same_tokens_and_logprobs
from kernel_counting import Launches
from test_rotary import fused_qkv

from tinyvllm import LLM, SamplingParams
from tinyvllm.models import qk_norm_rotary as fused
from tinyvllm.models.qk_norm_rotary import qk_norm_rotary_applies, qk_norm_rotary_torch, qk_norm_rotary_triton
from tinyvllm.models.rms_norm import rms_norm_triton
from tinyvllm.models.rotary import rotary_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel under the interpreter
ULP = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float = 4) -> None:
    """A few ulps of the dtype, relative (module NOTE 1: the squares are summed in another
    order, and a norm's ulp can move a rotated value by two of the rotation's)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = ulps * ULP[ref.dtype] * ref.float().abs().clamp_min(1.0)
    assert ((out.float() - ref.float()).abs() <= tol).all(), (out.float() - ref.float()).abs().max()


def run_both(tokens, heads, kv_heads, size, dtype=torch.float32, device=DEVICE, seed=0, scale=1.0, eps=1e-6):
    """The fused kernel on one fused projection, and what it must match."""
    _, q, k, v, cos, sin = fused_qkv(tokens, heads, kv_heads, size, dtype, device, seed, scale)
    g = torch.Generator().manual_seed(seed + 1)
    wq, wk = (torch.randn(size, generator=g).to(dtype).to(device) for _ in range(2))
    expected = qk_norm_rotary_torch(q, k, wq, wk, eps, cos, sin)  # new tensors; q and k unchanged
    separate = rotary_triton(rms_norm_triton(q, wq, eps), rms_norm_triton(k, wk, eps), cos, sin)
    v_before = v.clone()
    out = qk_norm_rotary_triton(q, k, wq, wk, eps, cos, sin)
    assert out[0] is q and out[1] is k, "written in place"
    assert torch.equal(v, v_before), "v's part of the projection is untouched"
    return out, expected, separate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bfloat16 down; GPU twin
def test_kernel_normalises_and_rotates_q_and_k_in_place(dtype):
    for shape in ((7, 4, 2, 16), (3, 3, 3, 24)):  # GQA 2 at the tiny models' head size; no powers of two
        (q, k), expected, separate = run_both(*shape, dtype=dtype)
        for out, ref, sep in zip((q, k), expected, separate):
            assert_within_ulps(out, ref)
            assert_within_ulps(out, sep)


@given(
    tokens=st.integers(0, 5), heads=st.integers(1, 5), kv_heads=st.integers(1, 3),
    size=st.sampled_from([2, 8, 16, 24, 40]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
    eps=st.sampled_from([1e-6, 0.5]), seed=st.integers(0, 99),
)  # fmt: skip
def test_kernel_matches_norm_then_rotary_on_any_fused_projection(tokens, heads, kv_heads, size, scale, eps, seed):
    (q, k), expected, _ = run_both(tokens, heads, kv_heads, size, seed=seed, scale=scale, eps=eps)
    assert_within_ulps(q, expected[0])
    assert_within_ulps(k, expected[1])


def test_one_launch_replaces_three(monkeypatch):
    """Module header: the q norm, the k norm and the rotary (three launches) become one."""
    _, q, k, _, cos, sin = fused_qkv(4, 4, 2, 16)
    launches = Launches()
    monkeypatch.setattr(fused, "_qk_norm_rotary_kernel", launches)
    qk_norm_rotary_triton(q, k, torch.ones(16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6, cos, sin)
    assert launches.calls == [((4,), dict(HALF=8, BLOCK_HALF=8, Q_HEADS=4, K_HEADS=2, enable_fp_fusion=False))]


@pytest.mark.parametrize(
    "norm, rotary, on_cuda, applies",
    [("auto", "auto", True, True), ("auto", "auto", False, False), ("torch", "auto", True, False),
     ("auto", "torch", True, False), ("triton", "triton", False, True), ("triton", "auto", False, False)],
)  # fmt: skip
def test_it_applies_only_where_both_separate_forms_would_be_kernels(norm, rotary, on_cuda, applies):
    class Fake:  # a CUDA tensor's answers, without a GPU
        is_cuda = on_cuda

        @staticmethod
        def stride(dim):
            return 1

    assert qk_norm_rotary_applies(Fake(), norm, rotary) is applies


def _bad(change):
    _, q, k, _, cos, sin = fused_qkv(2, 2, 1, 8)
    args = dict(q=q, k=k, q_weight=torch.ones(8, device=DEVICE), k_weight=torch.ones(8, device=DEVICE),
                eps=1e-6, cos=cos, sin=sin)  # fmt: skip
    change(args)
    return args


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][0]), "must be \\[N, H, D\\] and \\[N, Hkv, D\\]"),
        (lambda a: a.update(q=torch.zeros(2, 2, 7), k=torch.zeros(2, 1, 7)), "head size 7 must be even"),
        (lambda a: a.update(cos=a["cos"][:1]), "cos \\(1, 8\\)"),
        (lambda a: a.update(k_weight=torch.ones(4)), "k_weight \\(4,\\) must be \\[8\\]"),
        (lambda a: a.update(q_weight=torch.ones(8, dtype=torch.float64)), "must be one dtype"),
        (lambda a: a.update(k=torch.zeros(2, 8, 2).transpose(1, 2)), "must be unit along D"),
    ],
)
def test_bad_fused_input_is_refused_before_any_launch_and_nothing_is_written(change, message):
    args = _bad(change)
    before = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        qk_norm_rotary_triton(**args)
    assert all(torch.equal(args[name], t) for name, t in before.items()), "nothing written"


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
@pytest.mark.slow
def test_the_engine_uses_it_for_qwen3_and_gives_the_same_tokens(tiny_model_dirs, monkeypatch, mode):
    """The tiny Qwen3 with every norm and rotary forced to kernels (so the q/k norms and the
    rotary go through the fused one, counted) against the torch ops, eager and in emulated
    graphs: the same greedy tokens, logprobs within float32 rounding."""
    calls = []
    real = fused.qk_norm_rotary_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("tinyvllm.models.llama.qk_norm_rotary_triton", counted)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    runs = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("TINYVLLM_RMS_NORM", impl)
        monkeypatch.setenv("TINYVLLM_ROTARY", impl)
        llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=64, attention_backend="triton",
                  compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]})  # fmt: skip
        before = len(calls)
        runs[impl] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert (len(calls) > before) == (impl == "triton")  # the fused kernel ran only with the kernels on
    assert_same_tokens_and_logprobs(runs["torch"], runs["triton"], abs_tol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_fused_kernel_matches_norm_then_rotary_at_the_model_shapes(dtype):
    """Qwen3-0.6B's heads (16 q, 8 k, of 128), a prefill chunk and a decode batch."""
    for tokens, seed, scale in ((8192, 0, 1.0), (32, 1, 300.0)):
        (q, k), expected, separate = run_both(tokens, 16, 8, 128, dtype=dtype, device="cuda", seed=seed, scale=scale)
        for out, ref, sep in zip((q, k), expected, separate):
            assert_within_ulps(out, ref)
            assert_within_ulps(out, sep)
