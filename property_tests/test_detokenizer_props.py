"""Hypothesis properties of ``engine/detokenizer.py``: for any sequence of token ids, fed in
any chunks, the deltas join to the full decode and never hold half a character, for every
tokenizer family the loader accepts:

- ``byte_level``: byte-level BPE (GPT-2, Qwen, Llama 3), the tiny models' tokenizer;
- ``llama2``: SentencePiece BPE with byte fallback and the Replace / ByteFallback / Fuse /
  Strip decoder (Llama 2, TinyLlama, Mistral v0.1): the first token's leading space is
  stripped, and a run of byte tokens decodes as a whole (or as one U+FFFD per byte);
- ``metaspace``: a SentencePiece Unigram with the Metaspace decoder (T5, ALBERT).

"The full decode" is ``decode_text``: ``tokenizer.decode`` with no clean-up of spaces.
"""

import pytest
from hypothesis import given, settings, strategies as st

from tinyvllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, decode_text
from tinyvllm.models.tiny import bpe_tokenizer, sentencepiece_tokenizer, stdlib_corpus

FAMILIES = ("byte_level", "llama2", "metaspace")
# Text with characters of two, three and four UTF-8 bytes, so some enter the vocabularies
# whole and the rest fall back to bytes.
EXTRA_TEXT = ["héllo wörld, naïve café: 5 € ✓ 日本語 😀", "  two  spaces,\tand a tab.\n"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    texts = stdlib_corpus() + EXTRA_TEXT
    if request.param == "byte_level":
        tok = bpe_tokenizer(texts, 512)
    else:
        tok = sentencepiece_tokenizer(texts, 600, request.param)
    return request.param, tok


def token_ids_for(tok) -> st.SearchStrategy[int]:
    """Ids with a bias towards what breaks a naive window: special tokens, single-byte
    tokens (half characters), lone "▁" tokens (a space a decoder may strip) and ids past
    the tokenizer's vocabulary (a model's padded rows, which decode to nothing)."""
    vocab = tok.get_vocab()
    special = sorted(set(tok.all_special_ids))
    byte_ids = sorted(i for t, i in vocab.items() if len(t) == 6 and t.startswith("<0x"))
    if not byte_ids:  # byte-level BPE: the 256 single-byte tokens sit right after the specials
        byte_ids = list(range(len(special), len(special) + 256))
    spaces = sorted(i for t, i in vocab.items() if set(t) <= {"▁", " ", "Ġ"}) or special
    n = len(vocab)
    return st.one_of(
        st.integers(0, n - 1),
        st.sampled_from(special),
        st.sampled_from(byte_ids),
        st.sampled_from(spaces),
        st.integers(n, n + 8),
    )


def _feed(tok, chunks, skip_special_tokens):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.update(chunk) for chunk in chunks]
    return detok, deltas, detok.finish()


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_deltas_join_to_the_full_decode(family, data, skip):
    name, tok = family
    chunks = data.draw(st.lists(st.lists(token_ids_for(tok), max_size=4), min_size=1, max_size=12), "chunks")
    detok, deltas, last = _feed(tok, chunks, skip)
    ids = [t for chunk in chunks for t in chunk]
    full = decode_text(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) + last == full, (name, ids)
    assert detok.text == full


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_no_delta_holds_a_replacement_char_the_full_decode_lacks(family, data):
    name, tok = family
    chunks = data.draw(st.lists(st.lists(token_ids_for(tok), max_size=4), min_size=1, max_size=12), "chunks")
    detok, deltas, last = _feed(tok, chunks, True)
    ids = [t for chunk in chunks for t in chunk]
    full = decode_text(tok, ids)
    position = 0
    for delta in [*deltas, last]:
        for offset, char in enumerate(delta):
            if char == REPLACEMENT_CHAR:
                assert full[position + offset] == REPLACEMENT_CHAR, (name, delta, full)
        position += len(delta)
    # while streaming, the text sent so far is a prefix of the full decode, and never ends
    # in a replacement character (it is held back until the request ends)
    sent = ""
    for delta in deltas:
        sent += delta
        assert full.startswith(sent) and not sent.endswith(REPLACEMENT_CHAR), (name, sent, full)


def test_the_families_decode_as_their_models_do(family):
    """The fixtures are what they claim: the SentencePiece decoders strip the leading space
    of the first token (so decoding is not additive), and llama2 falls back to bytes."""
    name, tok = family
    ids = tok.encode("a b", add_special_tokens=False)
    assert decode_text(tok, ids) == "a b"
    if name != "byte_level":  # split before the token that carries the space "▁"
        cut = next(i for i, t in enumerate(tok.convert_ids_to_tokens(ids)) if i and t.startswith("▁"))
        assert decode_text(tok, ids[:cut]) + decode_text(tok, ids[cut:]) == "ab", "the leading space is stripped"
    if name == "llama2":
        assert decode_text(tok, [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "😀".encode()]) == "😀"
