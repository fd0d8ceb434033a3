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
from test_rotary import fused_qkv, write_both_ways

from tinyvllm import LLM, SamplingParams
from tinyvllm.models import qk_norm_rotary as fused
from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID, write_kv_cache_triton
from tinyvllm.models.qk_norm_rotary import (
    FUSED_KV_WRITE_ENV,
    fused_kv_write,
    qk_norm_rotary_applies,
    qk_norm_rotary_torch,
    qk_norm_rotary_triton,
    qk_norm_rotary_write_kv_triton,
)
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
    assert launches.calls == [((4,), dict(HALF=8, BLOCK_HALF=8, Q_HEADS=4, K_HEADS=2, WRITE_KV=False, BLOCK_SIZE=1,
                                          PAD_SLOT=PAD_SLOT_ID, enable_fp_fusion=False, USE_PDL=False))]  # fmt: skip


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
    assert_refused_and_nothing_written(qk_norm_rotary_triton, _bad(change), message)


def assert_refused_and_nothing_written(launcher, args: dict, message: str) -> None:
    """``launcher(**args)`` raises a ValueError matching ``message`` and leaves every tensor as it was."""
    before = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        launcher(**args)
    assert all(torch.equal(args[name], t) for name, t in before.items()), "nothing written"


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
@pytest.mark.slow
def test_the_engine_uses_it_for_qwen3_and_gives_the_same_tokens(tiny_model_dirs, monkeypatch, mode):
    """The tiny Qwen3 with every norm and rotary forced to kernels (so the q/k norms and the
    rotary go through the fused one, counted) against the torch ops, eager and in emulated
    graphs: the same greedy tokens, logprobs within float32 rounding."""
    calls = []
    real = fused._qk_norm_rotary_kernel

    class Counted:  # the jitted kernel, its launches counted (by either launcher: NOTE 3's too)
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(fused, "_qk_norm_rotary_kernel", Counted())
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bfloat16: the GPU twin
@pytest.mark.parametrize("shape", [(7, 4, 2, 16), (3, 3, 3, 24), (1, 2, 1, 8)])  # GQA; no power of two; one decode
def test_fused_kv_write_stores_what_the_two_launches_store(dtype, shape):
    """q, k, v and both caches bit for bit as the norms-and-rotary kernel followed by the KV
    write: the rotated k and the untouched v at each row's slot, padding rows nowhere, every
    other slot as it was."""
    fused_out, separate, slots = write_both_ways(*shape, dtype=dtype, norms=True)
    for name, a, b in zip(("q", "k", "v", "key_cache", "value_cache"), fused_out, separate):
        assert torch.equal(a, b), name
    assert (slots != PAD_SLOT_ID).any() and ((slots == PAD_SLOT_ID).any() or len(slots) == 1)


def test_fused_kv_write_matches_the_triton_writer_too():
    """Against the backend's Triton writer (power-of-two heads), as the engine runs it unfused."""
    _, q, k, v, cos, sin = fused_qkv(5, 4, 2, 16, seed=3)
    v = v.view(5, 2, 16)
    w = torch.ones(16, device=DEVICE)
    cache = torch.zeros(2, 3, 4, 2, 16, device=DEVICE)
    expected = cache.clone()
    slots = torch.tensor([9, 2, PAD_SLOT_ID, 0, 11], device=DEVICE)
    qs, ks = qk_norm_rotary_triton(q.clone(), k.clone(), w, w, 1e-6, cos, sin)
    write_kv_cache_triton(ks, v, expected[0], expected[1], slots)
    qk_norm_rotary_write_kv_triton(q, k, v, w, w, 1e-6, cos, sin, cache[0], cache[1], slots)
    assert torch.equal(cache, expected) and torch.equal(k, ks) and torch.equal(q, qs)


def test_one_launch_replaces_the_norms_rotary_and_kv_write(monkeypatch):
    """NOTE 3: one launch, the write switched on by a constexpr, the cache's block size passed."""
    _, q, k, v, cos, sin = fused_qkv(4, 4, 2, 16)
    cache = torch.zeros(2, 3, 8, 2, 16, device=DEVICE)
    launches = Launches()
    monkeypatch.setattr(fused, "_qk_norm_rotary_kernel", launches)
    qk_norm_rotary_write_kv_triton(q, k, v.view(4, 2, 16), torch.ones(16, device=DEVICE), torch.ones(16, device=DEVICE),
                                   1e-6, cos, sin, cache[0], cache[1], torch.arange(4, device=DEVICE))  # fmt: skip
    assert launches.calls == [((4,), dict(HALF=8, BLOCK_HALF=8, Q_HEADS=4, K_HEADS=2, WRITE_KV=True, BLOCK_SIZE=8,
                                          PAD_SLOT=PAD_SLOT_ID, enable_fp_fusion=False, USE_PDL=False))]  # fmt: skip


def _bad_write(change):
    _, q, k, v, cos, sin = fused_qkv(2, 2, 1, 8)
    cache = torch.zeros(2, 2, 4, 1, 8, device=DEVICE)
    args = dict(q=q, k=k, v=v.view(2, 1, 8), q_weight=torch.ones(8, device=DEVICE), k_weight=torch.ones(8, device=DEVICE),
                eps=1e-6, cos=cos, sin=sin, key_cache=cache[0], value_cache=cache[1],
                slot_mapping=torch.tensor([3, 4], device=DEVICE))  # fmt: skip
    change(args)
    return args


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(slot_mapping=a["slot_mapping"][:1]), "slot_mapping \\(1,\\) must be \\[N\\] with N = 2"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "slot_mapping dtype torch.float32"),
        (lambda a: a.update(value_cache=a["value_cache"].double()), "dtypes differ"),
        (lambda a: a.update(key_cache=torch.zeros(2, 4, 2, 8), value_cache=torch.zeros(2, 4, 2, 8)),
         "cache heads/dim \\(2, 8\\) != key heads/dim \\(1, 8\\)"),
        (lambda a: a.update(v=torch.zeros(3, 1, 8)), "key \\(2, 1, 8\\) and value \\(3, 1, 8\\)"),
        (lambda a: a.update(k_weight=torch.ones(4)), "k_weight \\(4,\\) must be \\[8\\]"),
    ],
)  # fmt: skip
def test_bad_fused_write_input_is_refused_before_any_launch_and_nothing_is_written(change, message):
    assert_refused_and_nothing_written(qk_norm_rotary_write_kv_triton, _bad_write(change), message)


@pytest.mark.parametrize("value, fused_on", [(None, True), ("1", True), ("0", False)])
def test_the_fused_kv_write_is_on_unless_the_variable_says_0(monkeypatch, value, fused_on):
    if value is None:
        monkeypatch.delenv(FUSED_KV_WRITE_ENV, raising=False)
    else:
        monkeypatch.setenv(FUSED_KV_WRITE_ENV, value)
    assert fused_kv_write() is fused_on


def test_a_fused_kv_write_variable_other_than_0_or_1_is_refused_by_name(monkeypatch, tiny_model_dirs):
    """By the reader, and so by every layer as the model is built: before any weight is read."""
    from tinyvllm.models.llama import Attention
    from tinyvllm.models.loader import load_model_spec

    spec = load_model_spec(tiny_model_dirs["qwen3"])
    monkeypatch.setenv(FUSED_KV_WRITE_ENV, "0")
    assert Attention(spec, backend=None).fuse_kv_write is False
    monkeypatch.setenv(FUSED_KV_WRITE_ENV, "yes")
    for build in (fused_kv_write, lambda: Attention(spec, backend=None)):
        with pytest.raises(ValueError, match="TINYVLLM_FUSED_KV_WRITE='yes': must be '0' or '1'"):
            build()


@pytest.mark.parametrize("family, mode", [("qwen3", "FULL_AND_PIECEWISE"), ("llama", "NONE")])
@pytest.mark.slow
def test_the_engine_fuses_the_kv_write_into_the_rotation_and_gives_the_same_bits(tiny_model_dirs, monkeypatch, mode,
                                                                                 family):  # fmt: skip
    """The tiny Qwen3 (its q/k norms and rotary as one kernel) in emulated graphs (a decode in
    a FULL graph, a mixed step's write between PIECEWISE pieces) and the tiny Llama (rotary as
    a kernel) eager, the KV write fused (the default) against the backend's writer
    (``TINYVLLM_FUSED_KV_WRITE=0``), with chunked prefill and a prefix hit: the same tokens
    and logprobs, exactly (the same stores). Fused, the backend's writer never runs, and the
    family's fused launcher runs once a layer a forward. (Each family's kernels, fused by
    default, against the torch ops in both modes: ``test_rotary.py``, and the test above.)"""
    import tinyvllm.models.llama as llama

    monkeypatch.setenv("TINYVLLM_RMS_NORM", "triton")
    monkeypatch.setenv("TINYVLLM_ROTARY", "triton")
    calls = {"backend": 0, "qk_norm_rotary_write_kv_triton": 0, "rotary_write_kv_triton": 0}

    def counted(name, real):
        def call(*args):
            calls[name] += 1
            return real(*args)

        return call

    backend = llama.ATTENTION_BACKENDS["triton"]
    monkeypatch.setitem(llama.ATTENTION_BACKENDS, "triton", type(backend)(
        counted("backend", backend.write_kv_cache), backend.paged_attention, backend.cudagraph_support,
        backend.plan_step, backend.step_rows))  # fmt: skip
    for name in ("qk_norm_rotary_write_kv_triton", "rotary_write_kv_triton"):
        monkeypatch.setattr(llama, name, counted(name, getattr(llama, name)))
    fused_name = "qk_norm_rotary_write_kv_triton" if family == "qwen3" else "rotary_write_kv_triton"
    shared = list(range(3, 24))  # 21 tokens: the second prompt hits the first's full block (block size 16)
    prompts = [shared + [30, 31], shared + [40], [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)
    runs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(FUSED_KV_WRITE_ENV, value)
        calls.update(dict.fromkeys(calls, 0))
        llm = LLM(str(tiny_model_dirs[family]), device="cpu", max_model_len=64, attention_backend="triton",
                  block_size=16, enable_prefix_caching=True, max_num_batched_tokens=16,
                  compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]})  # fmt: skip
        runs[value] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ran = {name for name, n in calls.items() if n}
        assert ran == ({"backend"} if value == "0" else {fused_name}), (value, calls)
        assert calls["backend" if value == "0" else fused_name] % llm.engine.model_runner.model.spec.num_hidden_layers == 0
    assert_same_tokens_and_logprobs(runs["0"], runs["1"])


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

