"""Choices: a request's outputs as OpenAI's ``choices``, streamed piece by piece or whole.

Concept: one HTTP request runs one engine request per prompt (a completion may send a
list of prompts), and each engine request makes ``n`` completions. Each completion is a
choice, numbered ``prompt_index * n + completion.index`` as vLLM numbers them. The server
runs every request as DELTA (``openai_server.py``), so ``ChoiceBuilder.update`` takes each
output's new text, token ids and logprobs, keeps them per choice, and returns what a
streamed chunk carries; ``choices`` and ``usage`` give the non-streamed answer at the end.

Mirrors: ``vllm/entrypoints/openai/serving_completion.py`` (``completion_stream_generator``,
``request_output_to_completion_response``) and ``serving_chat.py``
(``chat_completion_stream_generator``, ``chat_completion_full_generator``).

Invariants: it never sees the HTTP layer and needs no tokenizer but ``decode`` (for a
logprob's token without text, ``logprobs_format.py`` NOTE 1), so it is tested with
hand-built ``RequestOutput`` values. A choice's text, token ids and logprobs are the
joins of its deltas; ``usage.completion_tokens`` counts every token of every choice.

NOTE 1 (echo): completions' ``echo`` puts the prompt's text before the first piece of each
choice, and, with ``logprobs``, the prompt's tokens and logprobs before the choice's own
(the first prompt token's logprob is None). ``echo`` with ``max_tokens: 0`` returns the
prompt alone (``drop_output``): the engine runs one token, which is left out, as vLLM
does. Chat's echo (``chat.py`` NOTE 2) is the text in ``PromptState.echo``, without logprobs.
NOTE 2 (chunks): a streamed output becomes one chunk per choice that changed; a chunk is
sent when it has text, logprobs or a finish reason. A chat stream opens each choice with
``{"role": "assistant", "content": ""}``, then its echo, if any, as vLLM's does.
NOTE 3 (tool calls, ``constraints.py`` NOTE 3; streamed, ``constraints.py`` NOTE 6): with a
``tool_choice`` that calls, a chat choice's calls are read out of its text into ``tool_calls``
(``content``: "" for a named or required choice, the text before the calls for auto); a named
function's arguments stream as deltas, a required choice's calls come whole with the finish
(its text held back until then), an auto choice's text streams until a call may begin.
NOTE 4 (reasoning, ``reasoning.py``): with ``--reasoning-parser`` each chat choice has its own
``ReasoningSplit``; a message carries ``reasoning`` and ``content`` (each None when empty), a chunk
``delta.reasoning`` and ``delta.content``. Everything else reads the content alone: the echo goes
before it, tool calls are parsed from it (NOTE 3); ``include_reasoning: false`` drops the
reasoning, not its logprobs (a chunk with no text still carries them). Token ids, logprobs and
``usage`` count every token, as without a parser.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tinyvllm.entrypoints.constraints import (
    TOOL_CALL_START,
    ToolChoice,
    held_back,
    new_tool_call_id,
    tool_call_json,
    tool_calls,
)
from tinyvllm.entrypoints.logprobs_format import Decode, chat_logprobs, completion_logprobs, prompt_logprobs_json
from tinyvllm.entrypoints.reasoning import ReasoningSplit
from tinyvllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass
class PromptState:
    """One prompt of the request, as the engine saw it."""

    token_ids: list[int]
    echo: str = ""  # what echo puts before each choice's text (NOTE 1)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class ChoiceState:
    index: int
    prompt: PromptState
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text_length: int = 0  # characters of the choice's text so far, echo included (text_offset)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    opened: bool = False
    tool_call_id: str | None = None  # a named function's streamed call (NOTE 3)
    sent: int = 0  # characters of a tool choice's text streamed as content (NOTE 3)
    split: ReasoningSplit | None = None  # with a reasoning parser (NOTE 4)


@dataclass
class ChoiceBuilder:
    """The choices of one request (module docstring)."""

    prompts: list[PromptState]
    n: int
    chat: bool
    decode: Decode
    logprobs: int | None = None  # k, when the request asked for logprobs
    echo: bool = False  # put each prompt's ``echo`` text (and, for completions, its logprobs) first
    as_token_id: bool = False
    drop_output: bool = False  # echo with max_tokens 0 (NOTE 1)
    want_prompt_logprobs: bool = False
    tool: ToolChoice | None = None  # chat's tool_choice, when it calls tools (NOTE 3)
    reasoning: Callable[[], ReasoningSplit] | None = None  # a new choice's split, with a reasoning parser (NOTE 4)
    include_reasoning: bool = True  # False: the reasoning is dropped (NOTE 4)
    choices_by_index: dict[int, ChoiceState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                index = p * self.n + j
                split = self.reasoning() if self.reasoning is not None else None
                self.choices_by_index[index] = ChoiceState(index, prompt, split=split)

    # --8<-- [start:update]
    def update(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Take one DELTA output of prompt ``prompt_index``; return the streamed choices it makes (NOTE 2)."""
        prompt = self.prompts[prompt_index]
        prompt.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and prompt.prompt_logprobs is None:
            prompt.prompt_logprobs = out.prompt_logprobs
        streamed = []
        for completion in out.outputs:
            choice = self.choices_by_index[prompt_index * self.n + completion.index]
            streamed.extend(self._update_choice(choice, completion))
        return streamed
    # --8<-- [end:update]

    def _update_choice(self, choice: ChoiceState, completion: CompletionOutput) -> list[dict]:
        chunks = []
        if not choice.opened:
            choice.opened = True
            chunks.extend(self._open(choice))
        if completion.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        if self.drop_output:
            text, ids, positions = "", [], []
        else:
            text, ids = completion.text, list(completion.token_ids)
            positions = list(completion.logprobs or []) if self.logprobs is not None else []
        offset = choice.text_length
        choice.pieces.append(text)
        choice.token_ids.extend(ids)
        choice.logprobs.extend(positions)
        choice.text_length += len(text)
        reasoning, content = ("", text) if choice.split is None else choice.split.update(text, ids)  # NOTE 4
        reasoning = reasoning if self.include_reasoning else ""
        logprobs = self._format(ids, positions, offset) if self.logprobs is not None and ids else None
        if self.tool is not None:
            return chunks + self._tool_chunks(choice, content, reasoning, logprobs, completion.finish_reason is not None)
        if reasoning or content or logprobs or completion.finish_reason is not None:
            chunk = self._choice(choice, content, logprobs, reasoning=reasoning)
            chunk["finish_reason"], chunk["stop_reason"] = choice.finish_reason, choice.stop_reason
            chunks.append(chunk)
        return chunks

    # --8<-- [start:tool_chunks]
    def _tool_chunks(self, choice: ChoiceState, text: str, reasoning: str, logprobs: dict | None,
                     finished: bool) -> list[dict]:  # fmt: skip
        """NOTE 3: a named function's arguments as ``tool_calls`` deltas; an auto choice's text up
        to where a call may begin; at the finish, the rest: the calls, or the text held back.
        ``text``: the new content; ``reasoning``, streamed as it is (NOTE 4)."""
        delta: dict = {}
        reason = choice.finish_reason
        if self.tool.kind == "named":
            if text:
                call: dict = {"index": 0, "function": {"arguments": text}}
                if choice.tool_call_id is None:
                    choice.tool_call_id = new_tool_call_id()
                    call = tool_call_json(self.tool.name, text, choice.tool_call_id, index=0)
                delta = {"tool_calls": [call]}
        elif not finished:
            if self.tool.kind == "auto":  # a required choice's array streams nothing until it parses
                joined = self._content(choice)
                start = joined.find(TOOL_CALL_START)
                safe = start if start >= 0 else len(joined) - held_back(joined)
                if safe > choice.sent:
                    delta, choice.sent = {"content": joined[choice.sent : safe]}, safe
        else:
            content, calls, reason = self._calls(choice)
            rest = (content or "")[choice.sent :]
            delta = {"content": rest} if rest else {}
            if calls:
                delta["tool_calls"] = [tool_call_json(n, a, index=i) for i, (n, a) in enumerate(calls)]
        if reasoning:
            delta = {"reasoning": reasoning, **delta}
        if not (delta or logprobs or finished):
            return []
        chunk = self._choice(choice, "", logprobs)
        chunk["delta"], chunk["finish_reason"], chunk["stop_reason"] = delta, reason, choice.stop_reason
        return [chunk]

    def _calls(self, choice: ChoiceState) -> tuple[str | None, list[tuple[str, str]] | None, str | None]:
        """The choice's content, calls and finish reason: "tool_calls" for calls a required choice
        stopped with (``constraints.py`` NOTE 3), or an auto choice made (``constraints.py`` NOTE 4)."""
        content, calls = tool_calls(self.tool, self._content(choice))
        kind = self.tool.kind
        called = calls and (kind == "auto" or (kind == "required" and choice.finish_reason == "stop"))
        return content, calls, "tool_calls" if called else choice.finish_reason
    # --8<-- [end:tool_chunks]

    def _open(self, choice: ChoiceState) -> list[dict]:
        """The chunks that open a choice: chat's role, then the echo (NOTE 1, NOTE 2)."""
        chunks = [self._choice(choice, "", None, role=True)] if self.chat else []
        if not self.echo:
            return chunks
        prompt = choice.prompt
        logprobs = None
        if self.echo_logprobs:
            logprobs = self._format(prompt.token_ids, self._prompt_positions(prompt), 0)
        choice.pieces.append(prompt.echo)
        choice.text_length += len(prompt.echo)
        if prompt.echo or logprobs:
            chunks.append(self._choice(choice, prompt.echo, logprobs))
        return chunks

    def _content(self, choice: ChoiceState) -> str:
        """The choice's text so far, echo included; with a reasoning parser, its content (NOTE 4)."""
        if choice.split is None:
            return "".join(choice.pieces)
        return (choice.prompt.echo if self.echo else "") + choice.split.content

    @property
    def echo_logprobs(self) -> bool:
        """Completions' echo with logprobs: the prompt's tokens lead the choice's logprobs (NOTE 1)."""
        return self.echo and self.logprobs is not None and not self.chat

    @staticmethod
    def _prompt_positions(prompt: PromptState) -> list[PositionLogprobs | None]:
        return list(prompt.prompt_logprobs or [None] * len(prompt.token_ids))

    def _format(self, ids: list[int], positions: list, offset: int) -> dict:
        if self.chat:
            return chat_logprobs(ids, positions, self.logprobs, self.decode, self.as_token_id)
        return completion_logprobs(ids, positions, self.logprobs, self.decode, self.as_token_id, offset)

    def _choice(self, choice: ChoiceState, text: str, logprobs: dict | None, role: bool = False,
                reasoning: str = "") -> dict:  # fmt: skip
        """One streamed choice: chat's ``delta`` (``reasoning`` first, NOTE 4) or completions' ``text``."""
        out: dict = {"index": choice.index}
        if self.chat:
            delta = {"reasoning": reasoning} if reasoning else {}
            out["delta"] = {"role": "assistant", "content": ""} if role else ({**delta, "content": text} if text else delta)
        else:
            out["text"] = text
        out["logprobs"] = logprobs
        out["finish_reason"] = None
        return out

    # -- the whole answer ---------------------------------------------------------------------

    # --8<-- [start:choices]
    def choices(self) -> list[dict]:
        """The non-streamed ``choices``, in index order."""
        out = []
        for index in sorted(self.choices_by_index):
            choice = self.choices_by_index[index]
            text = self._content(choice)
            item: dict = {"index": index}
            finish_reason = choice.finish_reason
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
                if choice.split is not None:  # NOTE 4
                    reasoning = choice.split.reasoning if self.include_reasoning else ""
                    item["message"].update(content=text or None, reasoning=reasoning or None)
                if self.tool is not None:  # NOTE 3
                    content, calls, finish_reason = self._calls(choice)
                    item["message"]["content"] = content
                    if calls:
                        item["message"]["tool_calls"] = [tool_call_json(n, a) for n, a in calls]
            else:
                item["text"] = text
            item["logprobs"] = self._final_logprobs(choice) if self.logprobs is not None else None
            item["finish_reason"], item["stop_reason"] = finish_reason, choice.stop_reason
            if not self.chat and self.want_prompt_logprobs:
                item["prompt_logprobs"] = prompt_logprobs_json(choice.prompt.prompt_logprobs or [])
            out.append(item)
        return out
    # --8<-- [end:choices]

    def _final_logprobs(self, choice: ChoiceState) -> dict:
        ids, positions = choice.token_ids, choice.logprobs
        if self.echo_logprobs:
            ids = choice.prompt.token_ids + ids
            positions = self._prompt_positions(choice.prompt) + positions
        return self._format(ids, positions, 0)

    def prompt_logprobs(self) -> list[dict | None] | None:
        """Chat's top-level ``prompt_logprobs`` (its one prompt's), when asked for."""
        if not self.want_prompt_logprobs:
            return None
        return prompt_logprobs_json(self.prompts[0].prompt_logprobs or [])

    def usage(self) -> dict:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices_by_index.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(p.num_cached_tokens for p in self.prompts)},
        }
