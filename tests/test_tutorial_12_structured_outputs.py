"""Tutorial 12 constrains the shipped model step by step: this test pins the facts its page
relies on.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/12_structured_outputs.txt``; here every row of the three step tables is
recounted by an independent xgrammar matcher (built from the tokenizer, not from the
engine's manager): the allowed count the tutorial read from the step's bitmask equals the
matcher's count after the tokens chosen before it, the chosen token is one of them, the
listed tokens are exactly the allowed ones, and each part's output fits its constraint. Part 4
(speculative decoding) is replayed the same way, a row per draft position: row i after drafts
0 .. i-1, the matcher rolled back after, advanced by the kept tokens only.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path

import pytest
from tutorial_runner import tutorial_output

PARTS = 3
SCRIPT = Path(__file__).resolve().parents[1] / "tutorials" / "12_structured_outputs.py"


def _tutorial():
    """The script as a module (its ``main`` does not run): the constraints it used."""
    spec = importlib.util.spec_from_file_location("tutorial_12", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parts(out: str) -> list[tuple[str, list[tuple[int, int, str, str]], str]]:
    """(header line, rows (step, allowed, chosen text, listed tokens or ''), output line) per part."""
    parts = []
    for block in out.split("\n== part ")[1:]:
        lines = block.splitlines()
        rows = []
        for line in lines:
            m = re.match(r"^\s*(\d+) \|\s+(\d+) \| ('.*?'|\".*?\")\s+\| ('.*?'|\".*?\")(?:  \{(.*)\})?$", line)
            if m:
                rows.append((int(m[1]), int(m[2]), ast.literal_eval(m[3]), m[5] or ""))
        output = next(line for line in lines if line.startswith("output "))
        parts.append((lines[0], rows, output))
    return parts


@pytest.mark.slow
def test_tutorial_12_allowed_counts_are_an_independent_matchers():
    xgr = pytest.importorskip("xgrammar")
    from tinyvllm.models.tokenizer import load_tokenizer
    from tinyvllm.stdlib_tiny import STDLIB_TINY
    from tinyvllm.structured_output.backend_xgrammar import choice_as_grammar

    out = tutorial_output("12_structured_outputs.py")
    vocab = int(re.search(r"vocabulary (\d+) tokens", out).group(1))
    tok = load_tokenizer(STDLIB_TINY)
    eos = tok.eos_token_id
    text_to_id: dict[str, list[int]] = {}
    for t in range(vocab):
        text_to_id.setdefault(tok.decode([t]), []).append(t)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos]))
    parts = _parts(out)[:PARTS]  # part 4, with drafts: test_tutorial_12_each_draft_position_has_its_row
    assert len(parts) == PARTS, out
    for (header, rows, output), (_, _, constraint, _) in zip(parts, _tutorial().PARTS):
        if constraint.choice is not None:
            grammar = compiler.compile_grammar(choice_as_grammar(constraint.choice))
        elif constraint.regex is not None:
            grammar = compiler.compile_regex(constraint.regex)
        else:
            grammar = compiler.compile_json_schema(json.dumps(constraint.json), any_whitespace=not constraint.disable_any_whitespace)
        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, vocab)
        assert rows, header
        for step, allowed, chosen, listed in rows:
            matcher.fill_next_token_bitmask(mask)
            ids = [t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
            assert allowed == len(ids), f"{header}: step {step} printed {allowed} allowed, the matcher allows {len(ids)}"
            if listed:
                assert sorted(ast.literal_eval("[" + listed + "]")) == sorted(tok.decode([t]) for t in ids), step
            candidates = [t for t in text_to_id[chosen] if t in ids]
            assert len(candidates) == 1, f"{header}: step {step}: {chosen!r} is not one allowed token"
            assert matcher.accept_token(candidates[0]), step
        assert rows[-1][2] == tok.decode([eos]) and rows[-1][1] == 1, "each part ends once only EOS is allowed"
        assert matcher.is_terminated()
        assert "finish_reason 'stop'" in output and output.endswith(": yes"), output
    assert "compiled grammars in the manager's cache: 3" in out


def _cells(cell: str) -> list[str]:
    """The tokens of a part-4 cell: Python reprs separated by spaces, or "-"."""
    return [ast.literal_eval(t) for t in re.findall(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", cell)]


def _imports_matcher(xgr):
    """Parts 4 and 5: each token text's ids, an independent matcher of the imports regex, and
    the ids it allows now."""
    from tinyvllm.models.tokenizer import load_tokenizer
    from tinyvllm.stdlib_tiny import STDLIB_TINY

    tok = load_tokenizer(STDLIB_TINY)
    vocab = len(tok)
    ids_of: dict[str, list[int]] = {}
    for t in range(vocab):
        ids_of.setdefault(tok.decode([t]), []).append(t)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id]))
    _, constraint, _ = _tutorial().IMPORTS
    matcher = xgr.GrammarMatcher(compiler.compile_regex(constraint.regex))
    mask = xgr.allocate_token_bitmask(1, vocab)

    def allowed() -> list[int]:
        matcher.fill_next_token_bitmask(mask)
        return [t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1]

    return ids_of, matcher, allowed


@pytest.mark.slow
def test_tutorial_12_each_draft_position_has_its_row():
    xgr = pytest.importorskip("xgrammar")
    out = tutorial_output("12_structured_outputs.py")
    part = out.split("\n== part 4:", 1)[1].split("\n== part 5:", 1)[0]
    ids_of, matcher, allowed = _imports_matcher(xgr)

    def one_id(text: str, among: list[int]) -> int:
        [token] = [t for t in ids_of[text] if t in among]
        return token

    rows = [line.split(" | ") for line in part.splitlines() if re.match(r"^\s*\d+ \| ", line)]
    assert rows, part
    trimmed = kept_drafts = 0
    for step, proposed, verified, counts, kept in rows:
        proposed, verified, kept = _cells(proposed), _cells(verified), _cells(kept)
        counts = [int(n) for n in counts.split(" / ")]
        assert verified == proposed[: len(verified)], f"step {step}: the verified drafts are not a prefix of the proposal"
        assert len(counts) == len(verified) + 1, f"step {step}: {len(counts)} rows for {len(verified)} drafts"
        accepted = 0
        for i, draft in enumerate([*verified, None]):
            ids = allowed()
            assert counts[i] == len(ids), f"step {step}, row {i}: printed {counts[i]}, the matcher allows {len(ids)}"
            if draft is not None:
                assert matcher.accept_token(one_id(draft, ids))
                accepted += 1
        if len(verified) < len(proposed):  # the grammar refused the next proposed draft
            ids = allowed()
            assert not [t for t in ids_of[proposed[len(verified)]] if t in ids], f"step {step}: a draft was trimmed that fits"
            trimmed += 1
        matcher.rollback(accepted)
        for text in kept:
            assert matcher.accept_token(one_id(text, allowed())), f"step {step}: kept {text!r}, which the grammar refuses"
        assert kept[: len(kept) - 1] == verified[: len(kept) - 1]  # kept drafts, then the target's token
        kept_drafts += len(kept) - 1 if verified else 0
    assert matcher.is_terminated() and trimmed >= 1 and kept_drafts >= 1, (trimmed, kept_drafts)
    assert "finish_reason 'stop'; re.fullmatch: yes" in part and "same tokens as without speculation: yes" in part


@pytest.mark.slow
def test_tutorial_12_part_5_rejects_at_the_row_of_a_draft_the_grammar_refuses():
    """Part 5 (async scheduling): the drafts the runner ran are not trimmed; an independent
    matcher refuses exactly as many as the table says, each row read allows what the matcher
    allows after the drafts before it, and the kept tokens are part 4's."""
    xgr = pytest.importorskip("xgrammar")
    out = tutorial_output("12_structured_outputs.py")
    part = out.split("\n== part 5:", 1)[1]
    ids_of, matcher, allowed = _imports_matcher(xgr)

    rows = [line.split(" | ") for line in part.splitlines() if re.match(r"^\s*\d+ \| ", line) and "thrown away" not in line]
    refused_total = 0
    for step, ran, refused, counts, kept in rows:
        ran, kept, refused = _cells(ran), _cells(kept), int(refused)
        counts = [int(n) for n in counts.split(" / ")]
        valid = 0
        for draft in ran:  # the prefix the grammar allows, accepted one by one
            ids = allowed()
            fits = [t for t in ids_of[draft] if t in ids]
            if not fits:
                break
            assert matcher.accept_token(fits[0])
            valid += 1
        assert refused == len(ran) - valid, f"step {step}: the table says {refused} refused, the matcher {len(ran) - valid}"
        assert len(counts) == valid + 1, f"step {step}: {len(counts)} rows read for {valid} drafts before a refused one"
        matcher.rollback(valid)
        for i, n in enumerate(counts):  # row i: after the drafts before it
            assert n == len(allowed()), f"step {step}, row {i}"
            if i < valid:
                matcher.accept_token([t for t in ids_of[ran[i]] if t in allowed()][0])
        matcher.rollback(valid)
        for text in kept:
            [token] = [t for t in ids_of[text] if t in allowed()]
            assert matcher.accept_token(token), f"step {step}: kept {text!r}, which the grammar refuses"
        refused_total += refused
    assert matcher.is_terminated() and refused_total >= 1, refused_total
    assert "thrown away" in part
    assert "same tokens as part 4: yes" in part and "the same as part 4: yes" in part

