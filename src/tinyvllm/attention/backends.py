"""The attention backends: which KV writer pairs with which attention kernel, by name.

Concept: ``attention_backend="triton" | "torch" | "reference"`` names one
``AttentionBackend``, a frozen record of the functions a layer's ``attention_op`` calls
(``models/llama.py``): the KV writer, ``paged_attention``, the host work done once a step
(``plan_step``), whether the kernel also reads the step's own k and v rows, and what the
pair allows under CUDA graphs (seed 000, ``AttentionCGSupport``). Every backend keeps the
same cache layout, ``(2, num_blocks, block_size, Hkv, D)`` per layer (seed 003), so a KV
write done elsewhere (``qk_norm_rotary.py``'s fused one) fills any backend's cache.

Mirrors: ``vllm/attention/backends/registry.py`` (the names) and each backend's
``get_impl_cls`` / ``get_builder_cls`` / ``get_cudagraph_support`` in vLLM's
``vllm/v1/attention/backends/``, here one record a name.

Invariants: the records are frozen; the registry maps each name ``engine_args.py`` accepts
(but "auto", which it resolves) to one record.

Why: the reference and the batched torch backend write with a boolean mask and read lengths
on the host; the Triton pair does neither, so a whole forward over it can be captured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyvllm.attention import reference, torch_sdpa, triton_attention
from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.attention.kv_cache_write import write_kv_cache_torch, write_kv_cache_triton
from tinyvllm.attention.metadata import AttentionLayout, AttentionMetadata


# --8<-- [start:registry]
@dataclass(frozen=True)
class AttentionBackend:
    """The KV writer and the attention kernel one backend pairs, and its CUDA-graph support."""

    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    cudagraph_support: AttentionCGSupport
    # Host-side work done once per step, passed to every layer as ``plan=`` (llama.py NOTE 8); None: none needed.
    plan_step: Callable[[AttentionMetadata, AttentionLayout], object] | None = None
    step_rows: bool = False  # attention also takes the step's own k, v rows (triton_kernels.py NOTE 1)


ATTENTION_BACKENDS = {
    "reference": AttentionBackend(write_kv_cache_torch, reference.paged_attention, reference.CUDAGRAPH_SUPPORT),
    "torch": AttentionBackend(
        write_kv_cache_torch, torch_sdpa.paged_attention, torch_sdpa.CUDAGRAPH_SUPPORT, torch_sdpa.plan_from_metadata
    ),
    "triton": AttentionBackend(
        write_kv_cache_triton, triton_attention.paged_attention, triton_attention.CUDAGRAPH_SUPPORT,
        triton_attention.plan_from_metadata, step_rows=True,
    ),
}
# --8<-- [end:registry]
