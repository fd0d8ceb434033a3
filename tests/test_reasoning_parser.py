"""``entrypoints/reasoning.py``: a chat choice's output split into reasoning and content.

The texts are real: the tiny models' byte-level BPE tokenizer (``<think>`` id 1 and
``</think>`` id 2, both special) encodes them, and the engine's own ``IncrementalDetokenizer``
turns the ids into the text pieces a DELTA output carries, so a split sees what the server
gives it. No model runs here; the server's tests are ``test_reasoning_serving.py``.
"""

from __future__ import annotations

import itertools

import pytest

from tinyvllm.config import ReasoningConfig
from tinyvllm.engine.detokenizer import IncrementalDetokenizer, decode_text
from tinyvllm.entrypoints.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningSplit,
    build_reasoning_parser,
    reasoning_parser_class,
    request_thinks,
    split_reasoning,
    think_section_open,
)
from tinyvllm.models.tiny import bpe_tokenizer, sentencepiece_tokenizer, stdlib_corpus

START, END = 1, 2  # <think>, </think> in the tiny tokenizer
QWEN3 = Qwen3ReasoningParser(START, END)
R1 = DeepSeekR1ReasoningParser(START, END)


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(stdlib_corpus(), 512)


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def byte_ids(tok, text: str) -> list[int]:
    """``text`` as one token per UTF-8 byte (the byte-level alphabet, GPT-2's byte table): a
    multi-byte character arrives in pieces that decode to no whole character on their own."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    return tok.convert_tokens_to_ids([table[b] for b in text.encode("utf-8")])


def engine_pieces(tok, deltas: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """The text each DELTA output carries for these token deltas (the engine's detokenizer;
    what it held back comes with the last)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    pieces = [detok.update(delta) for delta in deltas]
    pieces[-1] += detok.finish()
    return pieces


def decoder(tok, skip_special_tokens: bool = True):
    return lambda ids: decode_text(tok, ids, skip_special_tokens)


def whole(tok, parser, ids, thinks=True, skip=True):
    return split_reasoning(parser, thinks, decoder(tok, skip), decode_text(tok, ids, skip), ids)


# -- the registry and start-up ---------------------------------------------------------------


def test_parsers_are_registered_by_vllm_names():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert reasoning_parser_class("qwen3") is Qwen3ReasoningParser
    assert reasoning_parser_class("deepseek_r1") is DeepSeekR1ReasoningParser


def test_an_unknown_parser_name_is_refused_naming_it_and_the_choices():
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown reasoning parser 'qwen'; choose one of deepseek_r1, qwen3"):
        reasoning_parser_class("qwen")


def test_the_parser_takes_the_engines_single_think_ids():
    parser = build_reasoning_parser("qwen3", ReasoningConfig((7,), (8,)))
    assert (type(parser), parser.start_token_id, parser.end_token_id) == (Qwen3ReasoningParser, 7, 8)


@pytest.mark.parametrize(
    "config, have",
    [(None, "it has none"), (ReasoningConfig((7,), (8, 9)), r"it has start \[7\], end \[8, 9\]"),
     (ReasoningConfig((), ()), r"it has start \[\], end \[\]")],
)  # fmt: skip
def test_a_model_without_single_think_ids_is_refused_naming_the_flag(config, have):
    with pytest.raises(ValueError, match=rf"--reasoning-parser deepseek_r1 needs the model's think start and end as one token each .*{have}"):
        build_reasoning_parser("deepseek_r1", config)


# -- the whole answer --------------------------------------------------------------------------


def test_qwen3_splits_at_the_end_token_and_leaves_out_a_generated_start(tok):
    ids = [START, *ids_of(tok, "Let me think."), END, *ids_of(tok, "\n\nThe answer is 4.")]
    assert whole(tok, QWEN3, ids) == ("Let me think.", "\n\nThe answer is 4.")


def test_the_start_token_in_the_prompt_qwen35_style(tok):
    ids = [*ids_of(tok, "Let me think."), END, *ids_of(tok, "Four.")]
    assert whole(tok, QWEN3, ids) == ("Let me think.", "Four.")


def test_qwen3_without_the_end_token_is_all_reasoning_cut_short(tok):
    ids = [START, *ids_of(tok, "Let me think about")]
    assert whole(tok, QWEN3, ids) == ("Let me think about", None)


def test_an_end_token_first_leaves_no_reasoning(tok):
    assert whole(tok, QWEN3, [END, *ids_of(tok, "Four.")]) == (None, "Four.")
    assert whole(tok, QWEN3, [START, END]) == (None, None)


def test_qwen3_with_enable_thinking_false_is_all_content(tok):
    assert QWEN3.thinks({"enable_thinking": False}) is False and QWEN3.thinks(None) is True
    thinks = request_thinks(QWEN3, {"enable_thinking": False}, [], constrained=False, enable_in_reasoning=False)
    ids = ids_of(tok, "Four.")
    assert whole(tok, QWEN3, ids, thinks=thinks) == (None, "Four.")
    late = [*ids_of(tok, "Four"), END, *ids_of(tok, ".")]  # NOTE 2: a late end token does not split
    assert whole(tok, QWEN3, late, thinks=thinks) == (None, "Four.")


def test_deepseek_r1_without_the_end_token_is_all_reasoning_whatever_the_kwargs(tok):
    assert R1.thinks({"enable_thinking": False}) is True
    ids = ids_of(tok, "Hmm, so")
    assert whole(tok, R1, ids) == ("Hmm, so", None)
    assert whole(tok, R1, [*ids, END, *ids_of(tok, "Yes.")]) == ("Hmm, so", "Yes.")


def test_text_before_a_generated_start_token_stays_reasoning(tok):
    ids = [*ids_of(tok, "\n"), START, *ids_of(tok, "why"), END, *ids_of(tok, "because")]
    assert whole(tok, QWEN3, ids) == ("\nwhy", "because")


def test_after_the_end_token_think_tokens_are_content(tok):
    ids = [*ids_of(tok, "a"), END, *ids_of(tok, "b"), START, *ids_of(tok, "c"), END]
    assert whole(tok, QWEN3, ids) == ("a", "bc")  # special: no text of their own
    assert whole(tok, QWEN3, ids, skip=False) == ("a", "b<think>c</think>")


def test_the_think_tokens_text_is_left_out_when_special_tokens_are_kept(tok):
    ids = [START, *ids_of(tok, "x = 1"), END, *ids_of(tok, "y")]
    assert decode_text(tok, ids, skip_special_tokens=False) == "<think>x = 1</think>y"
    assert whole(tok, QWEN3, ids, skip=False) == ("x = 1", "y")


def test_a_written_end_tag_is_text_not_the_end_token(tok):
    """NOTE 1: "</think>" typed as characters is not the end token."""
    ids = ids_of(tok, "say </") + ids_of(tok, "think> here")  # the tokenizer would read "</think>" whole
    assert END not in ids
    assert whole(tok, QWEN3, ids) == ("say </think> here", None)


def test_the_engines_text_is_split_as_it_is_cut(tok):
    """NOTE 1: a stop string cut the engine's text; the content ends where it does."""
    ids = [START, *ids_of(tok, "think"), END, *ids_of(tok, "one two three")]
    cut = decode_text(tok, ids)[: -len(" three")]
    assert split_reasoning(QWEN3, True, decoder(tok), cut, ids) == ("think", "one two")


def test_content_keeps_the_leading_space_of_the_whole_decode():
    """SentencePiece drops the first token's space; the content is the engine's text after the
    end token, so its space stays (a decode of the content's ids alone would lose it)."""
    tok = sentencepiece_tokenizer(stdlib_corpus(), 400, "llama2")
    start, end = tok.convert_tokens_to_ids(["(", ")"])  # ordinary tokens with text, as Qwen3's <think>
    parser = Qwen3ReasoningParser(start, end)
    ids = [start, *ids_of(tok, "x"), end, *ids_of(tok, "return x")]
    text = decode_text(tok, ids)
    assert text.endswith(") return x") and decode_text(tok, ids_of(tok, "return x")) == "return x"
    assert split_reasoning(parser, True, decoder(tok), text, ids)[1] == " return x"


# -- which requests think ----------------------------------------------------------------------


def test_a_grammar_from_the_first_token_means_no_think_section():
    assert request_thinks(QWEN3, None, [5, 6], constrained=False, enable_in_reasoning=False) is True
    assert request_thinks(QWEN3, None, [5, 6], constrained=True, enable_in_reasoning=False) is False
    assert request_thinks(QWEN3, None, [5, START], constrained=True, enable_in_reasoning=False) is True  # grammar waits
    assert request_thinks(QWEN3, None, [5, START], constrained=True, enable_in_reasoning=True) is False
    assert think_section_open([START, 5, END, 6], QWEN3) is False and think_section_open([END, START, 5], QWEN3) is True


# -- streaming ---------------------------------------------------------------------------------


def streamed(tok, parser, deltas, thinks=True, skip=True):
    """Each delta's ``(reasoning, content)`` through one ``ReasoningSplit``."""
    split = ReasoningSplit(parser, thinks, decoder(tok, skip))
    return [split.update(text, ids) for text, ids in zip(engine_pieces(tok, deltas, skip), deltas)]


def partitions(ids: list[int]):
    """Every way to cut ``ids`` into consecutive deltas."""
    for mask in itertools.product((False, True), repeat=len(ids) - 1):
        deltas, current = [], [ids[0]]
        for cut, token in zip(mask, ids[1:]):
            if cut:
                deltas.append(current)
                current = []
            current.append(token)
        yield [*deltas, current]


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_pieces_join_to_the_whole_answer_at_every_cut(tok, skip):
    """Multi-byte characters in byte pieces on both sides of the end token, a start token:
    every partition of the ids into deltas (2^12), each joined equal to the whole answer."""
    ids = [START, *byte_ids(tok, "é€"), *ids_of(tok, "ok"), END, *byte_ids(tok, "ü"), *ids_of(tok, " 4")]
    assert len(ids) == 13
    want = whole(tok, QWEN3, ids, skip=skip)
    assert want == ("é€ok", "ü 4")
    for deltas in partitions(ids):
        pieces = streamed(tok, QWEN3, deltas, skip=skip)
        joined = ("".join(r for r, _ in pieces) or None, "".join(c for _, c in pieces) or None)
        assert joined == want, deltas
        assert not any("\ufffd" in r + c for r, c in pieces), deltas  # never half a character


def test_an_end_token_inside_a_delta_splits_its_text_both_ways(tok):
    before, after = ids_of(tok, "so it is"), ids_of(tok, " four")
    [(r0, c0), (r1, c1)] = streamed(tok, QWEN3, [[START, before[0]], [*before[1:], END, *after]])
    assert (r0, c0) == (decode_text(tok, before[:1]), "")
    assert r0 + r1 == "so it is" and c1 == " four"


def test_qwen3_thinking_off_streams_everything_as_content(tok):
    deltas = [ids_of(tok, "Four"), [END], ids_of(tok, ".")]
    assert streamed(tok, QWEN3, deltas, thinks=False) == [("", "Four"), ("", ""), ("", ".")]
