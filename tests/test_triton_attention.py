"""The Triton kernel against the torch reference: tiny drawn cases under the interpreter on
the CPU, wide ones on a GPU (``gpu`` marker). Outputs are poisoned with NaN before each run
and unused cache slots hold NaN, so an unwritten row or a read past a request fails."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_cases import make_case, step_rows

from tinyvllm.attention import reference, triton_attention, triton_kernels
from tinyvllm.attention.metadata import AttentionLayout
from tinyvllm.attention.triton_attention import (
    CUDAGRAPH_SUPPORT,
    SPLIT_KV_SEGMENTS,
    choose_kv_tile,
    choose_num_segments,
    choose_query_tile,
)

# Tolerances per dtype. The reference works in float32 from the same inputs; the kernel
# differs by summation order and, on a GPU, by rounding softmax weights to fp16/bf16
# before the P @ V product (about one ulp of the output's dtype).
# CUDA when present; the CPU under TRITON_INTERPRET=1 otherwise (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def check_against_reference(
    query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
    dtype=torch.float32, num_segments=None, pad_tokens=0, device=DEVICE, seed=0, kv_tile=None, rows=False, **launch,
):  # fmt: skip
    """Run both backends on one case and compare; padding rows must come back zero.
    ``launch``: the launcher's tile and launch overrides (``block_m``, ``num_warps``, ``num_stages``).
    ``rows``: pass the step's own key and value rows as the engine does (triton_kernels.py NOTE 1)."""
    q, kc, vc, qsl, sl, bt, _ = make_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size,
        seed=seed, dtype=dtype, device=device, pad_tokens=pad_tokens,
    )  # fmt: skip
    scale = head_size**-0.5
    expected = reference.paged_attention(q, kc, vc, qsl, sl, bt, scale)
    out = torch.full_like(q, float("nan"))
    k, v = step_rows(kc, vc, qsl, sl, bt, q.shape[0]) if rows else (None, None)
    result = triton_attention.paged_attention(
        q, kc, vc, qsl, sl, bt, scale, out=out, key=k, value=v, num_segments=num_segments, kv_tile=kv_tile, **launch
    )
    assert result is out and out.dtype == dtype
    assert not out.isnan().any(), f"unwritten or NaN rows: {out.isnan().any(-1).any(-1).nonzero().flatten().tolist()}"
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
    if pad_tokens:
        assert (out[sum(query_lens) :] == 0).all()


@pytest.mark.seed("000:cgsupport")
def test_declares_cudagraph_support_always_and_the_reference_never():
    from tinyvllm.attention.cudagraph_support import AttentionCGSupport

    assert CUDAGRAPH_SUPPORT is AttentionCGSupport.ALWAYS
    assert reference.CUDAGRAPH_SUPPORT is AttentionCGSupport.NEVER


@pytest.mark.seed("003:memory")
@pytest.mark.parametrize(
    "query_lens, seq_lens, num_heads, num_kv_heads, block_size",
    [
        ([1], [1], 2, 2, 16),  # the first token of a sequence: one key
        ([1], [17], 4, 2, 16),  # decode, context 17 = one full block + 1
        ([17], [17], 2, 1, 16),  # prefill of 17 tokens over two blocks, GQA 2
        ([3, 1, 24], [40, 33, 24], 8, 2, 32),  # chunked prefill + decode + prefill, GQA 4
        ([1, 2, 1], [1, 50, 17], 8, 1, 16),  # MQA (GQA 8), mixed
        ([1], [255], 2, 2, 16),  # a long decode context: 16 blocks
        ([5, 0, 2], [9, 3, 2], 2, 1, 16),  # a request with no query tokens this step
    ],
)
def test_matches_reference(query_lens, seq_lens, num_heads, num_kv_heads, block_size):
    check_against_reference(query_lens, seq_lens, num_heads, num_kv_heads, 64, block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype):
    check_against_reference([2, 1, 6], [20, 17, 6], 4, 2, 64, 16, dtype=dtype)


def test_head_dim_128_and_non_power_of_two_group():
    check_against_reference([3, 1], [19, 33], 6, 2, 128, 16)  # G = 3: rows padded to BLOCK_M


def test_padding_rows_are_zero():
    check_against_reference([2, 1], [18, 5], 4, 2, 64, 16, pad_tokens=5)


@pytest.mark.parametrize("num_segments", [2, SPLIT_KV_SEGMENTS])
def test_split_kv_matches_reference(num_segments):
    # decode with long-ish and short contexts: some segments are empty for the short one
    check_against_reference([1, 1, 1], [100, 17, 1], 4, 1, 64, 16, num_segments=num_segments)


# A KV tile is TILE_N key positions whatever the block size (NOTE 3): narrower than a block
# (tile 16 in blocks of 32), one block, or several blocks gathered from a shuffled table.
# Context lengths end mid-block and mid-tile; the split rows cut the tiles into segments.
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_tile", [16, 32, 64])
def test_kv_tiles_wider_or_narrower_than_a_block_match_reference(block_size, kv_tile):
    check_against_reference([5, 1, 1], [70, 1, 97], 4, 2, 16, block_size, kv_tile=kv_tile, pad_tokens=2)
    check_against_reference([1, 1], [150, 33], 4, 2, 16, block_size, kv_tile=kv_tile, num_segments=4)


def test_choose_kv_tile_is_a_power_of_two_of_at_least_16():
    for decode_only in (True, False):
        tile = choose_kv_tile(decode_only)
        assert tile >= 16 and tile & (tile - 1) == 0


@pytest.mark.parametrize(
    "query_lens, seq_lens, block_size, kv_tile, num_segments",
    [
        ([1, 5], [2000, 1300], 16, 16, 1),  # 125 and 81 full tiles: 8 and 6 groups of block ids
        ([1], [720], 32, 16, 16),  # 3 tiles a segment: segments start inside a block of 32
        ([1, 1], [1100, 530], 16, 64, 4),  # 4 blocks a tile: a group's ids are 64
    ],
)
def test_full_tiles_read_their_block_ids_in_groups(query_lens, seq_lens, block_size, kv_tile, num_segments):
    """triton_kernels.py NOTE 3: the full tiles' block ids come in groups of ID_GROUP tiles,
    each tile gathering its own from registers; groups that end mid-walk, segments that start
    inside a block and tiles of several blocks all read the right keys (unused slots hold NaN)."""
    check_against_reference(query_lens, seq_lens, 4, 2, 16, block_size, kv_tile=kv_tile, num_segments=num_segments)


@triton.jit
def _id_slots_probe(out_ptr, FIRST_TILE: tl.constexpr, NUM_TILES: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    first_block = FIRST_TILE * TILE_N // BLOCK_SIZE
    for i in range(0, NUM_TILES):
        slots = triton_kernels._id_slots(FIRST_TILE + i, first_block, TILE_N, BLOCK_SIZE)  # [T]
        tl.store(out_ptr + i * TILE_N + tl.arange(0, TILE_N), slots)


@pytest.mark.parametrize("first_tile, kv_tile, block_size", [(0, 64, 16), (3, 32, 16), (1, 16, 32), (5, 16, 16)])
def test_a_tile_past_its_group_still_gathers_inside_the_groups_ids(first_tile, kv_tile, block_size):
    """triton_kernels.py NOTE 5: the pipeliner computes up to num_stages - 1 tiles past a group's
    loop; the index each of their keys gathers its block id at stays inside the group's ids, and
    the group's own tiles read exactly their keys' blocks."""
    extra = 4  # more than any num_stages the launcher picks, minus one
    group = triton_kernels.ID_GROUP.value
    num_slots = group * -(-kv_tile // block_size)
    out = torch.full(((group + extra) * kv_tile,), -1, dtype=torch.int32, device=DEVICE)
    _id_slots_probe[(1,)](out, FIRST_TILE=first_tile, NUM_TILES=group + extra, TILE_N=kv_tile, BLOCK_SIZE=block_size)
    slots = out.view(group + extra, kv_tile).cpu()
    assert 0 <= slots.min() and slots.max() < num_slots, f"slots {slots.min()}..{slots.max()}, the group has {num_slots}"
    first_block = first_tile * kv_tile // block_size
    for i in range(group):
        keys = (first_tile + i) * kv_tile + torch.arange(kv_tile)
        assert torch.equal(slots[i], (keys // block_size - first_block).to(torch.int32)), f"tile {first_tile + i}"


def test_split_kv_with_prefill_rows_and_padding():
    # the split path is chosen for decode, but it is correct for any batch
    check_against_reference([4, 1], [40, 70], 4, 2, 64, 16, num_segments=4, pad_tokens=3)


def test_a_prefill_chunk_padded_to_a_full_graph_key_matches_reference():
    """A FULL CUDA graph's key may have as many requests as tokens, (4, 4) say. A batch padded
    to it then looks like pure decode to the launcher (N == R): decode tiles and, with a long
    context, the split-KV path. The result must not depend on that: here the one real request
    has 3 query tokens after 600 cached ones, plus 3 padded requests and 1 padding row."""
    from tinyvllm.worker.attention_metadata import build_attention_metadata

    torch.manual_seed(0)
    num_kv_heads, group, head_size, block_size = 2, 2, 16, 16
    key_cache = torch.randn(48, block_size, num_kv_heads, head_size, device=DEVICE)  # [B, S, Hkv, D]
    value_cache = torch.randn_like(key_cache)
    md = build_attention_metadata(
        [600], [3], [list(range(39))], block_size, num_padded_tokens=4, num_padded_reqs=4,
        max_num_blocks=48, device=DEVICE,
    )  # fmt: skip
    assert choose_num_segments(4, 4, num_kv_heads, 48 * block_size) == SPLIT_KV_SEGMENTS
    q = torch.randn(4, num_kv_heads * group, head_size, device=DEVICE)  # [N_pad, H, D]
    scale = head_size**-0.5
    args = (q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_table, scale)
    expected = reference.paged_attention(*args)
    out = triton_attention.paged_attention(*args, out=torch.full_like(q, float("nan")))
    torch.testing.assert_close(out[:3], expected[:3], **TOLERANCES[torch.float32])
    assert (out[3:] == 0).all(), "the padding row must come back zero"


def test_a_mixed_full_graph_key_with_padded_requests_reads_the_steps_rows():
    """triton_kernels.py NOTE 1 under a FULL graph's mixed key (8 token rows, 4 requests): two
    real requests (3 tokens after 20 cached, 1 after 40), 2 padded requests and 4 padding rows
    whose key and value rows hold NaN. The plan reads the step's rows; no padded request nor
    padding row may read one, and the padding rows come back zero."""
    from tinyvllm.worker.attention_metadata import build_attention_metadata

    torch.manual_seed(1)
    num_kv_heads, group, head_size, block_size = 2, 2, 16, 16
    key_cache = torch.randn(16, block_size, num_kv_heads, head_size, device=DEVICE)  # [B, S, Hkv, D]
    value_cache = torch.randn_like(key_cache)
    md = build_attention_metadata(
        [20, 40], [3, 1], [[0, 1], [2, 3, 4]], block_size, num_padded_tokens=8, num_padded_reqs=4,
        max_num_blocks=16, device=DEVICE,
    )  # fmt: skip
    q = torch.randn(8, num_kv_heads * group, head_size, device=DEVICE)  # [N_pad, H, D]
    args = (q, key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_table, head_size**-0.5)
    k, v = step_rows(key_cache, value_cache, md.query_start_loc, md.seq_lens, md.block_table, 8)
    assert k[4:].isnan().all() and not k[:4].isnan().any()  # the padding rows' keys: NaN
    expected = reference.paged_attention(*args)
    out = triton_attention.paged_attention(*args, out=torch.full_like(q, float("nan")), key=k, value=v)
    torch.testing.assert_close(out[:4], expected[:4], **TOLERANCES[torch.float32])
    assert (out[4:] == 0).all(), "the padding rows must come back zero"


@st.composite
def tiny_batches(draw):
    num_reqs = draw(st.integers(1, 3))
    query_lens = [draw(st.sampled_from([1, 1, 2, 5, 16, 24])) for _ in range(num_reqs)]
    seq_lens = [q + draw(st.sampled_from([0, 0, 1, 15, 16, 40])) for q in query_lens]
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(
        query_lens=query_lens, seq_lens=seq_lens, num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads, head_size=64, block_size=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16])),
        num_segments=draw(st.sampled_from([None, None, 1, 4])), pad_tokens=draw(st.sampled_from([0, 0, 3])),
        seed=draw(st.integers(0, 2**16)), kv_tile=draw(st.sampled_from([None, None, 16, 32, 64])),
        block_m=draw(st.sampled_from([None, None, 16, 128])), rows=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=20)
@given(tiny_batches())
def test_drawn_tiny_batches_match_reference(case):
    check_against_reference(**case)


def test_choose_num_segments_splits_only_few_long_decodes():
    assert choose_num_segments(num_tokens=4, num_reqs=4, num_kv_heads=8, max_context=4096) == SPLIT_KV_SEGMENTS
    assert choose_num_segments(num_tokens=5, num_reqs=4, num_kv_heads=8, max_context=4096) == 1  # a prefill row
    assert choose_num_segments(num_tokens=64, num_reqs=64, num_kv_heads=8, max_context=4096) == 1  # 512 programs
    assert choose_num_segments(num_tokens=4, num_reqs=4, num_kv_heads=8, max_context=256) == 1  # short


@given(st.integers(1, 16), st.booleans(), st.sampled_from([None, 16, 32, 64, 128]))
def test_query_tile_holds_its_rows(group, decode_only, rows):
    block_q, block_m = choose_query_tile(group, decode_only, rows=rows)
    assert block_q >= 1 and block_m >= 16 and block_m & (block_m - 1) == 0
    assert block_q * group <= block_m
    if rows is not None and group <= rows:  # the target is met exactly when one token's heads fit
        assert block_m == rows


def _args():
    q, kc, vc, qsl, sl, bt, _ = make_case([2], [3], 4, 2, 16, 16)  # H = 4, Hkv = 2
    return dict(query=q, key_cache=kc, value_cache=vc, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=1.0)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(query=a["query"][0]), "must be \\[N, H, D\\]"),
        (lambda a: a.update(value_cache=a["value_cache"][:1]), "must both be"),
        (lambda a: a.update(query=torch.zeros(2, 3, 16)), "query heads 3 are not a multiple"),
        (lambda a: a.update(query=torch.zeros(2, 2, 8)), "cache head size 16 != query head size 8"),
        (lambda a: a.update(query=a["query"].half()), "must be one dtype"),
        (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens dtype torch.int64"),
        (lambda a: a.update(query_start_loc=torch.zeros(3, dtype=torch.int32)), "must be \\[R \\+ 1\\]"),
        (lambda a: a.update(block_table=a["block_table"][:0]), "must be \\[R, max_blocks\\] with R = 1"),
        (lambda a: a.update(block_table=torch.zeros(1, 4, dtype=torch.int32)[:, ::2]), "must be unit along max_blocks"),
        (lambda a: a.update(out=torch.zeros(2, 4, 16, dtype=torch.float16)), "out \\(2, 4, 16\\) torch.float16"),
        (lambda a: a.update(num_segments=3), "num_segments 3"),
        (lambda a: a.update(kv_tile=24), "kv_tile 24"),
        (lambda a: a.update(kv_tile=8), "kv_tile 8"),
        (lambda a: a.update(block_m=48), "block_m 48 must be a power of two >= 16"),
        (lambda a: a.update(block_m=8), "block_m 8"),
        (lambda a: a.update(num_warps=3), "num_warps 3 must be one of"),
        (lambda a: a.update(num_warps=32), "num_warps 32"),
        (lambda a: a.update(num_stages=0), "num_stages 0 must be >= 1"),
        (lambda a: a.update(query=torch.zeros(2, 16, 4).transpose(1, 2)), "query must have unit stride along D"),
    ],
)
def test_launcher_checks(change, message):
    args = _args()
    change(args)
    with pytest.raises(ValueError, match=message):
        triton_attention.paged_attention(**args)


@pytest.mark.parametrize(
    "override, message",
    [(dict(block_m=64.0), "block_m must be an int or None, got float 64.0"), (dict(num_warps=True), "num_warps must be an int"),
     (dict(num_stages="3"), "num_stages must be an int or None, got str '3'")],
)  # fmt: skip
def test_launcher_rejects_launch_overrides_of_the_wrong_type(override, message):
    with pytest.raises(TypeError, match=message):
        triton_attention.paged_attention(**_args(), **override)


@pytest.mark.parametrize("block_size, head_size, message", [(8, 16, "block size 8"), (16, 80, "head size 80")])
def test_launcher_rejects_unsupported_tile_sizes(block_size, head_size, message):
    q, kc, vc, qsl, sl, bt, _ = make_case([1], [3], 2, 1, head_size, block_size)
    with pytest.raises(ValueError, match=message):
        triton_attention.paged_attention(q, kc, vc, qsl, sl, bt, 1.0)


def _planned(query_lens=(3, 1, 24), seq_lens=(40, 33, 24), num_heads=8, num_kv_heads=2, **plan_args):
    q, kc, vc, qsl, sl, bt, _ = make_case(list(query_lens), list(seq_lens), num_heads, num_kv_heads, 16, 16)
    layout = AttentionLayout(num_heads, num_kv_heads, 16, 16, q.dtype, q.device)
    return (q, kc, vc, qsl, sl, bt), triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout, **plan_args)


@pytest.mark.parametrize(
    "case",
    [
        dict(),  # chunked prefill + decode + prefill, GQA 4
        dict(query_lens=[1, 1], seq_lens=[600, 17], num_segments=4),  # split KV: the plan's buffers used
        dict(query_lens=[1, 1, 1], seq_lens=[5, 17, 3], kv_tile=16),
    ],
)
def test_a_step_plan_gives_the_same_result_in_every_layer(case):
    """NOTE 4: one plan, used by several layers (caches of their own), gives each the result
    of a call that plans for itself, bit for bit."""
    args, plan = _planned(**case)
    q, kc, vc, qsl, sl, bt = args
    for layer in range(3):
        kc_l, vc_l = kc * (layer + 1), vc - layer
        k, v = step_rows(kc_l, vc_l, qsl, sl, bt, q.shape[0])  # read when the plan says step_kv (the mixed case)
        alone = triton_attention.paged_attention(q, kc_l, vc_l, qsl, sl, bt, 0.25, key=k, value=v,
                                                 num_segments=case.get("num_segments"), kv_tile=case.get("kv_tile"))  # fmt: skip
        out = torch.full_like(q, float("nan"))
        assert triton_attention.paged_attention(q, kc_l, vc_l, qsl, sl, bt, 0.25, out=out, key=k, value=v, plan=plan) is out
        assert torch.equal(out, alone)
        torch.testing.assert_close(out, reference.paged_attention(q, kc_l, vc_l, qsl, sl, bt, 0.25), **TOLERANCES[q.dtype])


def test_a_step_plan_holds_the_choices_of_the_step():
    _, plan = _planned(query_lens=[1] * 2, seq_lens=[600, 17])
    assert plan.num_segments == SPLIT_KV_SEGMENTS and plan.part_max.shape == (2, 8, SPLIT_KV_SEGMENTS)
    assert plan.grid == (1 + 2, 2, SPLIT_KV_SEGMENTS)  # cdiv(N, BLOCK_Q) + R tiles: BLOCK_Q = 4 at G = 4
    assert plan.constexprs["QUERIES_PER_KV"] == 4 and plan.constexprs["TILE_N"] == choose_kv_tile(True)
    _, mixed = _planned()
    assert mixed.num_segments == 1 and mixed.constexprs["BLOCK_Q"] == choose_query_tile(4, False)[0]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(query=a["query"][:-1]), "query \\(27, 8, 16\\) torch.float32 on cpu: the plan is for \\(28, 8, 16\\)"),
        (lambda a: a.update(query=a["query"].half()), "query \\(28, 8, 16\\) torch.float16"),
        (lambda a: a.update(query=a["query"].view(28, 4, 32)), "query \\(28, 4, 32\\)"),
        (lambda a: a.update(key_cache=a["key_cache"][:, :, :1]), "key_cache \\(\\d+, 16, 1, 16\\)"),
        (lambda a: a.update(value_cache=a["value_cache"].double()), "value_cache .* torch.float64"),
        (lambda a: a.update(out=torch.zeros(28, 8, 8)), "out \\(28, 8, 8\\)"),
        (lambda a: a.update(seq_lens=a["seq_lens"].clone()), "must be the tensors the plan was made from"),
        (lambda a: a.update(query=torch.zeros(28, 16, 8).transpose(1, 2)), "query must have unit stride along D"),
        (lambda a: a.update(kv_tile=64), "kv_tile 64: give them to plan_step"),
        (lambda a: a.update(key=None, value=None), "pass key= and value="),
        (lambda a: a.update(value=None), "key and value: give both"),
        (lambda a: a.update(key=a["key"][:, :1]), "key \\(28, 1, 16\\) .*: the plan is for \\(28, 2, 16\\)"),
        (lambda a: a.update(value=a["value"].double()), "value \\(28, 2, 16\\) torch.float64"),
    ],
)
def test_a_layer_that_disagrees_with_the_plan_is_refused(change, message):
    (q, kc, vc, qsl, sl, bt), plan = _planned()
    assert plan.step_kv  # a batch with prompt rows reads the step's keys from their rows
    k, v = step_rows(kc, vc, qsl, sl, bt, q.shape[0])
    args = dict(query=q, key_cache=kc, value_cache=vc, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=1.0,
                key=k, value=v)  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=message):
        triton_attention.paged_attention(**args, plan=plan)


def test_plan_step_checks_the_layout_and_the_metadata():
    _, _, _, qsl, sl, bt, _ = make_case([2], [3], 4, 2, 16, 16)
    layout = AttentionLayout(4, 2, 16, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="query heads 4 are not a multiple of KV heads 3"):
        triton_attention.plan_step(qsl, sl, bt, 2, dataclasses.replace(layout, num_kv_heads=3))
    with pytest.raises(ValueError, match="dtype torch.int8"):
        triton_attention.plan_step(qsl, sl, bt, 2, dataclasses.replace(layout, dtype=torch.int8))
    with pytest.raises(ValueError, match="block_table dtype torch.int64"):
        triton_attention.plan_step(qsl, sl, bt.long(), 2, layout)
    with pytest.raises(ValueError, match="num_segments 3"):
        triton_attention.plan_step(qsl, sl, bt, 2, layout, num_segments=3)


def test_the_prebound_launch_falls_back_to_the_jit_off_cuda(monkeypatch):
    """NOTE 5: asked for on the CPU (the interpreter has no compiled kernel), the plan keeps
    Triton's JIT launch, with the same result; an unknown value is refused by name."""
    monkeypatch.setenv(triton_attention.LAUNCH_ENV, "prebound")
    (q, kc, vc, qsl, sl, bt), plan = _planned()
    assert plan.launchers is None
    k, v = step_rows(kc, vc, qsl, sl, bt, q.shape[0])
    out = triton_attention.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, key=k, value=v, plan=plan)
    monkeypatch.delenv(triton_attention.LAUNCH_ENV)
    assert torch.equal(out, triton_attention.paged_attention(q, kc, vc, qsl, sl, bt, 0.25, key=k, value=v))
    monkeypatch.setenv(triton_attention.LAUNCH_ENV, "fast")
    with pytest.raises(ValueError, match="TINYVLLM_TRITON_LAUNCH='fast'"):
        _planned()


def test_the_plans_constexprs_are_the_kernels_last_parameters_in_order():
    """NOTE 5's launch passes every parameter by position: the plan's constexprs must be the
    kernel's parameters after its 33 runtime arguments (the two descriptors among them), in the same order."""
    _, plan = _planned()
    names = triton_attention._paged_attention_kernel.arg_names
    assert len(names) == 33 + len(plan.constexprs) and names[33:] == list(plan.constexprs)


# ---- GPU: wide and many (run with `python3 -m pytest -m gpu` on a CUDA machine) ----

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# Every (dtype, head size, block size) once, the GQA group cycling through 1, 2, 4 and 8 so
# each group meets both head sizes and both block sizes: 12 cases, not the 48 of the whole
# product. On a cold Triton cache each case costs compilations (Triton specializes the
# token count when it divides by 16, so the unpadded N=115 and padded N=128 batches are two
# kernels), about 1.5 s each for sm_90: the product alone took about 144 s of the GPU
# check's budget. The padded batch runs in half precision only, where padding meets CUDA
# graphs; float32 keeps the unpadded one.
MIXED_CASES = [
    (dtype, head_size, block_size, [1, 2, 4, 8][i % 4])
    for i, (dtype, head_size, block_size) in enumerate(
        (d, h, b) for d in (torch.float32, torch.float16, torch.bfloat16) for h in (64, 128) for b in (16, 32)
    )
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype, head_size, block_size, group", MIXED_CASES)
def test_gpu_mixed_batches(dtype, head_size, block_size, group):
    query_lens = [1, 7, 1, 37, 1, 64, 3, 1]
    seq_lens = [1, 17, 255, 300, 256, 64, 1000, 2049]
    pads = ((0, 0),) if dtype == torch.float32 else ((0, 0), (1, 13))
    for seed, pad in pads:
        check_against_reference(
            query_lens, seq_lens, 2 * group, 2, head_size, block_size,
            dtype=dtype, pad_tokens=pad, device="cuda", seed=seed,
        )  # fmt: skip


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_segments", [None, 1, 4, SPLIT_KV_SEGMENTS])
def test_gpu_long_decode_split_kv(dtype, num_segments):
    seq_lens = [4096, 1, 17, 255, 8000, 600]
    check_against_reference([1] * len(seq_lens), seq_lens, 32, 8, 128, 16, dtype=dtype, num_segments=num_segments, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_tile", [16, 64, 128])  # 32, the default, runs in every other gpu test
def test_gpu_every_kv_tile(kv_tile):
    query_lens, seq_lens = [1, 37, 1, 300, 1], [1, 300, 2049, 700, 64]
    check_against_reference(query_lens, seq_lens, 16, 8, 128, 16, dtype=torch.bfloat16, kv_tile=kv_tile, device="cuda")
    check_against_reference([1] * 4, [4096, 17, 600, 1], 16, 8, 128, 32, dtype=torch.bfloat16, kv_tile=kv_tile, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_long_prefill(dtype):
    check_against_reference([1024, 300], [1024, 2300], 16, 4, 128, 16, dtype=dtype, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("seed", range(8))
def test_gpu_drawn_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    num_reqs = int(torch.randint(1, 40, (1,), generator=gen))
    query_lens = torch.randint(1, 80, (num_reqs,), generator=gen)
    query_lens = torch.where(torch.rand(num_reqs, generator=gen) < 0.6, 1, query_lens).tolist()
    seq_lens = [q + int(torch.randint(0, 1500, (1,), generator=gen)) for q in query_lens]
    check_against_reference(query_lens, seq_lens, 16, 2, 128, 16, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prebound_launch_equals_the_jit_launch(dtype, monkeypatch):
    """NOTE 5: the pre-bound launch gives the JIT launch's output bit for bit, in every layer
    of a step (mixed, and a split decode), compiling once per step for layers alike; a layer
    whose strides differ gets its own compiled kernel."""
    for query_lens, seq_lens in (([1, 7, 1, 37, 1, 64], [1, 17, 255, 300, 256, 64]), ([1, 1], [4096, 600])):
        q, kc, vc, qsl, sl, bt, _ = make_case(query_lens, seq_lens, 8, 2, 128, 16, dtype=dtype, device="cuda")
        layout = AttentionLayout(8, 2, 128, 16, dtype, q.device)
        monkeypatch.setenv(triton_attention.LAUNCH_ENV, "prebound")
        plan = triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout)
        monkeypatch.delenv(triton_attention.LAUNCH_ENV)
        jit_plan = triton_attention.plan_step(qsl, sl, bt, q.shape[0], layout)
        assert plan.launchers == {} and jit_plan.launchers is None
        assert plan.step_kv == jit_plan.step_kv == (len(query_lens) > 2)  # the mixed step reads its own rows
        for layer in range(3):
            kc_l, vc_l = kc * (layer + 1), vc - layer
            rows = dict(zip(("key", "value"), step_rows(kc_l, vc_l, qsl, sl, bt, q.shape[0]))) if plan.step_kv else {}
            prebound = triton_attention.paged_attention(q, kc_l, vc_l, qsl, sl, bt, 0.1, plan=plan, **rows)
            jit = triton_attention.paged_attention(q, kc_l, vc_l, qsl, sl, bt, 0.1, plan=jit_plan, **rows)
            assert torch.equal(prebound, jit)
        assert len(plan.launchers) == 1
        wide = torch.zeros(q.shape[0], 8, 256, dtype=dtype, device="cuda")[:, :, :128]  # other strides
        wide.copy_(q)
        assert torch.equal(triton_attention.paged_attention(wide, kc_l, vc_l, qsl, sl, bt, 0.1, plan=plan, **rows),
                           triton_attention.paged_attention(wide, kc_l, vc_l, qsl, sl, bt, 0.1, plan=jit_plan, **rows))  # fmt: skip
        assert len(plan.launchers) == 2
