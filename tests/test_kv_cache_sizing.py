"""KV cache sizing (seed 003 "KV cache物理内存分配"): bytes per block, blocks per budget,
the start-up check, and the per-layer tensors."""

import pytest
import torch

from tinyvllm.worker import kv_cache
from tinyvllm.worker.kv_cache import (
    allocate_kv_caches,
    available_memory_bytes,
    bytes_per_block,
    check_fits_one_request,
    check_kv_cache_fits,
    num_blocks_from_budget,
)


@pytest.mark.seed("003:memory")
def test_kv_cache_bytes_per_block_matches_seed003_example():
    # Seed 003: block 16, 2 KV heads, head size 128, fp16 -> 16*2*128*2 bytes for K, as much for V.
    assert bytes_per_block(1, 16, 2, 128, torch.float16) == 2 * 16 * 2 * 128 * 2
    assert bytes_per_block(28, 16, 8, 128, torch.bfloat16) == 1835008  # Qwen3-0.6B
    assert bytes_per_block(2, 16, 2, 16, torch.float32) == 8192  # the tiny test models


@pytest.mark.seed("003:memory")
def test_kv_cache_blocks_from_budget_are_capped_by_what_can_be_used():
    per_block = 8192
    assert num_blocks_from_budget(10 * per_block + 5, per_block, 16, 1024, 256) == 10
    assert num_blocks_from_budget(1 << 40, per_block, 16, 64, 3) == 3 * 4  # 3 requests of 4 blocks
    assert num_blocks_from_budget(-5, per_block, 16, 64, 3) == 0


def test_kv_cache_start_up_check_names_the_numbers():
    check_fits_one_request(4, 16, 64)
    with pytest.raises(ValueError, match="holds 3 blocks of 16 tokens, but one request of max_model_len=64 tokens needs 4"):
        check_fits_one_request(3, 16, 64)


def test_kv_cache_memory_check_says_how_much_was_asked_for_and_how_much_there_is():
    check_kv_cache_fits(10, 100, 1000)  # exactly fits
    check_kv_cache_fits(10**9, 2048, None)  # free memory unknown: not checked
    with pytest.raises(ValueError, match=r"10 blocks needs 1000.0 MiB .* only 999.0 MiB of memory is available"):
        check_kv_cache_fits(10, 100 * 2**20, 999 * 2**20)
    with pytest.raises(ValueError, match=r"1000000000 blocks needs 1907.3 GiB \(2048 bytes a block\), but only 2.0 GiB"):
        check_kv_cache_fits(10**9, 2048, 2 * 2**30)


def test_kv_cache_available_cpu_memory_is_read_from_the_machine(monkeypatch):
    available = available_memory_bytes(torch.device("cpu"))
    assert available is not None and 0 < available
    monkeypatch.setattr(kv_cache, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("no /proc")), raising=False)
    fallback = available_memory_bytes(torch.device("cpu"))  # os.sysconf's free pages
    assert fallback is not None and 0 < fallback


@pytest.mark.seed("003:memory")
def test_kv_cache_one_tensor_per_layer_in_seed003_shape():
    caches = allocate_kv_caches(3, 5, 4, 2, 8, torch.float16, "cpu")
    assert len(caches) == 3 and len({c.data_ptr() for c in caches}) == 3
    assert all(c.shape == (2, 5, 4, 2, 8) and c.dtype == torch.float16 and not c.any() for c in caches)
