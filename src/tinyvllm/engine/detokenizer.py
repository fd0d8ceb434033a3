"""IncrementalDetokenizer: token ids in, one step at a time; text deltas out, never half a character.

Concept: a streaming client wants the text of each new token as it comes. Decoding each
token alone is wrong in two ways. A token may hold only part of a UTF-8 character (an
emoji is often two to four byte tokens), which decodes to U+FFFD, the replacement
character. And decoding is not additive: SentencePiece decoders strip the leading space
of the *first* token they are given, so ``decode(a) + decode(b)`` loses the space that
``decode(a + b)`` keeps. The detokenizer therefore decodes the new tokens together with a
few tokens of context before them and returns the difference, and it holds back the text
of tokens that a later token may still change.

Mirrors: ``vllm/v1/engine/detokenizer.py`` (``SlowIncrementalDetokenizer`` and
``detokenize_incrementally``'s prefix and read offsets; the fast path uses the
``tokenizers`` library's ``DecodeStream``, which keeps the same two offsets).

Contract (``property_tests/test_detokenizer_props.py`` checks it for any id sequence, fed
in any chunks, for byte-level BPE, SentencePiece BPE with byte fallback and the
Replace/ByteFallback/Fuse/Strip decoder, and the Metaspace decoder):
- the deltas returned by ``update`` and ``finish``, joined, equal
  ``decode_text(tokenizer, all ids)``;
- no delta holds a U+FFFD that the full decode does not hold at the same place, and the
  text sent while streaming never ends in one.

Invariants: ``text`` is the concatenation of every delta returned so far and equals
``decode_text(ids[:read_offset])``; ``prefix_text == decode_text(ids[prefix_offset:read_offset])``,
the context, is non-empty once anything has been read (NOTE 2).

NOTE 1 (the window): each update decodes ``ids[prefix_offset:end]``, the context and the
new tokens, and returns what it adds to ``prefix_text``. Every decoder here is additive
after a context that decodes to some text: byte-level BPE maps tokens to bytes and decodes
them with replacement, so a boundary after a whole character is clean; the SentencePiece
decoders change only the first token they see (a leading space), and that token lies in
the context. After a delta the new tokens become the next context, so a step decodes a
few tokens, not the whole output. Two decodes per step, as vLLM's slow path does.
NOTE 2 (a context that decodes to nothing is no context): a context of special tokens
(skipped) or of one ``"▁"`` (stripped) decodes to ``""``; with it, the next token would be
the first the decoder sees and would lose its leading space. Such a context is not taken:
the window keeps its older start, which did decode to text.
NOTE 3 (text a later token can change is held back): (a) a window whose text ends in
U+FFFD: a character still incomplete (byte-level BPE). (b) A trailing run of byte-fallback
tokens ``<0x..>``, with any invisible tokens among them: the ByteFallback decoder turns a
whole run into a string, or, if the run is not valid UTF-8, into one U+FFFD per byte, so
"é" (``<0xC3><0xA9>``) becomes three U+FFFD when ``<0xA9>`` follows. The run's text is
sent when a token of another kind arrives, or at ``finish``.
NOTE 4 (no clean-up of spaces): ``decode_text`` asks transformers not to apply
``clean_up_tokenization_spaces`` (which rewrites " ." to "." and " 's" to "'s" across token
boundaries). vLLM's detokenizers never apply it either, so the engine's text is the same
whether it is streamed or decoded once at the end.
NOTE 5 (a decoder this module does not know): should a window's text not start with its
context's, the detokenizer decodes the whole sequence instead (slower, and correct for any
decoder whose text only grows); if even that contradicts what was sent, it logs a warning
and sends the rest as the full decode has it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)
REPLACEMENT_CHAR = "\ufffd"


# --8<-- [start:decode_text]
def decode_text(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The engine's one definition of the text of ``token_ids`` (NOTE 4)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def is_byte_fallback_token(token: str | None) -> bool:
    """True for SentencePiece's byte tokens ``<0x00>`` .. ``<0xFF>``."""
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")
# --8<-- [end:decode_text]


# --8<-- [start:detokenizer]
class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas (see the module contract)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self.ids: list[int] = []
        self.text = ""  # every delta returned so far, joined
        self.prefix_offset = 0  # the context starts here (NOTE 1)
        self.read_offset = 0  # the text of ids[:read_offset] has been returned
        self.prefix_text = ""  # decode(ids[prefix_offset:read_offset])

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that no later token can change (NOTE 3)."""
        self.ids.extend(new_token_ids)
        end = self._stable_end()
        if end <= self.read_offset:
            return ""
        window = self._decode(self.prefix_offset, end)
        if window.endswith(REPLACEMENT_CHAR):  # a character still incomplete (NOTE 3a)
            return ""
        return self._advance(window, end)

    def finish(self) -> str:
        """The request ended: return whatever was held back."""
        end = len(self.ids)
        if end <= self.read_offset:
            return ""
        return self._advance(self._decode(self.prefix_offset, end), end)

    def _stable_end(self) -> int:
        """Where the text stops that later tokens cannot change: before a trailing run of
        byte tokens and invisible tokens (NOTE 3b)."""
        end = len(self.ids)
        run_has_bytes = False
        while end > self.read_offset:
            token_id = self.ids[end - 1]
            token = self.tokenizer.convert_ids_to_tokens(token_id)
            if is_byte_fallback_token(token):
                run_has_bytes = True
            elif token is not None and token_id not in self._special_ids:
                break  # a token with text of its own
            end -= 1
        return end if run_has_bytes else len(self.ids)

    def _decode(self, start: int, end: int) -> str:
        return decode_text(self.tokenizer, self.ids[start:end], self.skip_special_tokens)

    def _advance(self, window: str, end: int) -> str:
        """Return what ``window`` adds to the context; its new tokens become the context."""
        if window.startswith(self.prefix_text):
            delta = window[len(self.prefix_text) :]
        else:
            delta = self._whole_decode(end)  # NOTE 5
            window = self.prefix_text + delta
        self.text += delta
        if self.prefix_offset < self.read_offset:
            context = self._decode(self.read_offset, end)
            if context:  # NOTE 2: a context that decodes to nothing is not taken
                self.prefix_offset, window = self.read_offset, context
        self.prefix_text, self.read_offset = window, end
        return delta
# --8<-- [end:detokenizer]

    def _whole_decode(self, end: int) -> str:
        """NOTE 5: the delta from the whole sequence's text, for a decoder that is not additive."""
        full = self._decode(0, end)
        if not full.startswith(self.text):
            logger.warning("the tokenizer's decode changed text already sent: %r became %r", self.text, full)
        self.prefix_offset, self.prefix_text = 0, full[: len(self.text)]
        return full[len(self.text) :]
