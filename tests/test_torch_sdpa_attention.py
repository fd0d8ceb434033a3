"""The batched torch (SDPA) backend against the torch reference, on fixed cases.

Each case comes from ``paged_cases.make_case``: a shuffled block pool whose unused slots
hold NaN, so a read outside a request's own keys shows up as NaN in the result. The
output is poisoned with NaN before each run, so an unwritten row fails too.

Tolerances. Both backends compute in float32 from the same inputs and differ only by
summation order: float32 results agree to 1e-5. A float16 or bfloat16 result is that
float32 value rounded to the dtype, so the two agree within one rounding step of the
dtype (``rtol = eps``), plus 1e-6 absolute for values near zero, where the float32
difference is larger than the dtype's spacing there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_cases import make_case, make_shared_prefix_case

from tinyvllm.attention import reference, torch_sdpa
from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.attention.kv_cache_write import write_kv_cache_torch

ROOT = Path(__file__).resolve().parents[1]


def tolerances(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=1e-6, rtol=torch.finfo(dtype).eps)


def check_against_reference(
    query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
    dtype=torch.float32, pad_tokens=0, seed=0,
):  # fmt: skip
    """Run both backends on one case and compare; padding rows must come back zero."""
    q, kc, vc, qsl, sl, bt, _ = make_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
        seed=seed, dtype=dtype, pad_tokens=pad_tokens,
    )  # fmt: skip
    scale = head_size**-0.5
    expected = reference.paged_attention(q, kc, vc, qsl, sl, bt, scale)
    out = torch.full_like(q, float("nan"))
    result = torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, scale, out=out)
    assert result is out and out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any(), f"unwritten or NaN rows: {out.isnan().any(-1).any(-1).nonzero().flatten().tolist()}"
    torch.testing.assert_close(out, expected, **tolerances(dtype))
    assert (out[sum(query_lens) :] == 0).all()


@pytest.mark.seed("000:cgsupport")
def test_torch_sdpa_declares_cudagraph_support_never():
    assert torch_sdpa.CUDAGRAPH_SUPPORT is AttentionCGSupport.NEVER


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1], [1]),  # the first token of a sequence: one key
        ([1, 1, 1, 1], [1, 17, 40, 9]),  # decode only, ragged lengths
        ([5], [5]),  # prefill only, one request
        ([17, 2, 9], [17, 2, 9]),  # prefill only, several requests
        ([3], [40]),  # a later chunk of a chunked prefill: causal mask offset by 37
        ([4, 2], [20, 7]),  # two chunks
        ([1, 3, 1, 24], [33, 40, 1, 24]),  # decode + chunk + decode + prefill
        ([5, 0, 2], [9, 3, 2]),  # a request with no query tokens this step
        ([1, 0, 1], [5, 3, 9]),  # decodes around it: the decode rows are picked by index
        ([3, 5, 2, 4], [30, 33, 29, 31]),  # short chunks of similar lengths: one group, rows padded to 5
        ([16, 2, 16], [40, 41, 16]),  # SHORT_QUERY_MAX tokens: still grouped; a whole prompt beside chunks
        ([2, 1, 9, 1, 0, 3], [2, 7, 9, 8, 4, 12]),  # short whole prompts, decodes, an idle request, a chunk
    ],
)
def test_torch_sdpa_matches_reference(query_lens, seq_lens):
    check_against_reference(query_lens, seq_lens, 4, 2, 64, 4)


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_torch_sdpa_gqa_ratios_and_block_sizes(group, block_size):
    check_against_reference([1, 1, 6, 1], [23, 1, 6, 40], 2 * group, 2, 64, block_size)  # decodes + a prefill
    check_against_reference([1, 1, 1], [23, 1, 40], 2 * group, 2, 64, block_size)  # pure decode


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_torch_sdpa_dtypes_and_head_sizes(dtype, head_size):
    check_against_reference([2, 1, 6, 1], [20, 17, 6, 1], 8, 2, head_size, 16, dtype=dtype)
    check_against_reference([1, 1], [20, 33], 8, 2, head_size, 16, dtype=dtype)


@pytest.mark.seed("003:memory")
def test_torch_sdpa_zeroes_padding_rows():
    check_against_reference([2, 1], [18, 5], 4, 2, 64, 16, pad_tokens=5)  # mixed
    check_against_reference([1, 1, 1], [18, 5, 2], 4, 2, 64, 16, pad_tokens=3)  # pure decode


@pytest.mark.seed("003:memory")
def test_torch_sdpa_allocates_out_when_not_given():
    q, kc, vc, qsl, sl, bt, _ = make_case([1, 3], [9, 3], 4, 1, 64, 4, pad_tokens=2)
    out = torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype and (out[4:] == 0).all()
    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, qsl, sl, bt, 0.125), atol=1e-5, rtol=1e-5)


def test_torch_sdpa_rejects_head_counts_that_do_not_divide():
    q, kc, vc, qsl, sl, bt, _ = make_case([1], [1], 3, 2, 8, 4)
    with pytest.raises(ValueError, match="query heads 3 are not a multiple of KV heads 2"):
        torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 1.0)


@pytest.mark.seed("003:memory")
def test_torch_sdpa_one_sdpa_call_per_length_group_one_per_prefill(monkeypatch):
    """Decodes of equal length are one SDPA call whatever R is; lengths spread wider than
    5/4 split into groups, longest first (NOTE 5); short chunks group the same way (NOTE 8);
    each longer prefill adds one call."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(torch_sdpa.F, "scaled_dot_product_attention", counting)
    q, kc, vc, qsl, sl, bt, _ = make_case([1] * 32, [30] * 32, 8, 2, 64, 4)
    torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    assert calls == [(32, 8, 1, 64)]
    calls.clear()
    # Lengths 40 .. 71: 71 .. 57 (57 * 1.25 >= 71), then 56 .. 45, then 44 .. 40.
    q, kc, vc, qsl, sl, bt, _ = make_case([1] * 32, list(range(40, 72)), 8, 2, 64, 4)
    out = torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    assert calls == [(15, 8, 1, 64), (12, 8, 1, 64), (5, 8, 1, 64)]
    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, qsl, sl, bt, 0.125), atol=1e-5, rtol=1e-5)
    calls.clear()
    q, kc, vc, qsl, sl, bt, _ = make_case([1, 5, 1, 3, 1], [10, 5, 4, 30, 2], 8, 2, 64, 4)
    torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    # decodes 10, 4, 2 apart; chunks of 3 (length 30) and 5 (length 5) apart, longest first
    assert calls == [(1, 8, 1, 64)] * 3 + [(1, 8, 3, 64), (1, 8, 5, 64)]
    calls.clear()
    # Short chunks of similar lengths share a call, padded to the most query tokens (NOTE 8);
    # a prefill past SHORT_QUERY_MAX tokens keeps its own.
    q, kc, vc, qsl, sl, bt, _ = make_case([3, 2, 4, 17], [40, 36, 38, 17], 8, 2, 64, 4)
    out = torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    assert calls == [(3, 8, 4, 64), (1, 8, 17, 64)]
    torch.testing.assert_close(out, reference.paged_attention(q, kc, vc, qsl, sl, bt, 0.125), atol=1e-5, rtol=1e-5)


def test_torch_sdpa_group_by_length_examples():
    assert torch_sdpa.group_by_length([10, 8, 5, 4, 12], [0, 1, 2, 3, 4]) == [[4, 0], [1], [2, 3]]
    assert torch_sdpa.group_by_length([7, 7, 7], [2, 0]) == [[2, 0]]  # only the requests named
    assert torch_sdpa.group_by_length([3], []) == []


def test_torch_sdpa_plan_is_step_wide_and_matches_planning_per_call():
    """A plan made once gives every layer the result of planning inside the call."""
    q, kc, vc, qsl, sl, bt, _ = make_case([1, 4, 1, 1, 0, 2], [9, 4, 33, 2, 3, 12], 8, 4, 16, 4, pad_tokens=3)
    plan = torch_sdpa.plan_step(qsl, sl, bt, 4)
    assert plan.num_rows == 9 and plan.prefills == ()  # 4 and 2 query tokens: short, grouped (NOTE 8)
    assert [(g.width, g.queries) for g in plan.chunk_groups] == [(12, 2), (4, 4)]  # lengths 12 and 4: apart
    assert [g.width for g in plan.decode_groups] == [36, 12, 4]  # 33, 9, 2 rounded up to blocks of 4
    for _ in range(2):  # reused, as by the layers of one step
        with_plan = torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, plan=plan)
        assert torch.equal(with_plan, torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.25))


@pytest.mark.seed("003:memory")
def test_torch_sdpa_without_enable_gqa_expands_kv_heads(monkeypatch):
    """The path for torch before 2.5 (no ``enable_gqa``) gives the same result."""
    monkeypatch.setattr(torch_sdpa, "SDPA_HAS_ENABLE_GQA", False)
    check_against_reference([1, 3, 1], [33, 40, 2], 8, 2, 64, 4)
    check_against_reference([1, 1], [33, 2], 8, 1, 64, 16)


def test_expand_kv_heads_matches_repeat_interleave():
    kv = torch.randn(3, 2, 5, 4)  # [R, Hkv, L, D]
    for group in (1, 2, 4):
        assert torch.equal(torch_sdpa.expand_kv_heads(kv, group), kv.repeat_interleave(group, dim=1))
    assert torch_sdpa.expand_kv_heads(kv, 1) is kv


@pytest.mark.seed("003:memory")
def test_causal_mask_is_aligned_to_the_last_key():
    mask = torch_sdpa.causal_mask(2, 5, torch.device("cpu"))  # tokens at positions 3 and 4
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert torch.equal(torch_sdpa.causal_mask(3, 3, torch.device("cpu")), torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.seed("003:memory")
def test_decode_blocks_stay_inside_each_requests_own_blocks():
    block_table = torch.tensor([[5, 2, 9], [7, 0, 0]], dtype=torch.int32)  # request 1 owns block 7 only
    seq_lens = torch.tensor([10, 3], dtype=torch.int32)
    blocks = torch_sdpa.decode_blocks(block_table, seq_lens, 4, 3)
    assert blocks.tolist() == [[5, 2, 9], [7, 7, 7]]  # past its own blocks: its last block
    # Width 12 (3 blocks of 4): positions 10, 11 of request 0 and 3 .. 11 of request 1 are stale.
    stale = torch_sdpa.stale_positions(torch_sdpa.key_padding_mask(seq_lens, 12))
    assert stale.tolist() == [10, 11] + list(range(12 + 3, 24))
    assert torch_sdpa.stale_positions(torch_sdpa.key_padding_mask(torch.tensor([8, 8]), 8)) is None
    mask = torch_sdpa.key_padding_mask(seq_lens, 12)
    assert mask.sum(1).tolist() == [10, 3] and mask[1, :3].all()


@pytest.mark.seed("003:memory")
def test_torch_sdpa_decode_ignores_nan_in_the_stale_tail_of_its_own_last_block():
    """The whole-block gather reads the unwritten tail of a request's last block (NOTE 2):
    NaN there must not reach the result, in a group of equal and of unequal lengths."""
    for lens in ([6, 6], [6, 3]):
        q, kc, vc, qsl, sl, bt, _ = make_case([1, 1], lens, 4, 2, 8, 4)
        expected = reference.paged_attention(q, kc, vc, qsl, sl, bt, 0.5)
        for r, n in enumerate(lens):  # poison every slot of the last block past the length
            last = int(bt[r, (n - 1) // 4])
            kc[last, n % 4 or 4 :] = float("nan")
            vc[last, n % 4 or 4 :] = float("nan")
        out = torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.5)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.seed("003:memory")
def test_torch_backend_is_registered_with_the_torch_kv_writer():
    from tinyvllm.models import llama

    backend = llama.ATTENTION_BACKENDS["torch"]
    assert backend.paged_attention is torch_sdpa.paged_attention
    assert backend.write_kv_cache is write_kv_cache_torch
    assert backend.cudagraph_support is AttentionCGSupport.NEVER


def test_attention_cpu_bench_dry_run_writes_json(tmp_path):
    """bench/attention_cpu.py: its --dry-run runs every case on tiny shapes and records ratios."""
    out = tmp_path / "attention_cpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "attention_cpu.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["torch"] == torch.__version__
    cases = record["results"]
    assert [c["threads"] for c in cases] == sorted(c["threads"] for c in cases)
    assert {c["threads"] for c in cases} == {1, 2}
    for case in cases:
        assert case["max_abs_diff"] < 1e-4, case  # the two backends agree on the benchmark's own inputs
        assert case["ratio_reference_over_torch"] > 0
    assert [g["threads"] for g in record["grouping"]] == [1, 2]
    for g in record["grouping"]:  # the three ways give the same result
        assert g["max_abs_diff"] < 1e-5 and set(g["ratio_one_group_over"]) == {"one_group", "groups", "groups_one_plan"}
    assert [(c["threads"], c["num_reqs"], c["shared"]) for c in record["cascade"]] == [(1, 3, 8), (2, 3, 8)]
    for c in record["cascade"]:  # split off or not, the same attention
        assert c["max_abs_diff"] < 1e-5 and c["ratio_one_group_over_cascade"] > 0
    assert [(c["threads"], c["num_reqs"], c["query_tokens"]) for c in record["chunks"]] == [(1, 3, 2), (2, 3, 2)]
    for c in record["chunks"]:  # grouped or alone, the same attention
        assert c["max_abs_diff"] < 1e-5 and c["ratio_alone_over_grouped"] > 0
    assert f"wrote {out}" in result.stdout


def test_gather_rows_reuses_one_buffer_per_name():
    rows = torch.randn(40, 2, 8)  # [B * S, Hkv, D]
    first = torch_sdpa.gather_rows(rows, torch.tensor([3, 1, 4, 1, 5]), "key")
    assert torch.equal(first, rows[torch.tensor([3, 1, 4, 1, 5])])
    second = torch_sdpa.gather_rows(rows, torch.tensor([9, 2, 6]), "key")  # smaller: same storage
    assert torch.equal(second, rows[torch.tensor([9, 2, 6])])
    assert second.data_ptr() == first.data_ptr()
    other = torch_sdpa.gather_rows(rows, torch.tensor([0]), "value")  # another name: another buffer
    assert other.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    grown = torch_sdpa.gather_rows(rows, torch.arange(40).flip(0).repeat(3), "key")  # larger: grown
    assert torch.equal(grown, rows.flip(0).repeat(3, 1, 1))


@pytest.mark.seed("000:cgsupport")
def test_torch_backend_under_full_graphs_runs_piecewise_with_eager_tokens(tiny_model_dirs):
    """NEVER: a FULL-containing mode is downgraded to PIECEWISE (attention runs eagerly
    between the emulated graphs), and the tokens equal eager execution's."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode

    prompts = [{"prompt_token_ids": [(13 * i + 5) % 400 + 3 for i in range(n)]} for n in (3, 20, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        graphs = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
        llm = LLM(
            str(tiny_model_dirs["qwen3"]), device="cpu", attention_backend="torch", max_model_len=64, block_size=4,
            max_num_batched_tokens=16, compilation_config=graphs,
        )  # fmt: skip
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.model_runner
    assert runner.cudagraph_mode == CUDAGraphMode.PIECEWISE
    stats = runner.cudagraph_stats
    assert stats.get(CUDAGraphMode.PIECEWISE, 0) > 0 and CUDAGraphMode.FULL not in stats
    assert tokens["FULL_AND_PIECEWISE"] == tokens["NONE"]


def test_gather_rows_in_and_out_of_inference_mode():
    """The engine runs under ``torch.inference_mode``; a buffer made there cannot be written
    outside it, so each mode has its own."""
    rows = torch.randn(12, 1, 4)
    slots = torch.tensor([5, 0, 7])
    with torch.inference_mode():
        inside = torch_sdpa.gather_rows(rows, slots, "key")
    outside = torch_sdpa.gather_rows(rows, slots, "key")
    assert torch.equal(inside, rows[slots]) and torch.equal(outside, rows[slots])
    assert outside.untyped_storage().data_ptr() != inside.untyped_storage().data_ptr()


def test_shared_prefix_blocks_counts_leading_equal_columns():
    rows = torch.tensor([[4, 9, 1, 7], [4, 9, 2, 7], [4, 9, 1, 7]])
    assert torch_sdpa.shared_prefix_blocks(rows) == 2  # column 3 is equal again, but after a difference
    assert torch_sdpa.shared_prefix_blocks(rows[:, :1]) == 1
    assert torch_sdpa.shared_prefix_blocks(rows[:, :0]) == 0
    assert torch_sdpa.shared_prefix_blocks(torch.tensor([[3, 5], [6, 5]])) == 0


def test_merge_attention_of_two_key_sets_is_attention_over_both():
    """Split the keys in two, attend to each with its LSE, merge: the same as one softmax."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen) for n in (5, 12, 12))
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3)
    out_a, lse_a = torch_sdpa.attention_with_lse(q, k[:, :, :7], v[:, :, :7], 0.3)
    out_b, lse_b = torch_sdpa.attention_with_lse(q, k[:, :, 7:], v[:, :, 7:], 0.3)
    expected_lse = torch.logsumexp(q @ k[:, :, :7].transpose(-1, -2) * 0.3, -1)
    torch.testing.assert_close(lse_a, expected_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch_sdpa.merge_attention(out_a, lse_a, out_b, lse_b), full, atol=1e-5, rtol=1e-5)
    huge = torch_sdpa.merge_attention(out_a, lse_a + 500.0, out_b, lse_b)  # exp(500) overflows float32
    torch.testing.assert_close(huge, out_a)


@pytest.mark.seed("003:memory")
def test_torch_sdpa_plan_splits_off_a_prefix_every_decode_of_a_group_shares():
    """Blocks 0-1 are shared by all three decodes of one length group. A shared block must
    also lie before every member's last position (NOTE 7)."""
    q, kc, vc, qsl, sl, bt, ids = make_shared_prefix_case([11, 12, 13], 2, 4, 2, 8, 4)
    plan = torch_sdpa.plan_step(qsl, sl, bt, 4, cascade_min_saved_keys=0)
    [group] = plan.decode_groups
    assert group.prefix_blocks.tolist() == ids[0][:2]
    assert group.width == 8  # the longest request's 13 - 8 = 5 keys after the prefix, in whole blocks
    assert group.mask[:, 0, 0].sum(1).tolist() == [5, 4, 3]  # keys after the prefix, longest first
    # Default bound: (3 - 1) * 8 saved keys is far below CASCADE_MIN_SAVED_KEYS.
    assert torch_sdpa.plan_step(qsl, sl, bt, 4).decode_groups[0].prefix_blocks is None
    # A prefix reaching a member's last position is not split off: lengths 8 and 9 share
    # blocks 0-1, but position 7 (length 8) is the token being decoded, in block 1.
    q, kc, vc, qsl, sl, bt, ids = make_shared_prefix_case([8, 9], 2, 4, 2, 8, 4)
    [group] = torch_sdpa.plan_step(qsl, sl, bt, 4, cascade_min_saved_keys=0).decode_groups
    assert group.prefix_blocks.tolist() == ids[0][:1]
    alone = torch_sdpa.plan_step(qsl[:2], sl[:1], bt[:1], 4, cascade_min_saved_keys=0)
    assert alone.decode_groups[0].prefix_blocks is None  # one request: nothing to share


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize("group_size", [1, 2, 4])
@pytest.mark.parametrize("lens,shared", [([11, 12, 13], 2), ([9, 9, 9, 9], 2), ([33, 40, 36], 8)])
def test_torch_sdpa_cascade_decode_matches_reference(group_size, lens, shared):
    """Decodes that share a prefix, attended in two parts and merged, equal the reference;
    NaN in every unwritten slot (the tails of the requests' own last blocks) stays out."""
    q, kc, vc, qsl, sl, bt, _ = make_shared_prefix_case(lens, shared, 2 * group_size, 2, 16, 4, seed=group_size)
    plan = torch_sdpa.plan_step(qsl, sl, bt, 4, cascade_min_saved_keys=0)
    assert plan.decode_groups[0].prefix_blocks is not None
    expected = reference.paged_attention(q, kc, vc, qsl, sl, bt, 0.25)
    out = torch_sdpa.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, plan=plan)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
