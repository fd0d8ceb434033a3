"""Reasoning outputs: a chat choice's output split into its think section and its answer.

Concept: a reasoning model (Qwen3, DeepSeek R1) writes its reasoning first, between a start
token (``<think>``) and an end token (``</think>``), then the answer. Served with
``--reasoning-parser NAME``, a chat choice's message carries the first part in ``reasoning``
and the second in ``content`` (a stream: ``delta.reasoning``, ``delta.content``). The
rule, on the choice's generated tokens:

- reasoning: the tokens before the first end token, a generated start token left out (NOTE 3);
- content: the tokens after that end token;
- no end token: all reasoning when the request thinks, all content when it does not (NOTE 2).

``ReasoningSplit`` is one choice's state: it takes each output's new text and token ids and
returns the new ``(reasoning, content)``; the whole answer is the same split in one call.

Mirrors: ``vllm/reasoning/abs_reasoning_parsers.py`` (``ReasoningParser``,
``ReasoningParserManager``: parsers registered by name), ``basic_parsers.py``
(``BaseThinkingReasoningParser``), ``qwen3_reasoning_parser.py``,
``deepseek_r1_reasoning_parser.py``.

Invariants: a split's pieces, joined, are what one call with the whole output returns, at any
piece boundaries (an end token inside a piece, with text on both sides, included); every
character of the engine's text goes to the reasoning, to the content or nowhere (a think
token's own text), once, in order; no character is split (the engine's text holds no half
character, ``engine/detokenizer.py``). Pure Python: no tokenizer but the ``decode`` given.

NOTE 1 (the ids say where, the engine's text says what): the split point is the end token's
place among the token ids, never a search of the text: a model may write "</think>" as
plain text, and a tokenizer may make the think tokens special (skipped, no text at all, as
the tiny models do). The characters are the engine's text, as a choice without a parser
gets it: cut at a stop string, without a stop token's text, ``skip_special_tokens`` applied.
A think token's characters in that text run from ``len(decode(ids before it))`` to
``len(decode(ids through it))``: the engine's text is the decode of its ids, and the decode
of a prefix of ids is a prefix of it. Text never arrives before its tokens, so each
character is routed once, when it arrives, by spans already known.
NOTE 2 (which requests think): both parsers read an output without an end token as reasoning
cut short (``max_tokens``). ``qwen3`` with the chat template kwarg ``enable_thinking`` false
(Qwen3's template then writes an empty, closed think section into the prompt) reads the
whole output as content, a late end token included: vLLM's stream does so (the prompt ended
the reasoning), while its whole answer would split at such a token; a stream cannot take
text back, so here both follow the stream. A request whose grammar applies from its first
token (``structured_outputs``, ``response_format``, a forced tool call, while the prompt
leaves no think section open: ``structured_output/manager.py`` NOTE 4) has no think
section either: content.
NOTE 3 (the start token): Qwen3 up to its 2507 models generates ``<think>``; later templates
put it in the prompt. A generated start token before the end token is left out, its text
too; text before it stays reasoning (vLLM's whole answer drops that text, its stream keeps
it). After the end token a start token is content like any other.
NOTE 4 (one id each): the split needs the engine's ``ReasoningConfig`` (``config.py``) with
one start id and one end id; a model without them, asked for a parser, is refused at start-up
with a ValueError naming ``--reasoning-parser``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tinyvllm.config import ReasoningConfig

Decode = Callable[[Sequence[int]], str]  # the engine's decode_text of token ids, for this request


# --8<-- [start:parsers]
@dataclass(frozen=True)
class ReasoningParser:
    """A think section's two token ids (NOTE 4), and whether a request thinks (NOTE 2)."""

    start_token_id: int
    end_token_id: int
    name: ClassVar[str] = ""

    def thinks(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether an output without the end token is reasoning (True) or content."""
        return True


class DeepSeekR1ReasoningParser(ReasoningParser):
    """``deepseek_r1``: everything before ``</think>`` is reasoning; no ``</think>``, all of it."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """``qwen3``: as ``deepseek_r1``, unless ``enable_thinking`` is false: then all content."""

    name = "qwen3"

    def thinks(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        return bool((chat_template_kwargs or {}).get("enable_thinking", True))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser registered as ``name``; a ValueError naming it and the choices."""
    if name not in REASONING_PARSERS:
        choices = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"--reasoning-parser: unknown reasoning parser {name!r}; choose one of {choices}")
    return REASONING_PARSERS[name]


def build_reasoning_parser(name: str, config: ReasoningConfig | None) -> ReasoningParser:
    """The parser ``name`` over the engine's think ids; a ValueError when it has no single ids (NOTE 4)."""
    parser = reasoning_parser_class(name)
    start = () if config is None else config.reasoning_start_token_ids
    end = () if config is None else config.reasoning_end_token_ids
    if len(start) != 1 or len(end) != 1:
        have = "none" if config is None else f"start {list(start)}, end {list(end)}"
        raise ValueError(
            f"--reasoning-parser {name} needs the model's think start and end as one token each "
            f"(<think> and </think> in its vocabulary, or a reasoning_config of one id each); it has {have}"
        )  # fmt: skip
    return parser(start[0], end[0])
# --8<-- [end:parsers]


def think_section_open(token_ids: Sequence[int], parser: ReasoningParser) -> bool:
    """Whether ``token_ids`` (a prompt) leave a think section open: a start token after the last end token."""
    for token_id in reversed(token_ids):
        if token_id == parser.end_token_id:
            return False
        if token_id == parser.start_token_id:
            return True
    return False


def request_thinks(parser: ReasoningParser, chat_template_kwargs: Mapping[str, Any] | None,
                   prompt_token_ids: Sequence[int], constrained: bool, enable_in_reasoning: bool) -> bool:  # fmt: skip
    """NOTE 2: whether an output of this request starts inside a think section: the parser says
    so, and no grammar applies from the first token (``constrained``: the request has one)."""
    if not parser.thinks(chat_template_kwargs):
        return False
    grammar_from_first_token = constrained and (enable_in_reasoning or not think_section_open(prompt_token_ids, parser))
    return not grammar_from_first_token


# --8<-- [start:split]
class ReasoningSplit:
    """One choice's output as reasoning and content, piece by piece (module docstring)."""

    def __init__(self, parser: ReasoningParser, thinks: bool, decode: Decode) -> None:
        self.parser, self.decode = parser, decode
        self.token_ids: list[int] = []
        self.text = ""  # the engine's text so far
        self.left_out: list[tuple[int, int]] = []  # think tokens' characters in ``text`` (NOTE 1, 3)
        self.content_from: int | None = None if thinks else 0  # where content starts, once known
        self.reasoning = ""  # every piece returned so far, joined
        self.content = ""

    def update(self, text: str, token_ids: Sequence[int]) -> tuple[str, str]:
        """Take one output's new text and token ids; return its new ``(reasoning, content)``."""
        think_ids = (self.parser.start_token_id, self.parser.end_token_id)
        for token_id in token_ids:
            self.token_ids.append(token_id)
            if self.content_from is None and token_id in think_ids:
                span = (len(self.decode(self.token_ids[:-1])), len(self.decode(self.token_ids)))  # NOTE 1
                self.left_out.append(span)
                if token_id == self.parser.end_token_id:
                    self.content_from = span[1]
        lo = len(self.text)
        self.text += text
        reasoning, content = self._route(lo, len(self.text))
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def _route(self, lo: int, hi: int) -> tuple[str, str]:
        """The characters ``text[lo:hi]``, each to the reasoning, the content or nowhere."""
        marks = [p for span in self.left_out for p in span]
        if self.content_from is not None:
            marks.append(self.content_from)
        cuts = sorted({lo, hi, *(p for p in marks if lo < p < hi)})
        reasoning, content = [], []
        for a, b in zip(cuts, cuts[1:]):
            if any(x <= a < y for x, y in self.left_out):
                continue  # a think token's own text
            in_content = self.content_from is not None and a >= self.content_from
            (content if in_content else reasoning).append(self.text[a:b])
        return "".join(reasoning), "".join(content)
# --8<-- [end:split]


def split_reasoning(parser: ReasoningParser, thinks: bool, decode: Decode, text: str,
                    token_ids: Sequence[int]) -> tuple[str | None, str | None]:  # fmt: skip
    """A whole output's ``(reasoning, content)``, each None when empty (as vLLM's message)."""
    split = ReasoningSplit(parser, thinks, decode)
    split.update(text, token_ids)
    return split.reasoning or None, split.content or None
