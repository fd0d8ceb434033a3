"""Hypothesis properties of ``engine/detokenizer.py``: for any sequence of token ids, fed in
any chunks, the deltas join to the full decode and never hold half a character."""

import pytest
from hypothesis import given, settings, strategies as st

from tinyvllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny models' byte-level BPE tokenizer (512 ids; ids 0-2 are special tokens)."""
    from transformers import AutoTokenizer

    from tinyvllm.models.tiny import train_tokenizer

    folder = tmp_path_factory.mktemp("detok_tokenizer")
    train_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


# Token ids with a bias towards the single-byte tokens >= 0x80 (half characters) and the
# special tokens, which a uniform draw over 512 ids would rarely string together.
token_ids = st.one_of(st.integers(0, 511), st.integers(0, 2), st.integers(3, 3 + 255))
chunked_ids = st.lists(st.lists(token_ids, min_size=0, max_size=4), min_size=1, max_size=12)


def _feed(tokenizer, chunks, skip_special_tokens):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detok.update(chunk) for chunk in chunks]
    return detok, deltas, detok.finish()


@settings(max_examples=300, deadline=None)
@given(chunks=chunked_ids, skip=st.booleans())
def test_deltas_join_to_the_full_decode(tokenizer, chunks, skip):
    detok, deltas, last = _feed(tokenizer, chunks, skip)
    ids = [t for chunk in chunks for t in chunk]
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + last == full
    assert detok.text == full


@settings(max_examples=300, deadline=None)
@given(chunks=chunked_ids)
def test_no_delta_holds_a_replacement_char_the_full_decode_lacks(tokenizer, chunks):
    detok, deltas, last = _feed(tokenizer, chunks, True)
    full = tokenizer.decode([t for chunk in chunks for t in chunk], skip_special_tokens=True)
    position = 0
    for delta in [*deltas, last]:
        for offset, char in enumerate(delta):
            if char == REPLACEMENT_CHAR:
                assert full[position + offset] == REPLACEMENT_CHAR, (delta, full)
        position += len(delta)
    # while streaming, the text sent so far is a prefix of the full decode, and never ends
    # in a replacement character (it is held back until the request ends)
    sent = ""
    for delta in deltas:
        sent += delta
        assert full.startswith(sent) and not sent.endswith(REPLACEMENT_CHAR), (sent, full)
