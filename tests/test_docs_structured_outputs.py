"""The structured outputs chapter shows xgrammar's own output, not a hand-made picture of it.

``docs/structured_outputs.md`` prints the rules xgrammar writes for tutorial 12's schema and
the non-zero words of the first bitmask row of tutorial 12's choice; these tests compute
both again and compare them with the page, so the page cannot drift from xgrammar or from
the shipped model's tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "structured_outputs.md"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def _section(title: str) -> str:
    return PAGE.read_text(encoding="utf-8").split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_chapters_grammar_lines_are_xgrammars():
    xgr = pytest.importorskip("xgrammar")
    section = _section("From a JSON schema to a grammar")
    shown = json.loads(re.search(r"```json\n(.*?)```", section, re.S)[1])
    assert shown == SCHEMA, "the page's schema is not tutorial 12's"
    rules = re.search(r"```text\n(.*?)```", section, re.S)[1].splitlines()
    printed = str(xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=False)).splitlines()
    assert len(rules) == 5 and all(rule in printed for rule in rules), (rules, printed)


def test_the_chapters_bitmask_row_is_the_matchers():
    xgr = pytest.importorskip("xgrammar")
    from tinyvllm.models.tokenizer import load_tokenizer
    from tinyvllm.stdlib_tiny import STDLIB_TINY
    from tinyvllm.structured_output.backend_xgrammar import choice_as_grammar

    tok = load_tokenizer(STDLIB_TINY)
    vocab = len(tok)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id]))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(choice_as_grammar(["yes", "no", "maybe"])))
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask)
    words = mask[0].tolist()
    want = []
    for index, word in enumerate(words):
        if word:
            bits = [b for b in range(32) if (word >> b) & 1]
            tokens = ", ".join(f"{32 * index + b} `{tok.decode([32 * index + b])}`" for b in bits)
            want.append(f"| {index} | `0x{word & 0xFFFFFFFF:08x}` | {', '.join(map(str, bits))} | {tokens} |")
    section = _section("From the automaton to a bitmask")
    shown = [line for line in section.splitlines() if re.match(r"^\| \d+ \| `0x", line)]
    assert shown == want
    assert f"{vocab:,} tokens, so a row is {len(words)} words, {4 * len(words)} bytes" in section
    for token in (*tok("may").input_ids, *tok("be").input_ids):
        assert matcher.accept_token(token)
    matcher.fill_next_token_bitmask(mask)  # "maybe" is complete: EOS alone
    assert tok.eos_token_id == 0 and mask[0].tolist() == [1] + [0] * (len(words) - 1)
    assert "allows one token, EOS (id 0: word 0 is `0x00000001`, every other word 0)" in section.replace("\n", " ")
