"""KV cache memory: how many blocks fit, and the per-layer tensors that hold them.

Concept: the block ids the scheduler hands out become memory here. Every decoder layer
gets one tensor shaped ``(2, num_blocks, block_size, Hkv, D)`` (keys, then values), and
block ``b`` of every layer holds the same tokens. On a GPU the number of blocks is what is
left of ``gpu_memory_utilization`` of the device after the weights and a profiling forward
at the worst-case batch; ``num_gpu_blocks_override`` fixes it (tests, the CPU).

Follows: seed 003 "KV cache物理内存分配" (``determine_available_memory``,
``get_kv_cache_config``: ``num_blocks = available // page_size``, one tensor per layer of
shape ``(2, num_blocks, block_size, num_kv_heads, head_size)``).
Mirrors: ``vllm/v1/worker/gpu_worker.py`` (``determine_available_memory``),
``vllm/v1/core/kv_cache_utils.py`` (``get_kv_cache_config``),
``vllm/v1/worker/gpu_model_runner.py`` (``initialize_kv_cache``).

Invariants: every layer's tensor has the same shape; the pool holds at least one request
of ``max_model_len`` tokens, or start-up fails saying how many blocks are needed.

NOTE 1 (never more than can be used): the pool is capped at ``max_num_seqs`` requests of
``max_model_len`` tokens; beyond that blocks could never all be in use at once.
NOTE 2 (the CPU): with no override, the CPU gets a fixed byte budget (``CPU_KV_CACHE_BYTES``)
rather than a share of the machine's memory.
NOTE 3 (does it fit?): whatever decided the number of blocks (an override, the CPU budget,
the GPU profile), ``check_kv_cache_fits`` compares the pool's bytes with the memory the
device has free before anything is allocated, so ``num_gpu_blocks_override=10**9`` is a
ValueError saying how much was asked for, not an allocator failure (or, on Linux, the
out-of-memory killer). Free memory on the CPU is Linux's ``MemAvailable`` (free pages plus
the page cache that can be dropped), else ``os.sysconf``'s free pages, else unknown (not
checked); a container's memory limit is not seen. On a GPU it is ``torch.cuda.mem_get_info``.
"""

from __future__ import annotations

import os

import torch

from tinyvllm.arith import cdiv

CPU_KV_CACHE_BYTES = 1 << 30  # NOTE 2


# --8<-- [start:sizing]
def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


def num_blocks_from_budget(
    budget_bytes: int, per_block: int, block_size: int, max_model_len: int, max_num_seqs: int
) -> int:
    """Blocks that fit in ``budget_bytes``, capped at what can ever be in use (NOTE 1)."""
    cap = max_num_seqs * cdiv(max_model_len, block_size)
    return max(0, min(budget_bytes // per_block, cap))


def check_fits_one_request(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Fail at start-up if one ``max_model_len`` request cannot fit in the pool."""
    needed = cdiv(max_model_len, block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens, but one request of "
            f"max_model_len={max_model_len} tokens needs {needed}: raise gpu_memory_utilization or "
            f"num_gpu_blocks_override, or lower max_model_len"
        )


def check_kv_cache_fits(num_blocks: int, per_block: int, available_bytes: int | None) -> None:
    """Fail at start-up if ``num_blocks`` blocks need more than ``available_bytes`` (NOTE 3).

    ``available_bytes`` None means the free memory is unknown: nothing is checked.
    """
    needed = num_blocks * per_block
    if available_bytes is not None and needed > available_bytes:
        raise ValueError(
            f"the KV cache of {num_blocks} blocks needs {_readable(needed)} ({per_block} bytes a block), but only "
            f"{_readable(available_bytes)} of memory is available: lower num_gpu_blocks_override (or max_num_seqs, "
            "max_model_len)"
        )
# --8<-- [end:sizing]


def _readable(num_bytes: int) -> str:
    """``1907.3 GiB``, ``12.0 MiB``: bytes for a person to read."""
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def available_memory_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` right now (NOTE 3); None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _available_cpu_bytes()


def _available_cpu_bytes() -> int | None:
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return max(0, available)


# --8<-- [start:allocate]
def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed tensor per layer, ``(2, B, S, Hkv, D)``: ``[0]`` keys, ``[1]`` values."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
# --8<-- [end:allocate]


# --8<-- [start:gpu_budget]
def available_gpu_kv_bytes(gpu_memory_utilization: float, device: torch.device) -> int:
    """Bytes left for the KV cache after the weights and the profiling forward ran.

    Call it after the profile's memory was handed back (``torch.cuda.empty_cache``):
    ``used = total - free`` then counts what stays on the device (weights, this process's
    other tensors, other processes), and the profiling peak above the current allocation
    is added once, since that activation memory is needed again at every step.
    """
    free, total = torch.cuda.mem_get_info(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return int(total * gpu_memory_utilization) - (total - free) - activation_peak
# --8<-- [end:gpu_budget]
