"""The shapes ``LLM``'s calls take: prompts, one params object or one per prompt, conversations.

Concept: ``generate``, ``encode``, ``embed``, ``chat`` and ``beam_search`` take one item or a
list of them; these turn each argument into a list, or raise the TypeError or ValueError
that names it, before any prompt is checked against the model (``llm.py`` NOTE 1).

Mirrors: the argument handling of ``vllm/entrypoints/llm.py`` (``_validate_and_add_requests``'s
"the lengths of prompts and params must be the same").

Invariants: what comes back is a new list; nothing here reads the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def params_list(params: Any, kind: type, name: str, num_prompts: int) -> tuple[list[Any], str]:
    """One params object for every prompt, or a list of one each; and the label each is named
    by in messages (``sampling_params`` or ``sampling_params[{i}]``)."""
    if isinstance(params, kind):
        return [params] * num_prompts, name
    if not isinstance(params, Sequence) or isinstance(params, (str, bytes)):
        raise TypeError(f"{name} must be a {kind.__name__}, a list of them or None, got {params!r}")
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} {name.replace('_', ' ')} for {num_prompts} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, kind):
            raise TypeError(f"{name}[{i}] must be {kind.__name__}, got {p!r}")
    return list(params), name + "[{i}]"


def prompt_list(prompts: Any) -> list[Any]:
    """``generate``'s and ``beam_search``'s ``prompts`` as a list: one prompt (a str or a
    dict) or an iterable of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a str, a prompt dict or a list of them, got {prompts!r}")
    return list(prompts)


def conversations(messages: Any) -> list[Any]:
    """``LLM.chat``'s ``messages`` as a list of conversations: one list of message dicts, or
    a list of such lists (an empty list is one empty conversation, refused by the caller)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of message dicts, or a list of such lists, got {messages!r}")
    if messages and all(isinstance(m, Sequence) and not isinstance(m, (str, bytes)) for m in messages):
        return list(messages)
    return [messages]
