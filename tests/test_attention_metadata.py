"""Attention metadata: worked examples of the pure builders and of the padding convention."""

import pytest
import torch

from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID
from tinyvllm.worker.attention_metadata import (
    PAD_BLOCK_ID,
    AttentionMetadata,
    build_attention_metadata,
    build_step_inputs,
    compute_logits_indices,
    compute_positions,
    compute_query_start_loc,
    compute_seq_lens,
    compute_slot_mapping,
    pad_block_table,
    slot_for_position,
)

# Request 0: a 5-token prompt prefilled from scratch in blocks [3, 7] (block size 4).
# Request 1: decoding its 7th token (6 computed) in blocks [1, 2].
# Request 2: a chunked prefill: tokens 4..5 of its prompt, blocks [0, 5].
COMPUTED = [0, 6, 4]
SCHEDULED = [5, 1, 2]
BLOCKS = [[3, 7], [1, 2], [0, 5]]


@pytest.mark.seed("003:memory")
def test_builders_on_a_mixed_batch():
    assert compute_query_start_loc(SCHEDULED) == [0, 5, 6, 8]
    assert compute_seq_lens(COMPUTED, SCHEDULED) == [5, 7, 6]
    assert compute_positions(COMPUTED, SCHEDULED) == [0, 1, 2, 3, 4, 6, 4, 5]
    # request 0: 3*4+0..3, then 7*4+0; request 1: position 6 -> block 2, offset 2;
    # request 2: positions 4, 5 -> block 5, offsets 0, 1
    assert compute_slot_mapping(COMPUTED, SCHEDULED, BLOCKS, 4) == [12, 13, 14, 15, 28, 10, 20, 21]
    assert compute_logits_indices([0, 5, 6, 8]) == [4, 5, 7]
    assert slot_for_position([3, 7], 4, 4) == 28


def test_step_inputs_of_a_decode_step_equal_the_builders():
    """A step of one token per request takes a shorter path; its lists are the builders'."""
    computed, scheduled, blocks = [6, 0, 9], [1, 1, 1], [[1, 2], [4], [0, 5, 3]]
    step = build_step_inputs(computed, scheduled, blocks, 4, num_padded_tokens=5, num_padded_reqs=4)
    qsl = compute_query_start_loc(scheduled)
    assert step.query_start_loc == qsl + [3] and step.positions == compute_positions(computed, scheduled) + [0, 0]
    assert step.seq_lens == compute_seq_lens(computed, scheduled) + [0]
    assert step.slot_mapping == compute_slot_mapping(computed, scheduled, blocks, 4) + [PAD_SLOT_ID] * 2
    assert step.logits_indices == compute_logits_indices(qsl + [3])
    assert (step.max_query_len, step.max_seq_len) == (1, 10)


def test_pad_block_table():
    assert pad_block_table([[3], [1, 2, 9]], 4) == [[3, PAD_BLOCK_ID, PAD_BLOCK_ID, PAD_BLOCK_ID], [1, 2, 9, PAD_BLOCK_ID]]
    with pytest.raises(ValueError, match="max_num_blocks = 2"):
        pad_block_table([[1, 2, 3]], 2)


def test_build_attention_metadata_with_padding():
    md = build_attention_metadata(COMPUTED, SCHEDULED, BLOCKS, 4, num_padded_tokens=10, max_num_blocks=3)
    assert isinstance(md, AttentionMetadata)
    assert md.positions.tolist() == [0, 1, 2, 3, 4, 6, 4, 5, 0, 0]
    assert md.slot_mapping.tolist() == [12, 13, 14, 15, 28, 10, 20, 21, PAD_SLOT_ID, PAD_SLOT_ID]
    assert md.query_start_loc.tolist() == [0, 5, 6, 8]
    assert md.query_start_loc.dtype == torch.int32 and md.seq_lens.dtype == torch.int32
    assert md.seq_lens.tolist() == [5, 7, 6]
    assert md.block_table.tolist() == [[3, 7, 0], [1, 2, 0], [0, 5, 0]]
    assert md.block_table.dtype == torch.int32
    assert md.logits_indices.tolist() == [4, 5, 7]
    assert (md.query_start_loc[-1].item(), md.num_padded_tokens, md.num_reqs) == (8, 10, 3)
    assert (md.max_query_len, md.max_seq_len) == (5, 7)
    with pytest.raises(AttributeError):
        md.max_query_len = 3  # frozen


@pytest.mark.seed("000:dispatcher")
def test_build_attention_metadata_pads_requests_for_a_full_cudagraph():
    """A FULL graph fixes the request count too: two padded requests with no tokens,
    seq_len 0 and an all-PAD block-table row (attention_metadata.py NOTE 1)."""
    md = build_attention_metadata(
        COMPUTED, SCHEDULED, BLOCKS, 4, num_padded_tokens=10, num_padded_reqs=5, max_num_blocks=3
    )
    assert md.query_start_loc.tolist() == [0, 5, 6, 8, 8, 8]
    assert md.seq_lens.tolist() == [5, 7, 6, 0, 0]
    assert md.block_table.tolist() == [[3, 7, 0], [1, 2, 0], [0, 5, 0], [PAD_BLOCK_ID] * 3, [PAD_BLOCK_ID] * 3]
    assert md.logits_indices.tolist() == [4, 5, 7, 7, 7]
    assert (md.num_reqs, md.num_padded_tokens) == (5, 10)
    step = build_step_inputs(COMPUTED, SCHEDULED, BLOCKS, 4, num_padded_tokens=10, num_padded_reqs=5)
    assert step.num_tokens == 8 and step.seq_lens == [5, 7, 6, 0, 0]
    with pytest.raises(ValueError, match="num_padded_reqs = 2 is less than the 3 scheduled requests"):
        build_step_inputs(COMPUTED, SCHEDULED, BLOCKS, 4, num_padded_reqs=2)


@pytest.mark.parametrize(
    "computed, scheduled, blocks, kwargs, message",
    [
        ([0], [0], [[1]], {}, r"num_scheduled_tokens\[0\] = 0"),
        ([-1], [1], [[1]], {}, r"num_computed_tokens\[0\] = -1"),
        ([0, 0], [1], [[1]], {}, "num_computed_tokens has 2 requests"),
        ([4], [1], [[1]], {}, "request 0 has 1 blocks but 5 tokens need 2"),
        ([0], [3], [[1]], {"num_padded_tokens": 2}, "num_padded_tokens = 2"),
        ([0], [1], [[1], [2]], {}, "block_ids has 2 rows"),
    ],
)
def test_bad_input_raises_value_error(computed, scheduled, blocks, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(computed, scheduled, blocks, 4, **kwargs)
