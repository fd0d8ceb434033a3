"""Rotary embedding in one kernel: the Triton version against the torch ops, bit for bit (under
the interpreter on the CPU, compiled on a GPU), in place, the kernels it saves, the choice
between them, bad input, and the engine's tokens with it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from engine_compare import assert_same_tokens_and_logprobs, generate_each_way
from kernel_counting import CountKernels, Launches

from tinyvllm.models import rotary as rot
from tinyvllm.models.loader import load_model_spec
from tinyvllm.models.llama import Attention
from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID, write_kv_cache_torch
from tinyvllm.models.rotary import rotary, rotary_applies, rotary_torch, rotary_triton, rotary_write_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel under the interpreter


def fused_qkv(tokens, heads, kv_heads, size, dtype=torch.float32, device=DEVICE, seed=0, scale=1.0):
    """q, k as views into one fused projection's output ``[N, (H + 2 Hkv) D]``, as
    ``qkv_proj`` writes it, and v's part; cos and sin ``[N, D]``."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * size, generator=g) * scale).to(dtype).to(device)
    q = qkv[:, : heads * size].view(tokens, heads, size)  # [N, H, D], rows (H + 2 Hkv) D apart
    k = qkv[:, heads * size : (heads + kv_heads) * size].view(tokens, kv_heads, size)  # [N, Hkv, D]
    v = qkv[:, (heads + kv_heads) * size :]
    angles = torch.rand(tokens, size // 2, generator=g) * 100.0  # position * inv_freq
    emb = torch.cat((angles, angles), dim=-1)  # [N, D], the neox layout
    return qkv, q, k, v, emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def write_both_ways(tokens, heads, kv_heads, size, dtype=torch.float32, device=DEVICE, seed=0, blocks=5, block_size=4,
                    norms=False):  # fmt: skip
    """A fused rotate-and-write kernel against the two launches it replaces (the rotation,
    with Qwen3's q/k norms when ``norms``, then the KV write of the rotated k and of v), from
    one projection and one cache filled with noise, the slots shuffled and rows 1, 4, ...
    padding. Returns (fused, separate) as (q, k, v, key_cache, value_cache) each, and the slots."""
    from tinyvllm.models.qk_norm_rotary import qk_norm_rotary_triton, qk_norm_rotary_write_kv_triton

    _, q, k, v, cos, sin = fused_qkv(tokens, heads, kv_heads, size, dtype, device, seed)
    v = v.view(tokens, kv_heads, size)  # [N, Hkv, D], rows (H + 2 Hkv) D apart, as the engine's
    g = torch.Generator().manual_seed(seed + 1)
    wq, wk = (torch.randn(size, generator=g).to(dtype).to(device) for _ in range(2))
    cache = torch.randn(2, blocks, block_size, kv_heads, size, generator=g).to(dtype).to(device)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[1::3] = PAD_SLOT_ID
    slots = slots.to(device)
    qs, ks, vs = (t.clone() for t in (q, k, v))
    cache_separate = cache.clone()
    if norms:
        qk_norm_rotary_triton(qs, ks, wq, wk, 1e-6, cos, sin)
        out = qk_norm_rotary_write_kv_triton(q, k, v, wq, wk, 1e-6, cos, sin, cache[0], cache[1], slots)
    else:
        rotary_triton(qs, ks, cos, sin)
        out = rotary_write_kv_triton(q, k, v, cos, sin, cache[0], cache[1], slots)
    write_kv_cache_torch(ks, vs, cache_separate[0], cache_separate[1], slots)
    assert out[0] is q and out[1] is k, "q and k written in place"
    return (q, k, v, cache[0], cache[1]), (qs, ks, vs, cache_separate[0], cache_separate[1]), slots


def assert_same_as_torch(tokens, heads, kv_heads, size, dtype=torch.float32, device=DEVICE, seed=0, scale=1.0):
    qkv, q, k, v, cos, sin = fused_qkv(tokens, heads, kv_heads, size, dtype, device, seed, scale)
    expected_q, expected_k = rotary_torch(q, k, cos, sin)  # new tensors; q and k unchanged
    v_before = v.clone()
    out_q, out_k = rotary_triton(q, k, cos, sin)
    assert out_q is q and out_k is k, "the kernel rotates in place (module NOTE 3)"
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k), "module NOTE 2: the same bits"
    assert torch.equal(v, v_before), "v's part of the projection is untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bfloat16 down; GPU twin
def test_kernel_rotates_q_and_k_in_place_exactly_as_the_torch_ops(dtype):
    assert_same_as_torch(7, 4, 2, 16, dtype)  # GQA 2, the tiny models' head size
    assert_same_as_torch(3, 3, 3, 24, dtype, seed=1)  # three heads and D/2 = 12: no powers of two


@given(
    tokens=st.integers(0, 5), heads=st.integers(1, 5), kv_heads=st.integers(1, 3),
    size=st.sampled_from([2, 8, 16, 24, 40]), scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 99),
)  # fmt: skip
def test_kernel_matches_the_torch_ops_bit_for_bit_on_any_fused_projection(tokens, heads, kv_heads, size, scale, seed):
    assert_same_as_torch(tokens, heads, kv_heads, size, seed=seed, scale=scale)


def test_the_torch_ops_are_five_kernels_a_tensor_and_the_kernel_one_launch(monkeypatch):
    """Module NOTE 1: rotating q and k with torch ops is ten operations, each a pass over a
    whole tensor; the kernel is one launch for both, one program per token, no torch op."""
    _, q, k, _, cos, sin = fused_qkv(4, 4, 2, 16, torch.bfloat16)
    with CountKernels() as counted:
        rotary_torch(q, k, cos, sin)
    assert counted.ops == ["neg", "cat", "mul", "mul", "add"] * 2
    launches = Launches()
    monkeypatch.setattr(rot, "_rotary_kernel", launches)
    with CountKernels() as counted:
        rotary_triton(q, k, cos, sin)
    constexprs = dict(HALF=8, BLOCK_HALF=8, Q_HEADS=4, K_HEADS=2, WRITE_KV=False, BLOCK_SIZE=1, PAD_SLOT=PAD_SLOT_ID,
                      enable_fp_fusion=False, USE_PDL=False)  # fmt: skip
    assert counted.ops == [] and launches.calls == [((4,), constexprs)]
    v, cache, slots = k.clone(), torch.zeros(2, 3, 8, 2, 16, dtype=q.dtype, device=DEVICE), torch.arange(4, device=DEVICE)
    with CountKernels() as counted:  # NOTE 4: the KV write rides in the same launch
        rotary_write_kv_triton(q, k, v, cos, sin, cache[0], cache[1], slots)
    assert counted.ops == [] and launches.calls[1] == ((4,), constexprs | dict(WRITE_KV=True, BLOCK_SIZE=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bfloat16: the GPU twin
@pytest.mark.parametrize("shape", [(7, 4, 2, 16), (3, 3, 3, 24), (1, 2, 1, 8)])  # GQA; no power of two; one decode
def test_rotary_with_the_kv_write_stores_what_the_two_launches_store(dtype, shape):
    """NOTE 4: q, k, v and both caches bit for bit as the rotary kernel followed by the KV
    write: the rotated k and the untouched v at each row's slot, padding rows nowhere, every
    other slot as it was."""
    fused, separate, slots = write_both_ways(*shape, dtype=dtype)
    for name, a, b in zip(("q", "k", "v", "key_cache", "value_cache"), fused, separate):
        assert torch.equal(a, b), name
    assert (slots != PAD_SLOT_ID).any() and ((slots == PAD_SLOT_ID).any() or len(slots) == 1)


def test_bad_kv_write_input_to_the_rotary_kernel_is_refused_before_anything_is_written():
    _, q, k, v, cos, sin = fused_qkv(2, 2, 1, 8)
    cache = torch.zeros(2, 2, 4, 1, 8, device=DEVICE)
    before = [t.clone() for t in (q, k, cache)]
    with pytest.raises(ValueError, match="slot_mapping \\(3,\\) must be \\[N\\] with N = 2"):
        rotary_write_kv_triton(q, k, v.view(2, 1, 8), cos, sin, cache[0], cache[1], torch.arange(3, device=DEVICE))
    with pytest.raises(ValueError, match="cos \\(1, 8\\)"):
        rotary_write_kv_triton(q, k, v.view(2, 1, 8), cos[:1], sin, cache[0], cache[1], torch.arange(2, device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip((q, k, cache), before)), "nothing written"


def test_auto_picks_the_rotary_kernel_for_cuda_tensors_only_and_the_env_forces_either(monkeypatch, tiny_model_dirs):
    _, q, k, _, cos, sin = fused_qkv(3, 2, 1, 8, device="cpu")
    expected = rotary_torch(q, k, cos, sin)
    out = rotary(q, k, cos, sin)  # CPU tensors: the torch ops, new tensors
    assert out[0] is not q and torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    assert not rotary_applies(q, k, cos, sin) and rotary_applies(q, k, cos, sin, impl="triton")
    _, q, k, _, cos, sin = fused_qkv(3, 2, 1, 8)
    assert rotary(q, k, cos, sin, impl="triton")[0] is q  # forced: on the CPU, the interpreter
    spec = load_model_spec(tiny_model_dirs["qwen3"])
    monkeypatch.setenv("TINYVLLM_ROTARY", "torch")
    assert Attention(spec, backend=None).rotary_impl == "torch"
    monkeypatch.setenv("TINYVLLM_ROTARY", "fused")
    with pytest.raises(ValueError, match="TINYVLLM_ROTARY='fused'"):
        Attention(spec, backend=None)


def _bad(change):
    _, q, k, _, cos, sin = fused_qkv(2, 2, 1, 8)
    args = dict(q=q, k=k, cos=cos, sin=sin)
    change(args)
    return args


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"][0]), "must be \\[N, H, D\\] and \\[N, Hkv, D\\]"),
        (lambda a: a.update(k=a["k"][:1]), "must be \\[N, H, D\\] and \\[N, Hkv, D\\]"),
        (lambda a: a.update(q=torch.zeros(2, 2, 7), k=torch.zeros(2, 1, 7)), "head size 7 must be even"),
        (lambda a: a.update(cos=a["cos"][:1]), "cos \\(1, 8\\)"),
        (lambda a: a.update(sin=torch.zeros(8, 2).t()), "sin \\(2, 8\\) with strides \\(1, 2\\)"),
        (lambda a: a.update(q=torch.zeros(2, 8, 2).transpose(1, 2)), "must be unit along D"),
        (lambda a: a.update(cos=a["cos"].double()), "cos torch.float64"),
    ],
)
def test_bad_rotary_input_is_refused_before_any_launch_and_nothing_is_written(change, message):
    args = _bad(change)
    before = {name: t.clone() for name, t in args.items()}
    with pytest.raises(ValueError, match=message):
        rotary_triton(**args)
    assert all(torch.equal(args[name], t) for name, t in before.items()), "nothing written"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
@pytest.mark.slow
def test_the_engine_gives_the_same_tokens_and_logprobs_with_the_kernel(tiny_model_dirs, monkeypatch, family, mode):
    """Every layer's q and k through the kernel, eager and in emulated graphs: in place on the
    q/k norms' outputs (Qwen3) and on views of the fused projection (Llama). The same
    greedy tokens and the same logprobs, bit for bit (module NOTE 2)."""

    def check(llm, impl):
        layers = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, Attention)]
        assert len(layers) == 2 and {m.rotary_impl for m in layers} == {impl}

    runs = generate_each_way(tiny_model_dirs[family], monkeypatch, "TINYVLLM_ROTARY", mode, check)
    assert_same_tokens_and_logprobs(runs["torch"], runs["triton"])  # bit for bit: no tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_kernel_matches_the_torch_ops_bit_for_bit_at_the_model_shapes(dtype):
    """Qwen3-0.6B's heads (16 q, 8 k, of 128) in a prefill chunk of 8192 tokens and a decode
    batch of 32, bit for bit in every dtype (module NOTE 2; float32 without fused multiply-adds)."""
    assert_same_as_torch(8192, 16, 8, 128, dtype, device="cuda")
    assert_same_as_torch(32, 16, 8, 128, dtype, device="cuda", seed=1, scale=300.0)
    qkv, q, k, v, cos, sin = fused_qkv(32, 16, 8, 128, dtype, device="cuda", seed=2)
    expected = rotary_torch(q, k, cos, sin)
    assert rotary(q, k, cos, sin)[0] is q and torch.equal(q, expected[0])  # auto: the kernel on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("norms", [False, True], ids=["rotary", "qk_norm_rotary"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kv_write_in_the_rotating_kernels_stores_what_the_two_launches_store(dtype, norms):
    """Both rotating kernels with the KV write (rotary.py NOTE 4, qk_norm_rotary.py NOTE 3) at
    Qwen3-0.6B's heads (16 q, 8 k, of 128), block size 16: a prefill chunk and a decode batch."""
    for tokens, seed in ((2048, 0), (32, 1)):
        fused, separate, _ = write_both_ways(tokens, 16, 8, 128, dtype=dtype, device="cuda", seed=seed,
                                             blocks=tokens // 8, block_size=16, norms=norms)  # fmt: skip
        for name, a, b in zip(("q", "k", "v", "key_cache", "value_cache"), fused, separate):
            assert torch.equal(a, b), name
