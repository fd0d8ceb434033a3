"""Bad words (``sample/bad_words.py``): how a word becomes token sequences (vLLM's two
tokenizations) and which token each sequence bans after a given output."""

import pytest
import torch

from tinyvllm.sample.bad_words import apply_bad_words, banned_tokens, tokenize_bad_words
from tinyvllm.sample.logits_processors import LogitsProcessors
from tinyvllm.sample.metadata import SamplingMetadata


class FakeTokenizer:
    """``encode(text, add_special_tokens=False)`` from a fixed table; records its calls."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return self.table[text]


def test_each_word_is_tokenized_without_and_with_a_leading_space():
    tok = FakeTokenizer({"cat": [10], " cat": [11], "hot dog": [20, 21], " hot dog": [22, 21]})
    assert tokenize_bad_words(tok, ["cat", "hot dog"]) == ((10,), (11,), (20, 21), (22, 21))
    assert tok.calls == [("cat", False), (" cat", False), ("hot dog", False), (" hot dog", False)]


def test_the_spaced_form_is_kept_only_when_it_is_a_new_first_token_of_the_same_length():
    tok = FakeTokenizer({
        "same": [5], " same": [5],  # the tokenizer adds the space itself: no new form
        "split": [6, 7], " split": [8, 6, 7],  # the space became a token of its own
        "lead": [9], " lead": [9],
    })  # fmt: skip
    assert tokenize_bad_words(tok, ["same", "split", "  lead"]) == ((5,), (6, 7), (9,))
    assert ("lead", False) in tok.calls  # leading whitespace is stripped first


def test_a_word_of_whitespace_alone_is_refused():
    with pytest.raises(ValueError, match="bad_words"):
        tokenize_bad_words(FakeTokenizer({"": []}), ["   "])


@pytest.mark.parametrize(
    "output, banned",
    [
        ([], [1]),  # the single-token word, always; (2, 3) needs a 2 first; (4, 5, 6) needs 4, 5
        ([2], [1, 3]),
        ([2, 7], [1]),
        ([4, 5], [1, 6]),
        ([5], [1]),  # the output is shorter than the prefix (4, 5)
        ([9, 4, 5], [1, 6]),
    ],
)
def test_banned_tokens_need_the_whole_prefix_at_the_end_of_the_output(output, banned):
    assert sorted(banned_tokens(((1,), (2, 3), (4, 5, 6)), output)) == banned


def test_apply_bad_words_masks_the_banned_tokens_of_each_row_only():
    logits = torch.zeros(3, 8)
    outputs = [[2], [], [2]]
    out = apply_bad_words(logits, {0: ((2, 3),), 1: ((7,),)}, outputs)
    assert torch.isinf(out).nonzero().tolist() == [[0, 3], [1, 7]]  # row 2 has no bad words


def rows_of_drafts(bad, outputs, drafts):
    """The bad words and outputs so far of a speculative step's rows: ``SamplingMetadata.expand``."""
    md = SamplingMetadata(
        temperature=torch.zeros(len(outputs)), all_greedy=True, all_random=False, top_p=None, top_k=None,
        seeds={}, logitsprocs=LogitsProcessors(), thinking_budget=None, bad_words_token_ids=bad,
        output_token_ids=tuple(outputs),
    )  # fmt: skip
    rows = md.expand(drafts)
    return rows.bad_words_token_ids, rows.output_token_ids


def test_with_drafts_each_row_bans_after_the_drafts_before_it():
    """Speculative decoding: request r owns ``len(drafts[r]) + 1`` rows, and row j judges the
    output as if drafts 0 .. j - 1 were generated (vLLM's ``apply_bad_words_with_drafts``):
    the expansion gives each row its request's words and that output, ``apply_bad_words`` bans."""
    logits = torch.zeros(2 + 3 + 1, 8)  # request 0: 1 draft; request 1: 2 drafts; request 2: none
    outputs = [[4], [2], [5]]
    drafts = [[2], [7, 2], []]
    bad = {0: ((2, 3),), 1: ((2, 3), (7, 2, 6)), 2: ((5, 1),)}
    out = apply_bad_words(logits, *rows_of_drafts(bad, outputs, drafts))
    # request 0: row 0 after [4] bans nothing; row 1 after [4, 2] bans 3
    # request 1: row 2 after [2] bans 3; row 3 after [2, 7] bans nothing; row 4 after [2, 7, 2] bans 3 and 6
    # request 2: row 5 after [5] bans 1
    assert torch.isinf(out).nonzero().tolist() == [[1, 3], [2, 3], [4, 3], [4, 6], [5, 1]]
    assert apply_bad_words(torch.zeros(6, 8), *rows_of_drafts(bad, outputs, drafts)).equal(out)  # fresh logits, same bans
    assert apply_bad_words(torch.zeros(6, 8), *rows_of_drafts({}, outputs, drafts)).eq(0).all()  # no bad words, no bans
    assert [list(o) for o in rows_of_drafts(bad, outputs, drafts)[1]] == [[4], [4, 2], [2], [2, 7], [2, 7, 2], [5]]


def test_the_tiny_tokenizer_bans_a_word_in_both_forms(tiny_model_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dirs["qwen3"]))
    seqs = tokenize_bad_words(tok, ["return"])
    assert tuple(tok.encode("return", add_special_tokens=False)) in seqs
    assert all(tok.decode(list(seq)).strip() == "return" for seq in seqs)
