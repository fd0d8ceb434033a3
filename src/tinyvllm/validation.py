"""Input checks shared by every entry point, with one rule for TypeError versus ValueError.

Concept: a value of the wrong type raises ``TypeError``; a value of the right type that
is out of range raises ``ValueError``; both messages name the parameter and show the
value (its ``repr``). Integer scalars from numpy or torch are accepted wherever an int is
(``operator.index`` converts them), so ``np.int64(3)`` is token id 3; a ``bool`` never is
(Python counts it as an int, but ``top_k=True`` is never meant as 1).

Who checks what (docs/generating_text_generate.md, section "Everything is checked before
anything runs"):
- ``SamplingParams.__post_init__`` and ``ReasoningConfig.__post_init__``: types and ranges
  that need no model (no vocabulary);
- ``EngineArgs.create_engine_config``: every engine argument, then what needs the model
  (the Triton kernel's tiling, whether the KV pool fits in memory); the input processor's
  start-up checks the reasoning ids against the vocabulary;
- the input processor (``engine/input_processor.py``): each prompt and its sampling params
  against the model (``engine/request_checks.py``), once, for ``LLM.generate`` (every
  request before the first is queued), ``AsyncLLM`` and ``LLMEngine.add_request``.

This module is the bottom layer: it imports nothing of tinyvllm (``SamplingParams`` builds on it).

Left out: vLLM's LoRA and multimodal checks (neither exists here); a structured-output
request is checked by the input processor (``engine/input_processor.py`` NOTE 6).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_BOUND_NAMES = {INT64_MIN: "-2**63", INT64_MAX: "2**63 - 1"}


def as_int(value: object) -> int | None:
    """``value`` as a Python int if it is an integer scalar (not a bool), else None."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):  # numpy, torch
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int (numpy/torch integer scalars converted) within ``[minimum, maximum]``."""
    number = as_int(value)
    if number is None:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        low, high = _BOUND_NAMES.get(minimum, minimum), _BOUND_NAMES.get(maximum, maximum)
        if maximum is None:
            wanted = f">= {low}"
        elif minimum is None:
            wanted = f"<= {high}"
        else:
            wanted = f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {wanted}, got {value!r}")
    return number


def check_optional_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int | None:
    """None, or what ``check_int`` accepts."""
    return None if value is None else check_int(name, value, minimum, maximum)


def check_real(name: str, value: object) -> float:
    """A finite real number (int or float, numpy's too; not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    """A bool: ``"no"``, 0 and 1 are refused (a non-empty string is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_token_ids(name: str, values: object, vocab_size: int | None = None) -> list[int]:
    """A sequence of token ids in ``[0, vocab_size)`` (``[0, inf)`` when the vocabulary is unknown).

    ``name`` starts every message: ``"prompt 1 has token id 512, outside the vocabulary [0, 512)"``.
    Lists, tuples, 1-D numpy arrays and torch tensors are accepted; a str is not a sequence of ids.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of token ids (ints), got {values!r} ({type(values).__name__})")
    ids = []
    for value in values:
        token = as_int(value)
        if token is None:
            raise TypeError(f"{name} must hold token ids (ints), got {value!r} ({type(value).__name__})")
        if token < 0:
            raise ValueError(f"{name} has token id {value!r}, but token ids are >= 0")
        if vocab_size is not None and token >= vocab_size:
            raise ValueError(f"{name} has token id {value!r}, outside the vocabulary [0, {vocab_size})")
        ids.append(token)
    return ids
