"""Integer arithmetic every layer shares: ceiling division.

Concept: how many blocks hold n tokens, how many tiles cover n rows: ``cdiv``. It lives
here, below every package, so that the attention kernels and the worker need not import
the KV-cache core to divide (vLLM keeps it in ``vllm/utils/math_utils.py``).
"""


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)
