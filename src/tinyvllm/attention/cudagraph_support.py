"""How much CUDA-graph capture an attention backend allows: ``AttentionCGSupport``.

Concept: a full CUDA graph freezes the kernels and launch shapes of the whole forward,
attention included. Some attention backends compute any batch correctly that way, some
only batches whose requests all have one query length, some only single-token decodes,
some none. Each backend module declares one member as ``CUDAGRAPH_SUPPORT``; the runner
takes the least capable backend's value and lets ``resolve_cudagraph_mode`` downgrade the
configured mode to what it allows. Torch-free, so the dispatcher can use it.

Follows: seed 000, vLLM design doc "CUDA Graphs" (Chinese translation), section
"Attention 后端对 CUDA 图的兼容性" (the enum, ordered ALWAYS > UNIFORM_BATCH >
UNIFORM_SINGLE_TOKEN_DECODE > NEVER).
Mirrors: ``vllm/v1/attention/backends/utils.py`` (``AttentionCGSupport``).
Left out: cascade attention, which no CUDA graph supports (the dispatcher handles it).
"""

from __future__ import annotations

import enum


# --8<-- [start:support]
class AttentionCGSupport(enum.Enum):
    """CUDA-graph support of an attention backend; a larger value allows more."""

    ALWAYS = 3  # any batch, mixed prefill and decode included
    UNIFORM_BATCH = 2  # batches whose requests all share one query length (spec decode)
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # pure decode batches, one token per request
    NEVER = 0  # no full graphs at all
# --8<-- [end:support]
