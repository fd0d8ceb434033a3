"""Properties of the attention-metadata builders over drawn batches."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID
from tinyvllm.core.kv_cache_manager import cdiv
from tinyvllm.worker.attention_metadata import (
    build_attention_metadata,
    compute_logits_indices,
    compute_positions,
    compute_query_start_loc,
    compute_slot_mapping,
)


@st.composite
def batches(draw):
    """Requests with distinct block ids from one pool, enough blocks for their tokens."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_reqs = draw(st.integers(1, 6))
    computed = [draw(st.integers(0, 40)) for _ in range(num_reqs)]
    scheduled = [draw(st.integers(1, 20)) for _ in range(num_reqs)]
    needed = [cdiv(c + n, block_size) + draw(st.integers(0, 2)) for c, n in zip(computed, scheduled)]
    pool = draw(st.permutations(range(sum(needed) + draw(st.integers(0, 5)))))
    ends = list(itertools.accumulate(needed))
    block_ids = [list(pool[end - k : end]) for k, end in zip(needed, ends)]
    return computed, scheduled, block_ids, block_size


@pytest.mark.seed("003:memory")
@given(batches())
def test_slot_mapping_is_injective_and_inside_own_blocks(batch):
    computed, scheduled, block_ids, block_size = batch
    slots = compute_slot_mapping(computed, scheduled, block_ids, block_size)
    assert len(set(slots)) == len(slots), f"duplicate slots in {slots}"
    starts = compute_query_start_loc(scheduled)
    for r, ids in enumerate(block_ids):
        for slot in slots[starts[r] : starts[r + 1]]:
            assert slot // block_size in ids, f"slot {slot} of request {r} is outside its blocks {ids}"


@pytest.mark.seed("003:memory")
@given(batches())
def test_positions_continue_from_num_computed_tokens(batch):
    computed, scheduled, block_ids, block_size = batch
    positions = compute_positions(computed, scheduled)
    starts = compute_query_start_loc(scheduled)
    for r, (c, n) in enumerate(zip(computed, scheduled)):
        assert positions[starts[r] : starts[r + 1]] == list(range(c, c + n))


@given(batches())
def test_query_start_loc_is_cumsum_and_logits_point_at_last_tokens(batch):
    computed, scheduled, block_ids, block_size = batch
    starts = compute_query_start_loc(scheduled)
    assert starts == [0] + list(itertools.accumulate(scheduled))
    logits = compute_logits_indices(starts)
    positions = compute_positions(computed, scheduled)
    for r, (c, n) in enumerate(zip(computed, scheduled)):
        assert positions[logits[r]] == c + n - 1, f"logits row {logits[r]} is not request {r}'s last token"


@given(batches(), st.integers(0, 7))
def test_padding_rows_skip_and_belong_to_no_request(batch, pad):
    computed, scheduled, block_ids, block_size = batch
    md = build_attention_metadata(
        computed, scheduled, block_ids, block_size, num_padded_tokens=sum(scheduled) + pad
    )
    num_actual = md.query_start_loc[-1].item()
    assert num_actual == sum(scheduled)
    assert md.slot_mapping[num_actual:].tolist() == [PAD_SLOT_ID] * pad
    assert md.positions[num_actual:].tolist() == [0] * pad
    for r, ids in enumerate(block_ids):
        assert md.block_table[r, : len(ids)].tolist() == ids
