"""SamplingParams: how one request is to be continued, validated at construction.

Concept: the user-facing knobs of one request. This file owns their defaults and their
validation; nothing downstream re-checks them.

Mirrors: ``vllm/sampling_params.py`` (a much smaller subset).
Seed: 001 ch. 7.3 (``AddedRequest`` carries these params to every logits processor),
ch. 10 (``min_p``, ``logit_bias``, ``min_tokens``), ch. 13 (``thinking_token_budget``).

Fields: ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (0 = off), ``min_p`` (0 = off),
``logit_bias``, ``min_tokens``, ``max_tokens``, ``stop_token_ids``, ``ignore_eos``,
``seed``, ``thinking_token_budget`` (None = no limit), ``extra_args`` (free-form, for
custom logits processors).

Invariants: an instance is frozen; ``stop_token_ids`` is a tuple of non-negative ints;
``logit_bias`` and ``extra_args`` are private copies (mutating the caller's dict later
changes nothing). Bad values raise ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs and generation limits.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p, in (0, 1].
        top_k: keep the k most likely tokens; 0 turns it off.
        min_p: drop tokens whose probability is below ``min_p * max_prob``, in [0, 1].
        logit_bias: ``{token_id: bias}`` added to the logits before sampling.
        min_tokens: stop tokens are masked until this many tokens have been generated.
        max_tokens: the most output tokens to generate (>= 1).
        stop_token_ids: generation stops after any of these tokens is produced.
        ignore_eos: keep generating past the end-of-sequence token.
        seed: seeds this request's own random generator (same seed, same tokens).
        thinking_token_budget: the most tokens a think section may last (>= 0), None = no limit.
        extra_args: free-form arguments for custom logits processors.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    thinking_token_budget: int | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 turns it off), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if isinstance(self.stop_token_ids, (str, bytes)):
            raise ValueError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        stop = tuple(self.stop_token_ids or ())
        for tok in stop:
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative ints, got {tok!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise ValueError(f"thinking_token_budget must be an int >= 0 or None, got {budget!r}")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
            object.__setattr__(self, "extra_args", dict(self.extra_args))

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature == 0


def _checked_logit_bias(logit_bias: object) -> dict[int, float] | None:
    """Validate ``logit_bias`` and return a private copy (None when empty or absent)."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict {{token_id: bias}} or None, got {logit_bias!r}")
    for tok, bias in logit_bias.items():
        if not _is_int(tok) or tok < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {tok!r}")
        if not _is_real(bias):
            raise ValueError(f"logit_bias[{tok}] must be a finite number, got {bias!r}")
    return {tok: float(bias) for tok, bias in logit_bias.items()} or None
