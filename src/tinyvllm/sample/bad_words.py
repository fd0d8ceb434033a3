# --8<-- [start:header]
"""Bad words: token sequences a request must never generate.

Concept: each bad word becomes one or two token sequences when the request arrives
(``tokenize_bad_words``, NOTE 1). At every step, a sequence bans its LAST token (logit
-inf) when the output so far ends with all its other tokens; so a one-token sequence is
banned always, and a longer one only where it would be completed (``banned_tokens``).
The ban is checked against the request's output only, never its prompt (NOTE 2).

Mirrors: vllm/v1/sample/ops/bad_words.py (``apply_bad_words``) for the ban, and
``SamplingParams.update_from_tokenizer`` in vllm/sampling_params.py for the tokenization.

NOTE 1 (two tokenizations per word): a BPE tokenizer spells a word differently at the
start of a text and after a space (``"cat"`` against ``" cat"``). As vLLM does, the word's
leading whitespace is stripped, and the word is encoded without special tokens twice:
as it is, and with one space in front. The spaced form is kept only when its first token
differs from the plain form's and both have the same length, that is when the space was
merged into a new first token rather than added as a token of its own or absorbed by the
tokenizer. The engine does this once per request, in its input processor
(``engine/input_processor.py``), where the tokenizer is; the token ids then travel with the request to the persistent batch.
NOTE 2 (the prompt does not count): with the word ``(a, b)`` and a prompt that ends in
``a``, the first output may be ``b``; vLLM compares with the output tokens only, and so
do we.
NOTE 3 (speculative decoding): a request verifying k drafts owns k + 1 rows, and row j
predicts the token after drafts ``0 .. j - 1``; so row j bans what the output would ban if
those drafts had been generated. ``SamplingMetadata.expand`` gives row j that output (the
outputs, then the drafts before it) and the request's bad words, and the same
``apply_bad_words`` bans (vLLM's ``apply_bad_words_with_drafts`` does it in a second
function). A draft the ban hits is then rejected, as it must be.
Left out: vLLM's special case for Mistral tokenizers.
"""
# --8<-- [end:header]

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tinyvllm.device_syncs import fill_at, upload

BadWordsTokenIds = tuple[tuple[int, ...], ...]  # the token sequences of one request's bad words


# --8<-- [start:tokenize]
def tokenize_bad_words(tokenizer: Any, words: Sequence[str]) -> BadWordsTokenIds:
    """Each word as a token sequence, plus its spaced form where that is new (NOTE 1).

    ``tokenizer`` needs ``encode(text, add_special_tokens=False) -> list[int]``. Raises
    ``ValueError`` for a word that is only whitespace (it has no tokens to ban).
    """
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words has {word!r}, which is only whitespace: it has no tokens to ban")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    return tuple(sequences)
# --8<-- [end:tokenize]


# --8<-- [start:ban]
def banned_tokens(bad_words: BadWordsTokenIds, output: Sequence[int]) -> list[int]:
    """The tokens one row may not sample next: each sequence's last token, when the
    output ends with the tokens before it (NOTE 2)."""
    banned = []
    for seq in bad_words:
        prefix = seq[:-1]
        if len(prefix) <= len(output) and tuple(output[len(output) - len(prefix) :]) == prefix:
            banned.append(seq[-1])
    return banned


def apply_bad_words(
    logits: torch.Tensor, bad_words: Mapping[int, BadWordsTokenIds], output_token_ids: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Set the banned tokens of every row in ``bad_words`` to -inf, in place.

    ``logits`` ``[R, V]``; ``bad_words`` row -> its sequences; ``output_token_ids`` every
    row's output so far (a draft row's ends with the drafts before it, NOTE 3). One indexed
    write for the whole batch.
    """
    bans = [(row, banned_tokens(sequences, output_token_ids[row])) for row, sequences in bad_words.items()]
    return _ban(logits, bans)
# --8<-- [end:ban]


def _ban(logits: torch.Tensor, bans: list[tuple[int, list[int]]]) -> torch.Tensor:
    """Set ``logits[row, token]`` to -inf for each row's banned tokens: one indexed write."""
    rows = [row for row, banned in bans for _ in banned]
    tokens = [token for _, banned in bans for token in banned]
    if tokens:
        at, banned = upload([rows, tokens], torch.int64, logits.device)  # [B], [B]: no wait (device_syncs)
        fill_at(logits, (at, banned), float("-inf"))  # not logits[at, banned] = -inf: a wait
    return logits
