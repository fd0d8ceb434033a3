"""Logprobs in OpenAI's two shapes, and prompt logprobs in vLLM's, from ``outputs.py``'s values.

Concept: the engine reports, per token, a ``PositionLogprobs`` (``{token_id: Logprob}``:
the chosen token and the k most likely, each with its logprob, rank and text). The two
OpenAI APIs show them differently:

- completions (legacy): four parallel lists, ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``; each ``top_logprobs`` entry is a ``{text: logprob}``
  dict of the k most likely tokens plus the chosen one (so up to k + 1 entries), and
  ``text_offset`` is where each token's text starts in the choice's text;
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}``, the k most likely tokens in order.

Mirrors: ``vllm/entrypoints/openai/serving_completion.py`` (``_create_completion_logprobs``)
and ``serving_chat.py`` (``_create_chat_logprobs``); ``protocol.py``'s
``CompletionLogProbs`` and ``ChatCompletionLogProbs``.

Invariants: pure functions of their arguments (no tokenizer, no server): every test of
the shapes builds ``Logprob`` values by hand. A logprob of ``-inf`` is written as
``-9999.0``, as OpenAI and vLLM do (JSON has no infinity). A position of ``None`` (the
prompt's first token, which nothing predicts) has a ``None`` logprob and top list.

NOTE 1 (a token's text): the engine fills ``Logprob.decoded_token``; ``decode`` is asked
only for a token without one. With ``return_tokens_as_token_ids`` every token is written
``"token_id:<id>"`` (vLLM's option for tokens whose text is not valid on its own, such as
half of a UTF-8 character).
NOTE 2 (the k most likely): the entries are ordered by rank (1 = the most likely). vLLM's
chat keeps the first k entries of its dict, whose first entry is the chosen token; here
chat's ``top_logprobs`` are the k best by rank, OpenAI's meaning, whatever was chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tinyvllm.outputs import Logprob, PositionLogprobs

LOGPROB_FLOOR = -9999.0  # what -inf is written as
Decode = Callable[[int], str]


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_text(token_id: int, logprob: Logprob | None, decode: Decode, as_token_id: bool) -> str:
    """A token as the response writes it (NOTE 1)."""
    if as_token_id:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode(token_id)


def most_likely(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` entries of ``position`` with the best rank (NOTE 2)."""
    ranked = sorted(position.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0, -item[1].logprob))
    return ranked[:k]


# --8<-- [start:completion_logprobs]
def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    k: int,
    decode: Decode,
    as_token_id: bool = False,
    text_offset: int = 0,
) -> dict:
    """The completions shape for these tokens; ``text_offset`` is where the first one's text
    starts (the length of the choice's text so far, when streaming)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = None if position is None else position.get(token_id)
        text = token_text(token_id, chosen, decode, as_token_id)
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            entries = most_likely(position, k)
            if chosen is not None and all(t != token_id for t, _ in entries):
                entries.append((token_id, chosen))  # the chosen token is always there (k + 1 entries)
            token_logprobs.append(clamp(chosen.logprob) if chosen is not None else None)
            top_logprobs.append({token_text(t, lp, decode, as_token_id): clamp(lp.logprob) for t, lp in entries})
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
# --8<-- [end:completion_logprobs]


# --8<-- [start:chat_logprobs]
def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int, decode: Decode, as_token_id: bool = False
) -> dict:
    """The chat shape for these tokens: one ``content`` entry per token, with its k most likely."""

    def entry(token_id: int, logprob: Logprob | None) -> dict:
        text = token_text(token_id, logprob, decode, as_token_id)
        value = LOGPROB_FLOOR if logprob is None else clamp(logprob.logprob)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", errors="replace"))}

    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        item = entry(token_id, position.get(token_id))
        item["top_logprobs"] = [entry(t, lp) for t, lp in most_likely(position, k)]
        content.append(item)
    return {"content": content}
# --8<-- [end:chat_logprobs]


def prompt_logprobs_json(prompt_logprobs: Sequence[PositionLogprobs | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or ``{token id: {"logprob",
    "rank", "decoded_token"}}`` (JSON object keys are strings)."""
    return [
        None if position is None else {
            str(token_id): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
        }
        for position in prompt_logprobs
    ]  # fmt: skip
