"""Programmatic dependent launch (``dependent_launch.py``): when it is on, and what each kernel does with it.

On the CPU the kernels run under the interpreter, which cannot run ``griddepcontrol``: the
tests stand a recorder in for ``gdc_wait`` and ``gdc_launch_dependents`` and turn the launch
on as a sm_90 GPU would. Every launcher then passes ``USE_PDL``, every program of every kernel
waits and then lets the next kernel start, and the results are the same bits as with it off.
That the wait comes before any load or store in the compiled kernel is the ahead-of-time
compile's check (``test_triton_aot.py``); the ``gpu`` twins run the launches for real.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_case, step_rows

from tinyvllm import dependent_launch
from tinyvllm.attention import triton_attention
from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID, write_kv_cache_triton
from tinyvllm.config import CUDAGraphMode
from tinyvllm.dependent_launch import PDL_ENV, launch_options, pdl_from_env, pdl_supported
from tinyvllm.models.activation import silu_and_mul_triton
from tinyvllm.sample.ops.greedy import greedy_triton
from tinyvllm.models.qk_norm_rotary import qk_norm_rotary_triton, qk_norm_rotary_write_kv_triton
from tinyvllm.models.rms_norm import add_rms_norm_triton, rms_norm_triton
from tinyvllm.models.rotary import rotary_triton, rotary_write_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_it_is_off_unless_asked_and_on_sm_90_or_later(monkeypatch):
    monkeypatch.delenv(PDL_ENV, raising=False)
    monkeypatch.setattr(dependent_launch, "_capability", lambda index: {0: (9, 0), 1: (8, 0), 2: (10, 0)}[index])
    gpu = torch.device("cuda:0")
    assert pdl_from_env() is False and launch_options(gpu) == {"USE_PDL": False}
    monkeypatch.setenv(PDL_ENV, "1")
    assert launch_options(gpu) == {"USE_PDL": True, "launch_pdl": True}
    assert launch_options(torch.device("cuda:2")) == {"USE_PDL": True, "launch_pdl": True}
    assert launch_options(torch.device("cuda:1")) == {"USE_PDL": False}  # sm_80 has no griddepcontrol
    assert launch_options(torch.device("cpu")) == {"USE_PDL": False}  # the interpreter launches nothing
    assert [pdl_supported(torch.device(d)) for d in ("cuda:0", "cuda:1", "cpu")] == [True, False, False]
    monkeypatch.setenv(PDL_ENV, "0")
    assert launch_options(gpu) == {"USE_PDL": False}


@pytest.mark.parametrize("value", ["yes", "true", "", "2"])
def test_a_bad_value_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv(PDL_ENV, value)
    with pytest.raises(ValueError, match=f"TINYVLLM_PDL={value!r}: must be '0' or '1'"):
        launch_options(torch.device("cpu"))


def test_a_bad_value_is_refused_as_the_model_is_built(monkeypatch, tiny_model_dirs):
    """Every attention layer reads it as it is built, before any weight is read: a bad value
    fails there, not in the first step's first launch."""
    from tinyvllm.models.llama import Attention
    from tinyvllm.models.loader import load_model_spec

    spec = load_model_spec(tiny_model_dirs["qwen3"])
    monkeypatch.setenv(PDL_ENV, "1")
    Attention(spec, backend=None)
    monkeypatch.setenv(PDL_ENV, "on")
    with pytest.raises(ValueError, match="TINYVLLM_PDL='on': must be '0' or '1'"):
        Attention(spec, backend=None)


@pytest.fixture
def recorded(monkeypatch):
    """Turns the launch on as on a sm_90 GPU and records each program's calls in the interpreter."""
    calls: list[str] = []
    monkeypatch.setenv(PDL_ENV, "1")
    monkeypatch.setattr(dependent_launch, "pdl_supported", lambda device: True)
    monkeypatch.setattr(dependent_launch, "gdc_wait", lambda: calls.append("wait"))
    monkeypatch.setattr(dependent_launch, "gdc_launch_dependents", lambda: calls.append("trigger"))
    return calls


def _rotary_inputs(g, device, n=4, heads=4, kv_heads=2, d=16):
    """q, k, v, cos, sin of ``n`` tokens; both caches (3 blocks of 4 slots); slots with a padding row."""
    q = torch.randn(n, heads, d, generator=g, device=device)
    k, v = (torch.randn(n, kv_heads, d, generator=g, device=device) for _ in range(2))
    angles = torch.rand(n, d // 2, generator=g, device=device) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    caches = torch.zeros(2, 3, 4, kv_heads, d, device=device)
    return q, k, v, cos, sin, caches, torch.tensor([5, PAD_SLOT_ID, 0, 11], device=device)


def _launches(device=DEVICE):
    """(name, programs, run) per launcher: ``run(g)`` returns every tensor the launch wrote."""
    def randn(g, *shape):
        return torch.randn(*shape, generator=g, device=device)

    def rms(g):
        x, w = randn(g, 5, 32), randn(g, 32)
        return [rms_norm_triton(x, w, 1e-6), rms_norm_triton(x.view(5, 2, 16), w[:16].contiguous(), 1e-6)]

    def add_rms(g):
        return list(add_rms_norm_triton(randn(g, 5, 32), randn(g, 5, 32), randn(g, 32), 1e-6))

    def rot(g):
        q, k, _, cos, sin, _, _ = _rotary_inputs(g, device)
        return list(rotary_triton(q, k, cos, sin))

    def rot_kv(g):
        q, k, v, cos, sin, caches, slots = _rotary_inputs(g, device)
        return [*rotary_write_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots), caches]

    def qk(g):
        q, k, _, cos, sin, _, _ = _rotary_inputs(g, device)
        return list(qk_norm_rotary_triton(q, k, randn(g, 16), randn(g, 16), 1e-6, cos, sin))

    def qk_kv(g):
        q, k, v, cos, sin, caches, slots = _rotary_inputs(g, device)
        written = qk_norm_rotary_write_kv_triton(q, k, v, randn(g, 16), randn(g, 16), 1e-6, cos, sin, caches[0], caches[1], slots)
        return [*written, caches]

    def silu(g):
        return [silu_and_mul_triton(randn(g, 3, 80), 40)]

    def greedy_draw(g):
        return list(greedy_triton(randn(g, 3, 70)))

    def kv_write(g):
        _, k, v, _, _, caches, slots = _rotary_inputs(g, device)
        write_kv_cache_triton(k, v, caches[0], caches[1], slots)
        return [caches]

    def attention(g, num_segments):
        seed = int(torch.randint(0, 1000, (1,), generator=g, device=device))
        q, kc, vc, qsl, sl, bt, _ = make_case([1, 3], [20, 5], 4, 2, 16, 16, seed=seed, dtype=torch.float32, device=device)
        k, v = step_rows(kc, vc, qsl, sl, bt, q.shape[0]) if num_segments == 1 else (None, None)
        return [triton_attention.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, key=k, value=v, num_segments=num_segments)]

    # the attention grid: (cdiv(N, BLOCK_Q) + R, Hkv, segments), N = 4 rows of R = 2 requests; the merge's (N, H)
    tiles = -(-4 // triton_attention.choose_query_tile(2, decode_only=False)[0]) + 2
    return [("rms_norm", 5 + 10, rms), ("add_rms_norm", 5, add_rms), ("rotary", 4, rot), ("rotary_write_kv", 4, rot_kv),
            ("qk_norm_rotary", 4, qk), ("qk_norm_rotary_write_kv", 4, qk_kv), ("silu_and_mul", 3, silu),
            ("greedy", 3, greedy_draw), ("kv_write", 4, kv_write), ("attention", tiles * 2, lambda g: attention(g, 1)),
            ("attention_split", tiles * 2 * 4 + 4 * 4, lambda g: attention(g, 4))]  # fmt: skip


@pytest.mark.parametrize("name, programs, run", _launches(), ids=[name for name, *_ in _launches()])
def test_every_program_waits_then_triggers_and_the_bits_are_the_same(recorded, monkeypatch, name, programs, run):
    """Each program of each kernel calls the wait, then the trigger, once (NOTE 1, NOTE 2); with
    the launch on, every tensor the launcher writes has the bits it has with it off."""
    on = run(torch.Generator().manual_seed(0))
    assert recorded == ["wait", "trigger"] * programs
    monkeypatch.setenv(PDL_ENV, "0")
    recorded.clear()
    off = run(torch.Generator().manual_seed(0))
    assert recorded == []
    assert len(on) == len(off) and all(torch.equal(a, b) for a, b in zip(on, off)), name


def test_an_attention_plan_carries_the_choice_to_both_kernels(recorded, monkeypatch):
    """``plan_step`` decides once a step: the constexpr and Triton's option for the attention
    kernel, the same keywords for the merge (``LaunchPlan.pdl``)."""
    q, kc, vc, qsl, sl, bt, _ = make_case([1], [40], 4, 2, 16, 16, seed=0, dtype=torch.float32, device="cpu")
    layout = triton_attention._check_layer_tensors(q, kc, vc, None)
    plan = triton_attention.plan_step(qsl, sl, bt, 1, layout, num_segments=4)
    assert plan.constexprs["USE_PDL"] is True and plan.options["launch_pdl"] is True
    assert list(plan.constexprs)[-1] == "USE_PDL"  # the kernel's last parameter (the pre-bound launch passes them in order)
    assert plan.pdl == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv(PDL_ENV, "0")
    plan = triton_attention.plan_step(qsl, sl, bt, 1, layout, num_segments=4)
    assert plan.constexprs["USE_PDL"] is False and "launch_pdl" not in plan.options and plan.pdl == {"USE_PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_each_kernel_gives_the_same_bits_launched_dependent(monkeypatch):
    """On sm_90 or later, every launcher with the launch on (real ``griddepcontrol``, one
    stream, back to back) gives the bits it gives with it off; before sm_90 it stays off."""
    monkeypatch.setenv(PDL_ENV, "1")
    if not pdl_supported(torch.device("cuda")):
        assert launch_options(torch.device("cuda")) == {"USE_PDL": False}
        return
    assert launch_options(torch.device("cuda")) == {"USE_PDL": True, "launch_pdl": True}
    for name, _, run in _launches("cuda"):
        monkeypatch.setenv(PDL_ENV, "1")
        on = run(torch.Generator("cuda").manual_seed(0))
        monkeypatch.setenv(PDL_ENV, "0")
        off = run(torch.Generator("cuda").manual_seed(0))
        assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_engine_gives_the_same_tokens_and_logprobs_launched_dependent(tiny_model_dirs, monkeypatch):
    """The tiny Qwen3 in bf16 under real FULL_AND_PIECEWISE graphs (decode steps replay FULL
    graphs of dependent launches, prefill chunks PIECEWISE ones), with async scheduling (as
    the A/B runs it), chunked prefill and a prefix hit: the same greedy tokens and logprobs
    with the launch on and off. (A synchronous engine replays the same graphs.)"""
    import gc

    from engine_compare import assert_same_tokens_and_logprobs

    from tinyvllm import LLM, SamplingParams

    shared = [(7 * i + 3) % 400 + 5 for i in range(40)]
    prompts = [shared + [30, 31], shared + [40], [5, 6, 7], [(11 * i) % 300 + 2 for i in range(70)]]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    runs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(PDL_ENV, value)
        llm = LLM(str(tiny_model_dirs["qwen3"]), dtype="bfloat16", device="cuda", max_model_len=256, block_size=16,
                  attention_backend="triton", enable_prefix_caching=True, max_num_batched_tokens=32,
                  gpu_memory_utilization=0.3, async_scheduling=True,
                  compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})  # fmt: skip
        runs[value] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.model_runner.cudagraph_stats[CUDAGraphMode.FULL] > 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert_same_tokens_and_logprobs(runs["0"], runs["1"])
