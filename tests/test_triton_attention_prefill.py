"""Prefill attention in the Triton kernel: full KV tiles run without masks, diagonal ones
with them (triton_attention.py NOTE 4), and the prefill tile and launch choices (NOTE 5).

Under the interpreter on the CPU (tiny shapes) or on a GPU (``gpu`` marker). The cases sit
on the boundaries the full/diagonal split draws: a query tile starting exactly at a KV tile
boundary or one key before it, contexts that are and are not multiples of ``TILE_N``, a
chunk of a prompt after a long context, the split-KV path cutting full and diagonal tiles
into segments, and a mixed batch with padding."""

import pytest
import torch
import triton
import triton.language as tl
from engine_compare import assert_same_tokens_and_logprobs
from paged_cases import make_case, step_rows
from test_triton_attention import DEVICE, TOLERANCES, check_against_reference

from tinyvllm import LLM, SamplingParams
from tinyvllm.attention import reference, triton_attention
from tinyvllm.attention.metadata import AttentionLayout
from tinyvllm.attention.triton_attention import (
    PREFILL_LAUNCH,
    PREFILL_QUERY_ROWS,
    choose_launch_options,
    choose_query_tile,
)


@triton.jit
def _num_full_kv_tiles_probe(first_pos_ptr, kv_len_ptr, out_ptr, TILE_N: tl.constexpr, SIZE: tl.constexpr):
    i = tl.arange(0, SIZE)
    out = triton_attention._num_full_kv_tiles(tl.load(first_pos_ptr + i), tl.load(kv_len_ptr + i), TILE_N)
    tl.store(out_ptr + i, out)


@pytest.mark.parametrize("tile_n", [16, 32])
def test_full_kv_tiles_are_exactly_the_leading_tiles_with_no_masked_key(tile_n):
    """Every (first query position, visible keys) pair of a small grid: the kernel's count of
    full tiles equals the brute-force count of leading KV tiles whose every key is at or
    before the first position and inside ``kv_len`` (so skipping their mask is exact, and no
    tile that could skip it is left masked)."""
    pairs = [(f, k) for f in range(-2, 70) for k in range(0, 75)]
    size = triton.next_power_of_2(len(pairs))
    pairs += [(0, 0)] * (size - len(pairs))
    first_pos = torch.tensor([f for f, _ in pairs], dtype=torch.int32, device=DEVICE)
    kv_len = torch.tensor([k for _, k in pairs], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(first_pos, -1)
    _num_full_kv_tiles_probe[(1,)](first_pos, kv_len, out, TILE_N=tile_n, SIZE=size)

    def brute_force(f: int, k: int) -> int:
        n = 0
        while all(key <= f and key < k for key in range(n * tile_n, (n + 1) * tile_n)):
            n += 1
        return n

    wrong = [(f, k, n) for (f, k), n in zip(pairs, out.tolist()) if n != brute_force(f, k)]
    assert not wrong, f"(first_pos, kv_len, kernel's count) wrong in {len(wrong)} cases, e.g. {wrong[:5]}"


# (query_lens, seq_lens, pad_tokens, num_segments): 4 query heads on 2 KV heads (G = 2).
BOUNDARY_CASES = {
    "query tile at a KV tile boundary": ([20], [52], 0, None),  # context 32: first position 32
    "one key before the boundary": ([20], [51], 0, None),  # context 31: keys 0-31 all full
    "two keys before the boundary": ([20], [50], 0, None),  # context 30: key 31 is masked for row 0
    "one key after the boundary": ([20], [53], 0, None),
    "prompts of a multiple of TILE_N and not": ([64, 33, 1, 1], [64, 33, 64, 65], 0, None),
    "chunked prefill, long context": ([24], [324], 0, None),
    "split-KV through full and diagonal tiles": ([24, 1], [324, 200], 0, 4),
    "mixed batch with padding": ([1, 7, 0, 40, 1], [90, 39, 5, 40, 1], 3, None),
}


@pytest.mark.parametrize("rows", [False, True], ids=["cache", "step-rows"])
@pytest.mark.parametrize("kv_tile, block_m", [(16, 16), (16, 64), (32, 64), (32, 128), (64, 128), (64, 16)])
@pytest.mark.parametrize("case", BOUNDARY_CASES, ids=lambda name: name.replace(" ", "-"))
def test_full_and_diagonal_tiles_match_reference(case, kv_tile, block_m, rows):
    """Every key from the cache, or (``rows``, triton_kernels.py NOTE 1) the context's from the
    cache and the step's from its own rows: the same boundaries cut both walks."""
    query_lens, seq_lens, pad_tokens, num_segments = BOUNDARY_CASES[case]
    check_against_reference(
        query_lens, seq_lens, 4, 2, 16, 16, kv_tile=kv_tile, block_m=block_m, pad_tokens=pad_tokens,
        num_segments=num_segments, rows=rows,
    )  # fmt: skip


def test_prefill_defaults_are_todays_tiles_and_tritons_launch_defaults():
    """NOTE 5: without a measurement that says otherwise, prefill keeps 64 rows per query
    tile and Triton's default launch (4 warps, 3 stages), as vLLM's unified kernel does."""
    assert PREFILL_QUERY_ROWS == 64 and choose_query_tile(2, decode_only=False) == (32, 64)
    assert choose_query_tile(2, decode_only=False, rows=128) == (64, 128)
    assert choose_query_tile(4, decode_only=False, rows=128) == (32, 128)
    assert choose_launch_options(decode_only=False) == PREFILL_LAUNCH == (4, 3)
    assert choose_launch_options(decode_only=True) == (4, 3)


@pytest.mark.parametrize("num_warps, num_stages", [(8, 2), (4, 4), (1, 1)])
def test_launch_overrides_keep_the_result(num_warps, num_stages):
    """On a GPU these change the compiled kernel; under the interpreter they only pass through."""
    check_against_reference([40, 1], [72, 30], 4, 2, 16, 16, num_warps=num_warps, num_stages=num_stages, block_m=128)


# ---- the step's full tiles through tensor descriptors (triton_kernels.py NOTE 4) ----


def _rows_in_a_fused_buffer(key, value, num_heads):
    """``key`` and ``value`` [N, Hkv, D] copied into column slices of one ``[N, (H + 2 Hkv) D]``
    buffer, as the engine's q/k/v projection leaves them: rows ``(H + 2 Hkv) D`` apart. The
    buffer's other columns hold NaN, so a box that strayed past its head's ``D`` columns, or
    a row of padding read unmasked, would show."""
    n, hkv, d = key.shape
    fused = torch.full((n, (num_heads + 2 * hkv) * d), float("nan"), dtype=key.dtype, device=key.device)
    views = [fused[:, (num_heads + i * hkv) * d : (num_heads + (i + 1) * hkv) * d].view(n, hkv, d) for i in (0, 1)]
    for view, rows in zip(views, (key, value)):
        view.copy_(rows)
    return views


def _layout(query, key_cache) -> AttentionLayout:
    (_, num_heads, head_size), (_, block_size, num_kv_heads, _) = query.shape, key_cache.shape
    return AttentionLayout(num_heads, num_kv_heads, head_size, block_size, query.dtype, query.device)


@pytest.mark.parametrize("kv_tile, block_m", [(16, 16), (16, 64), (32, 128)])
@pytest.mark.parametrize(
    "case", ["one key before the boundary", "prompts of a multiple of TILE_N and not", "chunked prefill, long context",
             "mixed batch with padding"], ids=lambda name: name.replace(" ", "-"),
)  # fmt: skip
def test_full_tiles_through_tensor_descriptors_give_the_pointer_loads_result(case, kv_tile, block_m):
    """``kv_desc``: the same numbers, bit for bit, as the masked pointer loads of the same
    tiles (the loads differ, the arithmetic does not), from rows strided as the engine's."""
    query_lens, seq_lens, pad_tokens, _ = BOUNDARY_CASES[case]
    q, kc, vc, qsl, sl, bt, _ = make_case(query_lens, seq_lens, 4, 2, 16, 16, seed=1, device=DEVICE, pad_tokens=pad_tokens)
    key, value = _rows_in_a_fused_buffer(*step_rows(kc, vc, qsl, sl, bt, q.shape[0]), num_heads=4)
    assert key.stride() == (8 * 16, 16, 1)
    outs = {}
    for kv_desc in (False, True):
        plan = triton_attention.plan_step(qsl, sl, bt, q.shape[0], _layout(q, kc), kv_tile=kv_tile,
                                          block_m=block_m, kv_desc=kv_desc)  # fmt: skip
        assert plan.step_kv and plan.kv_desc is kv_desc
        outs[kv_desc] = triton_attention.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, key=key, value=value, plan=plan)
    assert torch.equal(outs[True], outs[False])
    expected = reference.paged_attention(q, kc, vc, qsl, sl, bt, 0.25)
    torch.testing.assert_close(outs[True], expected, **TOLERANCES[torch.float32])


def test_kv_desc_is_refused_where_it_cannot_load_the_rows():
    """A ValueError naming the reason, before any launch: without the step's rows (the cache
    alone, or the split path), or with rows whose heads are not packed along a row."""
    q, kc, vc, qsl, sl, bt, _ = make_case([20, 1], [52, 300], 4, 2, 16, 16, device=DEVICE)
    key, value = step_rows(kc, vc, qsl, sl, bt, q.shape[0])
    layout = _layout(q, kc)
    with pytest.raises(ValueError, match="kv_desc without step_kv"):
        triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout, step_kv=False, kv_desc=True)
    with pytest.raises(ValueError, match="kv_desc without step_kv"):
        triton_attention.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, kv_desc=True)  # no rows: the cache alone
    with pytest.raises(ValueError, match="split path"):
        triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout, num_segments=4, step_kv=True, kv_desc=True)
    heads_apart = torch.zeros(q.shape[0], 2, 32, dtype=key.dtype)[:, :, :16]  # [N, Hkv, D]: head stride 2 D
    heads_apart.copy_(key)
    plan = triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout, kv_desc=True)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match=r"key strides \(64, 32, 1\).*head stride 16"):
        triton_attention.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, out=out, key=heads_apart, value=value, plan=plan)
    assert (out == 0).all()  # refused before the launch
    assert triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout).kv_desc is False  # the CPU: choose_kv_desc


def test_descriptors_are_the_default_on_sm_90_for_heads_of_whole_16_byte_units(monkeypatch):
    """``choose_kv_desc``: on by default where a descriptor load is a TMA copy (a CUDA device of
    compute capability 9.0 or later), for heads whose values fill whole 16-byte units; off on an
    sm_80 device, on the CPU, and for a head of 12 bfloat16 values (24 bytes; 12 float32 fill 48)."""
    from tinyvllm import dependent_launch
    from tinyvllm.attention.metadata import AttentionLayout

    monkeypatch.setattr(dependent_launch, "_capability", lambda index: {0: (9, 0), 1: (8, 0), 2: (10, 0)}[index])
    layout = lambda head, dtype, device: AttentionLayout(16, 8, head, 16, dtype, torch.device(device))  # noqa: E731
    chosen = {(head, dtype, device): triton_attention.choose_kv_desc(layout(head, dtype, device))
              for head in (128, 64, 12, 8) for dtype in (torch.bfloat16, torch.float32) for device in ("cuda:0", "cuda:1", "cuda:2", "cpu")}  # fmt: skip
    on = {key for key, value in chosen.items() if value}
    assert on == {(head, dtype, device) for head in (128, 64, 12, 8) for dtype in (torch.bfloat16, torch.float32)
                  for device in ("cuda:0", "cuda:2")} - {(12, torch.bfloat16, "cuda:0"), (12, torch.bfloat16, "cuda:2")}  # fmt: skip
    monkeypatch.setattr(triton_attention, "KV_DESC", False)  # the switch in the source turns it off everywhere
    assert not any(triton_attention.choose_kv_desc(layout(128, torch.bfloat16, d)) for d in ("cuda:0", "cuda:2"))


def test_the_environment_turns_descriptors_on_for_every_prefill_plan(monkeypatch):
    """``TINYVLLM_TRITON_KV_DESC=1``: every plan that reads the step's rows loads its full tiles
    through descriptors (an engine-wide A/B); a decode plan, which reads the cache only, does not."""
    q, kc, vc, qsl, sl, bt, _ = make_case([20, 1], [52, 300], 4, 2, 16, 16, device=DEVICE)
    layout = _layout(q, kc)
    monkeypatch.setenv(triton_attention.KV_DESC_ENV, "1")
    assert triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout).kv_desc is True
    assert triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout, kv_desc=False).kv_desc is False  # the argument wins
    decode = make_case([1, 1], [52, 300], 4, 2, 16, 16, device=DEVICE)
    assert triton_attention.plan_step(*decode[3:6], 2, layout).kv_desc is False
    monkeypatch.setenv(triton_attention.KV_DESC_ENV, "yes")
    with pytest.raises(ValueError, match="TINYVLLM_TRITON_KV_DESC='yes'"):
        triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout)


@pytest.mark.parametrize("mode", ["NONE", "FULL"])
@pytest.mark.slow
def test_an_engine_with_descriptors_gives_the_same_tokens_and_logprobs(tiny_model_dirs, monkeypatch, mode):
    """``TINYVLLM_TRITON_KV_DESC=1`` in a whole engine (the tiny Qwen3, Triton attention), eager
    and with FULL graphs for the mixed steps: prompts long enough for full tiles of their own
    keys (64 and 70 tokens, 32-key tiles) give the greedy tokens and logprobs of the pointer
    loads, bit for bit, and the descriptors really were made."""
    prompts = [list(range(3, 67)), [(7 * i) % 50 + 1 for i in range(70)]]
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=1, ignore_eos=True)
    made = []
    monkeypatch.setattr(triton_attention, "kv_descriptors", lambda *a, f=triton_attention.kv_descriptors: made.append(1) or f(*a))
    runs = {}
    for env in ("0", "1"):
        monkeypatch.setenv(triton_attention.KV_DESC_ENV, env)
        llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=128, attention_backend="triton",
                  compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]})  # fmt: skip
        runs[env] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert (len(made) > 0) == (env == "1")
    assert_same_tokens_and_logprobs(runs["0"], runs["1"])  # bit for bit: no tolerance


# ---- GPU ----

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "block_m, kv_tile, num_warps, num_stages, kv_desc",
    [(64, 32, 4, 3, False), (128, 64, 8, 3, False), (128, 128, 8, 2, False), (64, 64, 4, 4, False),
     (64, 64, 4, 2, True), (128, 64, 8, 3, True)],
)  # fmt: skip
def test_gpu_prefill_configs(block_m, kv_tile, num_warps, num_stages, kv_desc):
    """Corners of bench/attention.py's prefill sweep on real tensor cores, bf16, Llama-3-8B's
    heads (GQA 4, head size 128): a long prompt, a chunk after a long context, decodes; two
    with the step's full tiles as TMA copies (``kv_desc``, triton_kernels.py NOTE 4)."""
    launch = dict(block_m=block_m, kv_tile=kv_tile, num_warps=num_warps, num_stages=num_stages, kv_desc=kv_desc)
    check_against_reference(
        [1024, 300, 1, 77], [1024, 2300, 700, 77 + 128], 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda", rows=True, **launch
    )  # fmt: skip


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL"])
def test_gpu_the_default_descriptors_give_an_engine_the_pointer_loads_tokens(tiny_model_dirs, monkeypatch, mode):
    """``choose_kv_desc`` on a real GPU: the tiny Qwen3 in bf16 under real CUDA graphs, chunked
    prefill on (a 200-token budget cuts the 300-token prompt), with the default loads and with
    ``TINYVLLM_TRITON_KV_DESC=0``: the same greedy tokens and logprobs, and on sm_90 or later the
    default really made descriptors (elsewhere none)."""
    from tinyvllm.dependent_launch import sm_90_or_later

    prompts = [list(range(3, 67)), [(7 * i) % 50 + 1 for i in range(300)]]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    made = []
    monkeypatch.setattr(triton_attention, "kv_descriptors", lambda *a, f=triton_attention.kv_descriptors: made.append(1) or f(*a))
    runs = {}
    for env in (None, "0"):
        if env is None:
            monkeypatch.delenv(triton_attention.KV_DESC_ENV, raising=False)
        else:
            monkeypatch.setenv(triton_attention.KV_DESC_ENV, env)
        made.clear()
        llm = LLM(str(tiny_model_dirs["qwen3"]), device="cuda", dtype="bfloat16", max_model_len=512, attention_backend="triton",
                  max_num_batched_tokens=200, compilation_config={"cudagraph_mode": mode})  # fmt: skip
        runs[env] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert (len(made) > 0) == (env is None and sm_90_or_later(torch.device("cuda")))
        del llm
    assert_same_tokens_and_logprobs(runs[None], runs["0"], abs_tol=2e-2)
