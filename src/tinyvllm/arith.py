"""Integer arithmetic every layer shares: ceiling division, and the rows of a verification step.

Concept: how many blocks hold n tokens, how many tiles cover n rows: ``cdiv``. It lives
here, below every package, so that the attention kernels and the worker need not import
the KV-cache core to divide (vLLM keeps it in ``vllm/utils/math_utils.py``). In a
speculative step request r owns ``len(drafts[r]) + 1`` rows of logits, back to back;
``spec_row_starts`` says where each request's rows begin (vLLM's ``cu_num_draft_tokens``
plus one row each), for the rejection sampler, ``SamplingMetadata.expand``, the penalties and the runner.
"""

from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def spec_row_starts(drafts: Sequence[Sequence[int]]) -> list[int]:
    """Where request r's rows begin when it owns ``len(drafts[r]) + 1``; one more entry at
    the end, the total (``[2, 0, 1]`` drafts -> ``[0, 3, 4, 6]``)."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    return starts
