"""Sharded layers: the linear maps and the embedding of a model split over the tensor-parallel ranks.

Concept: Megatron's split. A ``ColumnParallelLinear`` holds a slice of the output rows of its
weight, so each rank computes its slice of the output from the whole input; a
``RowParallelLinear`` holds the matching slice of the input columns, computes a partial sum
of the whole output and all-reduces it. Column then row (q/k/v then o_proj, gate/up then
down) needs one all-reduce per pair and nothing between: the attention heads and the MLP's
intermediate features stay on their rank. The vocabulary splits by rows: the embedding looks
up the rank's ids and all-reduces, the LM head computes the rank's logits and all-gathers
them. Each layer's ``weight_loader`` copies its rank's slice out of a checkpoint tensor.

Mirrors: ``vllm/model_executor/layers/linear.py`` (``ColumnParallelLinear``,
``MergedColumnParallelLinear``, ``QKVParallelLinear``, ``RowParallelLinear``) and
``vllm/model_executor/layers/vocab_parallel_embedding.py`` (``VocabParallelEmbedding``,
``ParallelLMHead``), without quantisation, LoRA or ``gather_output``.

Invariants: with one rank every layer computes what ``nn.Linear`` / ``nn.Embedding`` compute,
with the same ops on the same shapes (bit-identical); the weights are built empty (no random
init) and filled only by ``weight_loader``; padding rows of the vocabulary are zero.

NOTE 1 (what a weight loader reads): ``loaded_weight`` is anything indexable as
``w[a:b]`` / ``w[:, a:b]`` / ``w[:]``: a tensor, or a safetensors slice, whose indexing reads
only those rows or columns from the file (``loader.py`` NOTE 6), so a rank never holds a
whole split tensor. ``shard_id`` names the checkpoint tensor of a fused layer ("q", "k",
"v"; 0 for gate, 1 for up), as vLLM's ``loaded_shard_id``.
NOTE 2 (fused layers per rank): a rank's fused weight stacks its slice of each part: its q
heads, then its k heads, then its v heads; its slice of gate, then of up. So
``split([q, kv, kv])`` and ``split(I / N)`` on the output still find the parts.
NOTE 3 (the bias of a row-parallel layer): every rank's partial sum would carry it, so it is
added once, after the all-reduce (none of our models has one; the one-rank path keeps
``F.linear``'s fused bias so N = 1 stays bit-identical).
NOTE 4 (rank and size): taken from ``distributed/parallel_state.py`` when the layer is built,
as vLLM's; a test may pass ``tp_size`` / ``tp_rank`` to build one rank's layer in one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from tinyvllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tinyvllm.distributed.utils import kv_head_range, kv_heads_per_rank, shard_range, vocab_range

LoadedWeight = Any  # a torch.Tensor, or a safetensors slice (``loader.CheckpointSlice``): NOTE 1


def _tp(tp_size: int | None, tp_rank: int | None) -> tuple[int, int]:
    """This layer's (size, rank): the process's group unless given (NOTE 4)."""
    size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    if not 0 <= rank < size:
        raise ValueError(f"tp_rank {rank} is not in [0, tp_size {size})")
    return size, rank


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))  # filled by the weight loader, never initialised


def read_rows(loaded_weight: LoadedWeight, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a checkpoint tensor, reading only them (NOTE 1)."""
    return loaded_weight[start:stop]


def read_columns(loaded_weight: LoadedWeight, start: int, stop: int) -> torch.Tensor:
    """Columns ``[start, stop)`` of a 2-D checkpoint tensor, reading only them (NOTE 1)."""
    return loaded_weight[:, start:stop]


@torch.no_grad()
def default_weight_loader(param: torch.Tensor, loaded_weight: LoadedWeight, shard_id: object = None) -> None:
    """A replicated parameter (norms): every rank reads the whole tensor."""
    param.copy_(loaded_weight[:])


# --8<-- [start:column_parallel]
class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with this rank's slice of W's output rows: ``[N, in] -> [N, out / tp]``."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, *, tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.tp_size, self.tp_rank = _tp(tp_size, tp_rank)
        self.input_size, self.output_size = input_size, output_size
        start, stop = shard_range(output_size, self.tp_size, self.tp_rank)
        self.output_size_per_partition = stop - start
        self.weight = _empty(self.output_size_per_partition, input_size)  # [out / tp, in]
        self.bias = _empty(self.output_size_per_partition) if bias else None  # [out / tp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out / tp]
        return F.linear(x, self.weight, self.bias)  # nothing to reduce: each output is whole

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded_weight: LoadedWeight, shard_id: object = None) -> None:
        """The rank's rows of the checkpoint's ``[out, in]`` weight (or ``[out]`` bias)."""
        start, stop = shard_range(self.output_size, self.tp_size, self.tp_rank)
        param.copy_(read_rows(loaded_weight, start, stop))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel maps in one matmul (gate and up): the rank's slice of each,
    stacked (NOTE 2). ``output_sizes`` are the checkpoint tensors' rows."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, *, tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(input_size, sum(output_sizes), bias, tp_size=tp_size, tp_rank=tp_rank)
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            shard_range(size, self.tp_size, self.tp_rank)  # each part must split evenly

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded_weight: LoadedWeight, shard_id: object = None) -> None:
        """Part ``shard_id`` (0 gate, 1 up): its rank's rows, at that part's offset (NOTE 2)."""
        start, stop = shard_range(self.output_sizes[shard_id], self.tp_size, self.tp_rank)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.narrow(0, offset, stop - start).copy_(read_rows(loaded_weight, start, stop))
# --8<-- [end:column_parallel]


# --8<-- [start:qkv_parallel]
class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul: the rank's ``H / tp`` query heads, then its KV heads, then
    the same KV heads' values (NOTE 2); KV heads are replicated when ``tp > Hkv``
    (``distributed/utils.py`` NOTE 1). ``[N, hidden] -> [N, (H/tp + 2 Hkv/tp) * D]``."""

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
        bias: bool = False, *, tp_size: int | None = None, tp_rank: int | None = None,
    ) -> None:  # fmt: skip
        nn.Module.__init__(self)  # the weight's rows are counted in heads, not split evenly
        self.tp_size, self.tp_rank = _tp(tp_size, tp_rank)
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_num_heads, total_num_kv_heads
        first, last = shard_range(total_num_heads, self.tp_size, self.tp_rank)
        self.num_heads = last - first  # this rank's query heads
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, self.tp_size)  # this rank's KV heads
        self.input_size = hidden_size
        self.output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size  # the checkpoint's rows
        self.output_size_per_partition = (self.num_heads + 2 * self.num_kv_heads) * head_size
        self.weight = _empty(self.output_size_per_partition, hidden_size)  # [(H/tp + 2 Hkv/tp) * D, hidden]
        self.bias = _empty(self.output_size_per_partition) if bias else None

    def shard_rows(self, shard_id: str) -> tuple[int, int, int]:
        """``(start, stop, offset)``: the checkpoint rows of part ``shard_id`` this rank reads and
        where they go in its fused weight (NOTE 2)."""
        d, q_rows, kv_rows = self.head_size, self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            return self.tp_rank * q_rows, (self.tp_rank + 1) * q_rows, 0
        first, last = kv_head_range(self.total_num_kv_heads, self.tp_size, self.tp_rank)
        offset = {"k": q_rows, "v": q_rows + kv_rows}[shard_id]
        return first * d, last * d, offset

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded_weight: LoadedWeight, shard_id: object = None) -> None:
        """Part ``shard_id`` ("q", "k" or "v"): the rank's heads of it (weight or bias)."""
        start, stop, offset = self.shard_rows(shard_id)
        param.narrow(0, offset, stop - start).copy_(read_rows(loaded_weight, start, stop))
# --8<-- [end:qkv_parallel]


# --8<-- [start:row_parallel]
class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with this rank's slice of W's input columns: ``[N, in / tp]`` (the
    column-parallel layer's output, as it is) ``-> [N, out]``, summed over the ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, *, tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.tp_size, self.tp_rank = _tp(tp_size, tp_rank)
        self.input_size, self.output_size = input_size, output_size
        start, stop = shard_range(input_size, self.tp_size, self.tp_rank)
        self.input_size_per_partition = stop - start
        self.weight = _empty(output_size, self.input_size_per_partition)  # [out, in / tp]
        self.bias = _empty(output_size) if bias else None  # [out], whole on every rank (NOTE 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in / tp] -> [N, out]
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        partial = F.linear(x, self.weight)  # [N, out]: this rank's part of the sum
        out = tensor_model_parallel_all_reduce(partial)
        return out if self.bias is None else out + self.bias  # NOTE 3

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded_weight: LoadedWeight, shard_id: object = None) -> None:
        """The rank's columns of the checkpoint's ``[out, in]`` weight; the bias whole."""
        if param.dim() == 1:
            param.copy_(loaded_weight[:])
            return
        start, stop = shard_range(self.input_size, self.tp_size, self.tp_rank)
        param.copy_(read_columns(loaded_weight, start, stop))
# --8<-- [end:row_parallel]


# --8<-- [start:vocab_parallel_embedding]
class VocabParallelEmbedding(nn.Module):
    """The embedding with this rank's ``vocab_range`` rows (``distributed/utils.py`` NOTE 2):
    ids of other ranks give zero rows here, and the all-reduce adds the one rank's real row."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp_size: int | None = None, tp_rank: int | None = None
    ) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = _tp(tp_size, tp_rank)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, self.tp_size, self.tp_rank)
        rows = self.vocab_end_index - self.vocab_start_index  # cdiv(V, tp), padding included
        self.weight = _empty(rows, embedding_dim)  # [V / tp, hidden]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)  # [N] bool
        local = (input_ids - self.vocab_start_index) * mine  # other ranks' ids look up row 0 ...
        out = F.embedding(local, self.weight).masked_fill_(~mine[:, None], 0)  # ... and are zeroed
        return tensor_model_parallel_all_reduce(out)

    @torch.no_grad()
    def weight_loader(self, param: torch.Tensor, loaded_weight: LoadedWeight, shard_id: object = None) -> None:
        """The rank's rows of the checkpoint's ``[V, hidden]``; padding rows past ``V`` zero."""
        start = self.vocab_start_index
        real = max(0, min(self.vocab_end_index, self.num_embeddings) - start)
        if real:
            param[:real].copy_(read_rows(loaded_weight, start, start + real))
        param[real:].zero_()
# --8<-- [end:vocab_parallel_embedding]


# --8<-- [start:parallel_lm_head]
class ParallelLMHead(VocabParallelEmbedding):
    """The LM head over this rank's vocabulary rows: ``forward`` gives the rank's logits,
    ``gather`` joins every rank's into the whole ``[R, V]`` on every rank, padding dropped."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, V / tp]
        return F.linear(hidden, self.weight)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:  # [R, V / tp] -> [R, V]
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.num_embeddings]
# --8<-- [end:parallel_lm_head]
