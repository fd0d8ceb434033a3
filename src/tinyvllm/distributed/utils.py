"""How a model splits over ``tensor_parallel_size`` ranks: the rule and the index arithmetic.

Concept: Megatron's tensor parallelism gives each rank a contiguous slice of every split
dimension: attention heads, the MLP's intermediate size, the vocabulary. This module holds
the rule that decides whether a model splits over N ranks (``check_tensor_parallel_size``)
and the small pure functions that say which slice a rank holds, so that the layers, the
loader, the KV cache's sizing and the engine's argument check all use one answer. No torch.

Mirrors: ``vllm/distributed/utils.py`` (``divide``, ``ensure_divisibility``) and the head
arithmetic of ``vllm/model_executor/layers/linear.py`` (``QKVParallelLinear``).

Invariants: ``shard_range(size, n, r)`` over ``r = 0 .. n-1`` tiles ``[0, size)`` in order;
every rank holds ``num_heads // n`` query heads and ``kv_heads_per_rank`` KV heads.

NOTE 1 (KV heads fewer than ranks): with ``n > num_kv_heads`` each KV head is replicated on
``n // num_kv_heads`` consecutive ranks (rank ``r`` holds head ``r * num_kv_heads // n``),
as vLLM's ``QKVParallelLinear`` does; the query heads of a rank always read KV heads the
rank holds, because ``num_heads // n`` query heads share one KV head group.
NOTE 2 (the vocabulary): split in ``cdiv(vocab, n)`` rows per rank; the last rank's rows
past ``vocab`` are padding (zero embeddings, logits dropped after the gather), as vLLM's
``VocabParallelEmbedding`` pads.
"""

from __future__ import annotations

from tinyvllm.arith import cdiv


# --8<-- [start:check_tensor_parallel_size]
def check_tensor_parallel_size(tensor_parallel_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Refuse a size the model cannot be split over, in one line naming it (NOTE 1)."""
    n = tensor_parallel_size
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"tensor_parallel_size must be an int, got {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {n}")
    if num_heads % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's {num_heads} attention heads")
    if (num_kv_heads % n) if n <= num_kv_heads else (n % num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size {n} neither divides the model's {num_kv_heads} KV heads nor is a multiple of them"
        )
    if intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the model's intermediate_size {intermediate_size}")
# --8<-- [end:check_tensor_parallel_size]


# --8<-- [start:shard_range]
def shard_range(size: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s even slice of ``size`` (``size % num_ranks == 0``)."""
    if size % num_ranks:
        raise ValueError(f"{size} does not split evenly over {num_ranks} ranks")
    per = size // num_ranks
    return rank * per, (rank + 1) * per
# --8<-- [end:shard_range]


# --8<-- [start:kv_heads]
def kv_heads_per_rank(num_kv_heads: int, num_ranks: int) -> int:
    """KV heads each rank's cache holds: a slice, or one replicated head (NOTE 1)."""
    return max(1, num_kv_heads // num_ranks)


def kv_head_range(num_kv_heads: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads rank ``rank`` holds (NOTE 1)."""
    if num_ranks <= num_kv_heads:
        return shard_range(num_kv_heads, num_ranks, rank)
    head = rank * num_kv_heads // num_ranks
    return head, head + 1
# --8<-- [end:kv_heads]


# --8<-- [start:vocab_range]
def vocab_range(vocab_size: int, num_ranks: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the vocabulary rows rank ``rank`` holds; ``stop`` may pass
    ``vocab_size`` on the last rank (padding, NOTE 2)."""
    per = cdiv(vocab_size, num_ranks)
    return rank * per, (rank + 1) * per
# --8<-- [end:vocab_range]
