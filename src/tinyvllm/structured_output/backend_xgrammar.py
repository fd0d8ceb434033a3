"""The xgrammar backend: from ``StructuredOutputsParams`` to a compiled grammar and a matcher.

Concept: two steps, as in vLLM. ``validate`` parses the constraint without the tokenizer (a
schema, regex or EBNF that xgrammar cannot read is a ``ValueError`` naming the field, before the
request is queued); ``compile`` builds the tokenizer-specific grammar (per-state token tables),
the slow part, run off the step's thread by the manager. ``XgrammarGrammar`` is one request's
matcher: it accepts sampled tokens, fills its row of the step's bitmask, and rolls back.

Mirrors: ``vllm/v1/structured_output/backend_xgrammar.py`` (``XgrammarBackend``,
``XgrammarGrammar``, ``validate_xgrammar_grammar``) and ``choice_as_grammar`` from
``vllm/v1/structured_output/backend_types.py``'s neighbours.

Invariants: a matcher's state is the grammar after exactly the tokens it accepted minus those
rolled back; ``validate_tokens`` leaves the state as it found it.

NOTE 1 (the bitmask layout): one row per sampled position, ``ceil(V / 32)`` int32 words, bit
``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (xgrammar's layout; its
``allocate_token_bitmask`` makes the buffer).
NOTE 2 (choice as a grammar): a choice list becomes the EBNF ``root ::= "a" | "b"``, each string a
literal with ``\\``, ``"`` and control characters escaped, as vLLM builds it.
NOTE 3 (stop tokens): the matcher's stop tokens are the model's EOS ids: once the grammar is
complete it allows only them, and accepting one terminates it.
NOTE 4 (whitespace_pattern): xgrammar takes no whitespace pattern (vLLM routes it to another
backend); it is refused with a ValueError naming the field.
NOTE 5 (json_object): the schema ``{"type": "object"}``, as vLLM compiles it with xgrammar, so the
output is a JSON object (xgrammar's built-in JSON grammar would allow any JSON value).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tinyvllm.sampling_params import StructuredOutputsParams

def _xgrammar():
    """xgrammar, imported where it is first needed (``__init__.py``: the package imports without it)."""
    try:
        import xgrammar
    except ImportError as error:  # pragma: no cover - the ci extra installs it
        raise ValueError("structured outputs need the xgrammar package: pip install xgrammar") from error
    return xgrammar


def choice_as_grammar(choices: Sequence[str]) -> str:
    """NOTE 2: ``("yes", 'a"b')`` -> ``root ::= "yes" | "a\\"b"``."""
    def literal(text: str) -> str:
        escaped = json.dumps(text, ensure_ascii=False)[1:-1]  # \\, \", \n, \t and control characters
        return f'"{escaped}"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


def _field_error(params: StructuredOutputsParams, error: Exception) -> ValueError:
    """The xgrammar error as a ValueError naming the field (first line, without its C++ source prefix)."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    message = message.split(": ", 1)[1] if message.startswith("[") and ": " in message else message
    return ValueError(f"structured_outputs {params.kind} is not a valid {params.kind}: {message}")


def validate(params: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer; ValueError naming the field if xgrammar cannot."""
    if params.whitespace_pattern is not None:  # NOTE 4
        raise ValueError(
            f"structured_outputs whitespace_pattern={params.whitespace_pattern!r} is not supported by the "
            "xgrammar backend (use disable_any_whitespace=True for compact JSON)"
        )
    xgr = _xgrammar()
    try:
        if params.json is not None:
            xgr.Grammar.from_json_schema(_schema_text(params), any_whitespace=not params.disable_any_whitespace)
        elif params.regex is not None:
            xgr.Grammar.from_regex(params.regex)
        elif params.grammar is not None:
            xgr.Grammar.from_ebnf(params.grammar)
        elif params.choice is not None:
            xgr.Grammar.from_ebnf(choice_as_grammar(params.choice))
    except RuntimeError as error:
        raise _field_error(params, error) from None


def _schema_text(params: StructuredOutputsParams) -> str:
    return params.json if isinstance(params.json, str) else json.dumps(params.json)


class XgrammarBackend:
    """The tokenizer's vocabulary as xgrammar sees it, and a compiler over it (thread-safe)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size  # the logits' width: the model's vocabulary, padding included
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the manager caches (NOTE 2 there)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar (the slow step: a token table per grammar state)."""
        try:
            if params.json is not None:
                return self.compiler.compile_json_schema(_schema_text(params), any_whitespace=not params.disable_any_whitespace)
            if params.json_object:  # NOTE 5: an object, not any JSON value
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
            if params.regex is not None:
                return self.compiler.compile_regex(params.regex)
            text = params.grammar if params.grammar is not None else choice_as_grammar(params.choice)
            return self.compiler.compile_grammar(text)
        except RuntimeError as error:
            raise _field_error(params, error) from None

    def matcher(self, compiled) -> XgrammarGrammar:
        return XgrammarGrammar(_xgrammar().GrammarMatcher(compiled))  # rollback is unbounded in xgrammar 0.2


class XgrammarGrammar:
    """One request's matcher (vLLM's ``XgrammarGrammar``)."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_processed_tokens = 0  # accepted, minus rolled back

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance over ``tokens``; False (at the first the grammar refuses) if one does not fit."""
        for token in tokens:
            if not self.matcher.accept_token(token):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts; the state is left unchanged."""
        accepted: list[int] = []
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Row ``row`` of ``bitmask`` ``[G, ceil(V / 32)]`` int32: the tokens allowed next (NOTE 1)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
