"""SamplingParams: how one request is to be continued, validated at construction.

Concept: the user-facing knobs of one request. This file owns their defaults and their
validation; nothing downstream re-checks them.

Mirrors: ``vllm/sampling_params.py`` (a much smaller subset).

For now the scheduler's fields only: ``max_tokens``, ``ignore_eos``, ``stop_token_ids``.
The sampling issue adds temperature, top-p/top-k, min-p, logit bias and the rest.

Invariants: an instance is frozen; ``stop_token_ids`` is a tuple of non-negative ints.
Bad values raise ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation limits.

    Attributes:
        max_tokens: the most output tokens to generate (>= 1).
        ignore_eos: keep generating past the end-of-sequence token.
        stop_token_ids: generation stops after any of these tokens is produced.
    """

    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        stop = tuple(self.stop_token_ids or ())
        for tok in stop:
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative ints, got {tok!r}")
        object.__setattr__(self, "stop_token_ids", stop)
