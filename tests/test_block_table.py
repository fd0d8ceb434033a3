"""The persistent block table and input buffers: updated in place, one address for the run
(seed 000 "完整 CUDA 图捕获 & 热身": a graph replays on fixed inputs)."""

import pytest
import torch

from tinyvllm.attention.kv_cache_write import PAD_SLOT_ID
from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.logits_processors import build_logitsprocs
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.attention_metadata import build_attention_metadata, build_step_inputs
from tinyvllm.worker.block_table import PAD_BLOCK_ID, BlockTable
from tinyvllm.worker.input_batch import InputBatch
from tinyvllm.worker.input_buffers import PAD_TOKEN_ID, InputBuffers


def test_block_table_rows_add_append_move_swap_clear():
    table = BlockTable(4, 5)
    table.add_row(0, [7, 3])
    table.append_row(0, [9])
    table.add_row(2, [1])
    assert table.row(0) == [7, 3, 9] and table.row(2) == [1]
    table.move_row(2, 1)
    assert table.row(1) == [1] and table.row(2) == [] and table.cpu[2].tolist() == [PAD_BLOCK_ID] * 5
    table.swap_rows(0, 1)
    assert table.row(0) == [1] and table.row(1) == [7, 3, 9]
    table.add_row(1, [4])  # a resumed request: the row is replaced, not extended
    assert table.cpu[1].tolist() == [4, PAD_BLOCK_ID, PAD_BLOCK_ID, PAD_BLOCK_ID, PAD_BLOCK_ID]
    table.clear_row(0)
    assert table.rows_for_step(2).tolist() == [[PAD_BLOCK_ID] * 5, [4] + [PAD_BLOCK_ID] * 4]
    table.check_invariants()
    with pytest.raises(ValueError, match="row 1 would hold 6 blocks, more than 5"):
        table.append_row(1, [1, 2, 3, 4, 5])


def test_block_table_follows_the_input_batch_rows():
    config = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=4))
    batch = InputBatch(4, "cpu", build_logitsprocs(config, torch.device("cpu"), False, False), max_num_blocks_per_req=3)
    for i, ids in enumerate(([1], [2, 3], [4], [5, 6, 7])):
        batch.add_request(f"r{i}", SamplingParams(), None, [], block_ids=ids)
    batch.refresh()
    batch.remove_request("r1")
    batch.condense()  # r3 moves from row 3 to row 1, with its blocks
    batch.refresh()
    assert batch.req_ids == ["r0", "r3", "r2"]
    assert [batch.block_table.row(r) for r in range(4)] == [[1], [5, 6, 7], [4], []]
    batch.swap_states(0, 2)
    assert batch.block_table.row(0) == [4] and batch.block_table.row(2) == [1]
    batch.check_invariants()


def test_input_buffers_write_prefixes_and_keep_their_address():
    buffers = InputBuffers(max_num_tokens=16, max_num_reqs=4, blocks_per_req=2, device="cpu")
    table = BlockTable(4, 2)
    table.add_row(0, [3])
    table.add_row(1, [1])
    views = []
    for computed, scheduled, tokens in (([0, 0], [3, 2], [11, 12, 13, 21, 22]), ([3, 2], [1, 1], [14, 23])):
        step = build_step_inputs(computed, scheduled, [[3], [1]], 4, num_padded_tokens=8, num_padded_reqs=3)
        input_ids, md, fed = buffers.fill(tokens, step, table.rows_for_step(3), 4, max_query_len=8, max_seq_len=8,
                                          fed_positions=[1], fed_rows=[0])  # fmt: skip
        assert [t.tolist() for t in fed] == [[1], [0]]
        expected = build_attention_metadata(computed, scheduled, [[3], [1]], 4, num_padded_tokens=8,
                                            num_padded_reqs=3, max_num_blocks=2)  # fmt: skip
        for name in ("positions", "query_start_loc", "seq_lens", "slot_mapping", "block_table", "logits_indices"):
            assert getattr(md, name).tolist() == getattr(expected, name).tolist(), name
        assert input_ids.tolist() == tokens + [PAD_TOKEN_ID] * (8 - len(tokens))
        assert md.slot_mapping.tolist()[len(tokens):] == [PAD_SLOT_ID] * (8 - len(tokens))
        views.append([t.data_ptr() for t in (input_ids, md.positions, md.slot_mapping, md.seq_lens, md.block_table)])
    assert views[0] == views[1], "a step of the same padded shape must reuse the same addresses"
    assert all(address % 16 == 0 for address in views[0]), "every field 16-byte aligned (input_buffers.py)"
    with pytest.raises(ValueError, match="2 token ids for a step of 5 tokens"):
        step = build_step_inputs([0, 0], [3, 2], [[3], [1]], 4)
        buffers.fill([1, 2], step, table.rows_for_step(2), 4, max_query_len=3, max_seq_len=3)
    with pytest.raises(ValueError, match="a step of 17 tokens and 1 requests does not fit input buffers of 16 tokens"):
        step = build_step_inputs([0], [17], [[3, 1, 2, 4, 5]], 4)
        buffers.fill([1] * 17, step, table.rows_for_step(1), 4, max_query_len=17, max_seq_len=17)
    with pytest.raises(ValueError, match=r"block table rows of shape \(1, 2\) for 2 requests"):
        step = build_step_inputs([0, 0], [3, 2], [[3], [1]], 4)
        buffers.fill([1] * 5, step, table.rows_for_step(1), 4, max_query_len=3, max_seq_len=3)
    assert views[0] == [t.data_ptr() for t in (input_ids, md.positions, md.slot_mapping, md.seq_lens, md.block_table)]


def test_input_layout_puts_fields_back_to_back_aligned_and_the_feed_last():
    from tinyvllm.worker.input_buffers import ALIGN, FIELDS, input_layout, layout_bytes

    for n, r, b, f in ((1, 1, 1, 0), (5, 3, 7, 2), (8, 8, 64, 8), (37, 5, 3, 5)):
        layout = input_layout(n, r, b, f)
        assert [name for name, _, _ in FIELDS] == list(layout)
        assert [layout[k][1] for k in layout] == [n, n, n, r, r + 1, r, r * b, f, f]
        end = 0
        for name, dtype, _ in FIELDS:
            offset, length = layout[name]
            assert offset % ALIGN == 0 and end <= offset < end + ALIGN, (name, offset, end)
            end = offset + dtype.itemsize * length
        assert layout_bytes(layout) == end
        without_feed = input_layout(n, r, b, 0)
        graph_inputs = [name for name, _, _ in FIELDS if not name.startswith("fed_")]
        assert [layout[k] for k in graph_inputs] == [without_feed[k] for k in graph_inputs]  # the feed moves nothing
