"""IncrementalDetokenizer: token ids in, one step at a time; text deltas out, never half a character.

Concept: a streaming client wants the text of each new token as it comes, but a token of
a byte-level BPE vocabulary may hold only part of a UTF-8 character (an emoji is often
two or three tokens). Decoding such a token alone gives U+FFFD, the replacement
character. The detokenizer decodes a short window of recent ids and holds back a trailing
run of U+FFFD until the next token completes the character, or the request ends.

Mirrors: ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``), which keeps a
prefix and a read offset into the ids for the same reason.

Contract (``property_tests/test_detokenizer_props.py`` checks it for any id sequence):
- the deltas returned by ``update`` and ``finish``, joined, equal
  ``tokenizer.decode(all ids, skip_special_tokens=...)``;
- no delta holds a U+FFFD that the full decode does not hold at the same place: a delta
  is only ever text that the full decode has, in order.

Invariants: ``text`` is the concatenation of every delta returned so far; the window
``ids[window_start:]`` decodes to ``window_text`` + what is held back.

NOTE 1 (why a window works): decoding is additive across a clean boundary. Once the
window decodes to text that does not end in U+FFFD, every byte of it belongs to a
finished character, so ``decode(a + b) == decode(a) + decode(b)`` and the window can
restart after it. That holds for byte-level BPE decoders (Qwen, Llama 3, GPT-2 style)
with ``clean_up_tokenization_spaces`` off, which is what the models here use. The window
is then a few tokens long, so a step decodes a few tokens, not the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"


# --8<-- [start:detokenizer]
class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas (see the module contract)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # every delta returned so far, joined
        self.window_start = 0  # ids before it are decoded for good (NOTE 1)
        self.window_text = ""  # what the window's text has returned so far

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text, without a trailing half character."""
        self.ids.extend(new_token_ids)
        decoded = self._decode_window()
        stable = decoded.rstrip(REPLACEMENT_CHAR)
        delta = self._advance(stable)
        if len(stable) == len(decoded):  # a clean boundary: restart the window here (NOTE 1)
            self.window_start, self.window_text = len(self.ids), ""
        return delta

    def finish(self) -> str:
        """The request ended: return whatever was held back (a U+FFFD the full decode has)."""
        return self._advance(self._decode_window())

    def _decode_window(self) -> str:
        return self.tokenizer.decode(self.ids[self.window_start :], skip_special_tokens=self.skip_special_tokens)

    def _advance(self, window_text: str) -> str:
        if not window_text.startswith(self.window_text):
            raise RuntimeError(
                f"the tokenizer's decode is not additive (NOTE 1): {self.window_text!r} became {window_text!r}"
            )
        delta = window_text[len(self.window_text) :]
        self.window_text = window_text
        self.text += delta
        return delta
# --8<-- [end:detokenizer]
