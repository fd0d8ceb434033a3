"""``distributed/utils.py``: the rule that decides whether a model splits over N ranks, and
the slices each rank holds (pure functions; the layers, loader and KV sizing use them)."""

from __future__ import annotations

import pytest

from tinyvllm.distributed.utils import (
    check_tensor_parallel_size,
    kv_head_range,
    kv_heads_per_rank,
    shard_range,
    vocab_range,
)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_qwen3_0_6b_heads_split_or_replicate(n):
    check_tensor_parallel_size(n, num_heads=16, num_kv_heads=8, intermediate_size=3072)
    ranges = [kv_head_range(8, n, r) for r in range(n)]
    assert all(stop - start == kv_heads_per_rank(8, n) for start, stop in ranges)
    if n <= 8:  # a slice each, tiling the heads in order
        assert [h for start, stop in ranges for h in range(start, stop)] == list(range(8))
    else:  # each head replicated on n // 8 consecutive ranks
        assert [start for start, _ in ranges] == [r * 8 // n for r in range(n)]
        assert all(ranges.count(ranges[r]) == n // 8 for r in range(n))


@pytest.mark.parametrize(
    "n, heads, kv, inter, message",
    [
        (0, 16, 8, 64, "tensor_parallel_size must be an int >= 1, got 0"),
        (-2, 16, 8, 64, "tensor_parallel_size must be an int >= 1, got -2"),
        (3, 16, 8, 64, "tensor_parallel_size 3 does not divide the model's 16 attention heads"),
        (4, 12, 6, 64, "tensor_parallel_size 4 neither divides the model's 6 KV heads nor is a multiple of them"),
        (4, 16, 8, 66, "tensor_parallel_size 4 does not divide the model's intermediate_size 66"),
    ],
)
def test_sizes_the_model_cannot_split_over_are_refused_by_name(n, heads, kv, inter, message):
    with pytest.raises(ValueError) as e:
        check_tensor_parallel_size(n, heads, kv, inter)
    assert str(e.value) == message


@pytest.mark.parametrize("bad", ["2", 2.0, True, None])
def test_a_size_that_is_not_an_int_is_a_type_error(bad):
    with pytest.raises(TypeError, match="tensor_parallel_size must be an int"):
        check_tensor_parallel_size(bad, 16, 8, 64)


def test_shards_tile_the_dimension_and_the_vocab_pads_the_last_rank():
    assert [shard_range(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="10 does not split evenly over 4 ranks"):
        shard_range(10, 4, 0)
    assert [vocab_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]  # 12 > 10: padding


def test_a_gloo_group_on_cuda_runs_eager_since_its_all_reduce_cannot_be_captured(monkeypatch, tiny_model_dirs):
    """``cudagraph_capture.py`` NOTE 3: with two ranks over gloo on CUDA (two ranks sharing one
    GPU) every mode resolves to NONE before any CUDA call; NCCL's all-reduce, one rank, and
    the CPU's emulated graphs keep the mode."""
    import torch

    from tinyvllm.config import CompilationConfig
    from tinyvllm.distributed import parallel_state
    from tinyvllm.models.llama import load_model
    from tinyvllm.worker.cudagraph_capture import init_cudagraphs
    from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode

    gloo, nccl = parallel_state.GroupCoordinator(2, 0, "gloo"), parallel_state.GroupCoordinator(2, 0, "nccl")
    assert not gloo.collectives_capturable("cuda") and gloo.collectives_capturable("cpu")
    assert nccl.collectives_capturable("cuda") and parallel_state.GroupCoordinator().collectives_capturable("cuda")
    model = load_model(tiny_model_dirs["qwen3"], attention_backend="triton")
    config = CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    sizes = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, uniform_decode_query_len=1)
    monkeypatch.setattr(parallel_state, "_TP", gloo)
    setup = init_cudagraphs(model, torch.device("cuda"), config, **sizes)  # no CUDA call: NONE has no pool
    assert setup.mode == CUDAGraphMode.NONE and setup.full_graph is None
    assert init_cudagraphs(model, torch.device("cpu"), config, **sizes).mode == CUDAGraphMode.FULL_AND_PIECEWISE
