"""Properties of the batched torch (SDPA) attention backend over drawn paged batches.

A drawn batch: a GQA ratio, a block size, 1-6 requests each with a drawn query length
(0, 1 for a decode, or more for a prefill or a chunk of one) and context before it, a
drawn number of leading blocks shared by every request longer than them (a cached
prefix), a block pool shuffled by a drawn permutation, block-table entries past a
request's own blocks drawn from the whole pool, and padding rows. Unused cache slots are
filled with a drawn "garbage" value (NaN, or huge finite values), so reading one shows in
the result.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.attention import reference, torch_sdpa
from tinyvllm.core.kv_cache_manager import cdiv

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-6, rtol=torch.finfo(torch.float16).eps),  # one rounding step
    torch.bfloat16: dict(atol=1e-6, rtol=torch.finfo(torch.bfloat16).eps),
}


@st.composite
def paged_batches(draw, shared_prefix: bool = False):
    """``shared_prefix``: mostly decodes, at least two requests and a shared prefix drawn."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    num_reqs = draw(st.integers(2 if shared_prefix else 1, 6))
    lengths = [0, 1, 1, 1, 1, 1, 2, 7] if shared_prefix else [0, 1, 1, 1, 2, 3, 7, 20]
    query_lens = [draw(st.sampled_from(lengths)) for _ in range(num_reqs)]
    # A prefix of whole blocks that every request longer than it holds, as prefix caching
    # leaves it: the same cache blocks at the start of each of their rows.
    num_shared = draw(st.integers(1 if shared_prefix else 0, 3))
    least = num_shared * block_size if shared_prefix else 0  # context before the query tokens
    seq_lens = [q + draw(st.integers(least if q else 0, least + 40)) for q in query_lens]  # q = 0: padded
    needed = [cdiv(s, block_size) for s in seq_lens]
    sharers = [r for r, s in enumerate(seq_lens) if s > num_shared * block_size]
    if len(sharers) < 2:
        num_shared, sharers = 0, []
    own = [n - (num_shared if r in sharers else 0) for r, n in enumerate(needed)]
    num_blocks = num_shared + sum(own) + draw(st.integers(1, 3))  # some blocks nobody owns
    pool = draw(st.permutations(range(num_blocks)))
    width = max(1, *needed) + draw(st.integers(0, 2))
    block_ids, table, start = [], [], num_shared
    for r, n in enumerate(own):
        block_ids.append(list(pool[:num_shared] if r in sharers else []) + list(pool[start : start + n]))
        start += n
        pad = width - needed[r]
        tail = draw(st.lists(st.integers(0, num_blocks - 1), min_size=pad, max_size=pad))
        table.append(block_ids[-1] + tail)  # entries past the request's blocks: any block
    return dict(
        query_lens=query_lens, seq_lens=seq_lens, block_ids=block_ids, table=table,
        num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * group, head_size=draw(st.sampled_from([16, 64])),
        dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16])),
        pad_tokens=draw(st.sampled_from([0, 0, 3])), seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


def build(case, garbage: float):
    """The tensors of a drawn case, with ``garbage`` in every slot no request owns."""
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["num_blocks"], case["block_size"], case["num_kv_heads"], case["head_size"])
    caches = []
    for _ in range(2):
        cache = torch.full(shape, garbage)
        for ids, seq_len in zip(case["block_ids"], case["seq_lens"]):
            flat = cache[torch.tensor(ids, dtype=torch.long)].flatten(0, 1)  # a copy of the request's blocks
            flat[:seq_len] = torch.randn(seq_len, *shape[2:], generator=gen)
            cache[torch.tensor(ids, dtype=torch.long)] = flat.view(len(ids), *shape[1:])
        caches.append(cache.to(case["dtype"]))
    num_rows = sum(case["query_lens"]) + case["pad_tokens"]
    query = torch.randn(num_rows, case["num_heads"], case["head_size"], generator=gen).to(case["dtype"])
    qsl = torch.tensor([0, *torch.tensor(case["query_lens"]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32)
    table = torch.tensor(case["table"], dtype=torch.int32)
    return query, caches[0], caches[1], qsl, seq_lens, table


def run(paged_attention, tensors, head_size, **kwargs):
    query = tensors[0]
    out = torch.full_like(query, float("nan"))
    return paged_attention(*tensors, head_size**-0.5, out=out, **kwargs)


@pytest.mark.seed("003:memory")
@given(paged_batches())
def test_torch_sdpa_matches_reference_on_drawn_batches(case):
    tensors = build(case, float("nan"))
    out = run(torch_sdpa.paged_attention, tensors, case["head_size"])
    expected = run(reference.paged_attention, tensors, case["head_size"])
    assert out.dtype == case["dtype"] and not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOLERANCES[case["dtype"]])
    assert (out[sum(case["query_lens"]) :] == 0).all()


@pytest.mark.seed("003:memory")
@given(paged_batches(), st.sampled_from([float("nan"), 1e4, -1e4]))
def test_torch_sdpa_never_reads_a_slot_it_does_not_own(case, garbage):
    """What unused slots hold cannot change a single bit of the result (NOTE 2 of the module)."""
    clean = run(torch_sdpa.paged_attention, build(case, 0.0), case["head_size"])
    dirty = run(torch_sdpa.paged_attention, build(case, garbage), case["head_size"])
    assert torch.equal(clean, dirty)


@given(st.lists(st.integers(1, 2000), min_size=0, max_size=40), st.data())
def test_torch_sdpa_length_groups_cover_each_request_once_and_bound_padding(lens, data):
    """Every named request is in exactly one group; a group's longest is at most
    ``GROUP_PADDING`` times each of its lengths; the next group's longest is below that
    bound (a group is never split early); groups run longest first."""
    reqs = data.draw(st.lists(st.sampled_from(range(len(lens))), unique=True)) if lens else []
    groups = torch_sdpa.group_by_length(lens, reqs)
    assert sorted(r for g in groups for r in g) == sorted(reqs)
    for i, group in enumerate(groups):
        longest = lens[group[0]]
        assert [lens[r] for r in group] == sorted((lens[r] for r in group), reverse=True)
        assert all(longest <= torch_sdpa.GROUP_PADDING * lens[r] for r in group)
        if i + 1 < len(groups):
            assert longest > torch_sdpa.GROUP_PADDING * lens[groups[i + 1][0]]


@pytest.mark.seed("003:memory")
@given(paged_batches(shared_prefix=True), st.sampled_from([float("nan"), 1e4, -1e4]))
def test_torch_sdpa_cascade_matches_reference_and_reads_only_owned_slots(case, garbage):
    """Every shared prefix split off and attended once (NOTE 7), whatever it saves: the
    result still equals the reference, and what unused slots hold changes no bit of it."""
    tensors = build(case, float("nan"))
    plan = torch_sdpa.plan_step(*tensors[3:], case["block_size"], cascade_min_saved_keys=0)
    out = run(torch_sdpa.paged_attention, tensors, case["head_size"], plan=plan)
    expected = run(reference.paged_attention, tensors, case["head_size"])
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOLERANCES[case["dtype"]])
    dirty = build(case, garbage)
    again = run(torch_sdpa.paged_attention, dirty, case["head_size"], plan=plan)
    assert torch.equal(out, again)
