"""Constrained output over HTTP: ``response_format``, ``structured_outputs`` and ``tools`` as one
``StructuredOutputsParams``, and a tool choice's calls read back out of the constrained text.

Concept: three request fields ask for the same engine feature (``structured_output/``): OpenAI's
``response_format`` (``json_object``, or ``json_schema`` with its ``schema``), vLLM's
``structured_outputs`` extra field (any one of ``json``, ``regex``, ``choice``, ``grammar``,
``json_object``), and chat's ``tools`` with a ``tool_choice`` that forces a call. ``constraint``
turns the one a request sent into ``(request field, StructuredOutputsParams)``; the engine parses
it (a bad schema, regex or grammar is its ValueError, which ``serving.py`` answers as a 400 naming
that request field). ``tool_calls`` turns a tool choice's text into OpenAI's ``tool_calls``.

Mirrors: ``vllm/entrypoints/openai/protocol.py`` (``to_sampling_params``: ``response_format`` and
``structured_outputs``; ``_get_json_schema_from_tool``), ``vllm/entrypoints/openai/tool_parsers/utils.py``
(the schema of ``tool_choice: "required"``) and ``serving_chat.py`` (the calls of a named or
required tool choice, ``finish_reason: "tool_calls"``).

Invariants: at most one constraint per request (NOTE 1); every refusal here is a ``RequestError``
naming the request field, raised before anything reaches the engine; pure functions of the body.

NOTE 1 (one constraint): ``response_format`` (other than ``text``), ``structured_outputs`` and a
forcing ``tool_choice`` each set the request's one grammar, so two of them is a 400 naming both.
NOTE 2 (``tool_choice: "required"``, vLLM's schema): the output is a JSON array of one or more
``{"name": <a tool's name>, "parameters": <its parameters>}`` objects (vLLM's key, ``parameters``;
each becomes a call whose ``arguments`` is the JSON text of ``parameters``), ``minItems`` 1;
``parallel_tool_calls: false`` adds ``maxItems`` 1. The tools' ``$defs`` move to the top of the
schema, where their ``$ref`` paths point. Unlike vLLM, a tool choice's JSON is compact
(``disable_any_whitespace``): calls are read by programs, and a small model left free to
write whitespace spends its tokens on it (the shipped model runs out of ``max_tokens``).
NOTE 3 (a named function): the output is the function's arguments, constrained to its
``parameters`` schema (no parameters: ``{"type": "object", "properties": {}}``), returned as one
call; ``finish_reason`` is the engine's ("stop"), as OpenAI and vLLM answer a forced function.
A required choice that stops with an array that parses answers ``finish_reason: "tool_calls"``;
one cut short (``length``) answers its text as ``content``, with no calls.
NOTE 4 (``tool_choice: "auto"``, the default when ``tools`` is sent): no constraint; the model
decides whether to call, in its own format, read by the parser the server was started with
(vLLM's ``--enable-auto-tool-choice --tool-call-parser hermes``: Qwen3's and Hermes'
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, ``hermes_tool_calls``); without
one it is a 400 naming ``tool_choice``. Calls found: ``finish_reason`` "tool_calls", the text
before the first call is ``content`` (None if empty), as vLLM's hermes parser answers.
``tool_choice: "none"`` ignores the tools (they still reach the chat template, as in vLLM).
NOTE 5 (informational parts): ``json_schema.strict`` and ``name``, and a function's ``strict``
and ``description``, change nothing (xgrammar always follows the schema exactly).
NOTE 6 (streaming, ``choices.py``): a named function's arguments stream as ``tool_calls``
deltas (the first with the call's id, type and name); a required choice's array streams nothing
until it ends, then its calls come whole in the last chunk (an array must parse first); an auto
choice's text streams as content up to where ``<tool_call>`` may begin, its calls come last.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tinyvllm.entrypoints.protocol import ChatCompletionRequest, NamedToolChoice, RequestError
from tinyvllm.sampling_params import StructuredOutputsParams

NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without ``parameters`` (NOTE 3)
TOOL_CALL_PARSERS = ("hermes",)  # --tool-call-parser's choices (NOTE 4)
TOOL_CALL_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolChoice:
    """A ``tool_choice`` that calls tools: ``named`` (one function), ``required`` (any, NOTE 2),
    or ``auto`` (the model's choice, read by a parser, NOTE 4; no schema)."""

    kind: Literal["named", "required", "auto"]
    schema: dict[str, Any]
    name: str | None = None  # the named function


# --8<-- [start:constraint]
def constraint(body, parser: str | None = None) -> tuple[str, StructuredOutputsParams] | None:
    """``(request field, params)`` for the one constraint ``body`` asks for, else None (NOTE 1);
    ``parser``: the server's tool-call parser (NOTE 4)."""
    tool = tool_choice(body, parser) if isinstance(body, ChatCompletionRequest) else None
    asked = [name for name, given in (
        ("response_format", body.response_format is not None and body.response_format.type != "text"),
        ("structured_outputs", body.structured_outputs is not None),
        ("tool_choice", tool is not None and tool.kind != "auto")) if given]  # fmt: skip
    if len(asked) > 1:
        raise RequestError(f"send one of {' and '.join(f'`{n}`' for n in asked)}: each sets the output's "
                           "one constraint", asked[-1])  # fmt: skip
    if tool is not None and body.echo:
        raise RequestError("`echo` cannot be combined with a `tool_choice` that calls a tool", "echo")
    if not asked:
        return None
    field = asked[0]
    if field == "tool_choice":
        return "tools", StructuredOutputsParams(json=tool.schema, disable_any_whitespace=True)  # NOTE 2
    try:
        return field, (_response_format(body.response_format) if field == "response_format"
                       else _structured_outputs(body.structured_outputs))  # fmt: skip
    except (TypeError, ValueError) as error:
        raise RequestError(f"`{field}`: {error}", field) from None
# --8<-- [end:constraint]


def _response_format(value) -> StructuredOutputsParams:
    if value.type == "json_object":
        if value.json_schema is not None:
            raise ValueError("`json_schema` is read only with type json_schema")
        return StructuredOutputsParams(json_object=True)
    if value.json_schema is None or value.json_schema.json_schema is None:
        raise ValueError("type json_schema needs `json_schema` with its `schema` (a JSON schema object)")
    return StructuredOutputsParams(json=value.json_schema.json_schema)


def _structured_outputs(value) -> StructuredOutputsParams:
    given = value.model_dump(exclude_none=True, by_alias=True)
    return StructuredOutputsParams(**{**given, "disable_any_whitespace": bool(given.get("disable_any_whitespace"))})


# --8<-- [start:tool_choice]
def tool_choice(body: ChatCompletionRequest, parser: str | None = None) -> ToolChoice | None:
    """The tool choice of a chat request, with its schema (NOTE 2, 3); None when the tools
    call nothing (none sent, ``tool_choice: "none"``). "auto" needs ``parser`` (NOTE 4)."""
    tools, choice = body.tools or [], body.tool_choice
    if choice == "none" or (choice is None and not tools):
        return None
    if not tools:
        raise RequestError("`tool_choice` needs `tools`: the functions the model may call", "tool_choice")
    if (choice is None or choice == "auto") and parser is None:
        raise RequestError(
            '`tool_choice: "auto"` (the default when `tools` is sent) needs a parser for the model\'s own tool-call '
            "format: start the server with --enable-auto-tool-choice --tool-call-parser hermes (Qwen3's format), "
            'or send `tool_choice: "required"` or name a function', "tool_choice",
        )  # fmt: skip
    by_name: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if tool.function.name in by_name:
            raise RequestError(f"`tools` names the function {tool.function.name!r} twice", "tools")
        by_name[tool.function.name] = copy.deepcopy(tool.function.parameters or NO_PARAMETERS)
    if choice is None or choice == "auto":
        return ToolChoice("auto", {})
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in by_name:
            raise RequestError(f"`tool_choice` names the function {name!r}, which is not in `tools` "
                               f"({', '.join(sorted(by_name))})", "tool_choice")  # fmt: skip
        return ToolChoice("named", by_name[name], name)
    defs: dict[str, Any] = {}
    for name, parameters in by_name.items():
        for key, value in parameters.pop("$defs", {}).items():  # hoisted where "#/$defs/..." points (NOTE 2)
            if defs.setdefault(key, value) != value:
                raise RequestError(f"`tools` define the schema $defs/{key} twice, differently", "tools")
    calls = [{"properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
              "required": ["name", "parameters"]} for name, parameters in by_name.items()]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return ToolChoice("required", schema)
# --8<-- [end:tool_choice]


# --8<-- [start:tool_calls]
def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


def tool_calls(tool: ToolChoice, text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    """``(content, calls)`` of a tool choice's ``text``, each call ``(name, arguments)``: a named
    function's text is its arguments; a required choice's is an array of calls (NOTE 2); an auto
    choice's is read by the parser (NOTE 4). No calls (None): the text is the content."""
    if tool.kind == "named":
        return "", [(tool.name, text)]
    if tool.kind == "auto":
        return hermes_tool_calls(text)
    try:
        items = json.loads(text)
    except ValueError:
        return text, None
    if not isinstance(items, list) or not all(isinstance(i, dict) and {"name", "parameters"} <= set(i) for i in items):
        return text, None
    return "", [(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def hermes_tool_calls(text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
    """NOTE 4: the ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks of ``text``
    (the last may be unclosed) as calls, the text before the first as content; a block that
    is not such JSON: no calls, the whole text is the content."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, None
    calls = []
    for closed, unclosed in _HERMES.findall(text):
        try:
            call = json.loads(closed or unclosed)
            calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):
            return text, None
    return text[:start] or None, calls


def held_back(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>`` (not streamed yet)."""
    return next((k for k in range(len(TOOL_CALL_START) - 1, 0, -1) if text.endswith(TOOL_CALL_START[:k])), 0)


def tool_call_json(name: str, arguments: str, call_id: str | None = None, index: int | None = None) -> dict:
    """One of OpenAI's ``tool_calls``; ``index`` for a streamed delta."""
    call: dict[str, Any] = {} if index is None else {"index": index}
    call.update(id=call_id or new_tool_call_id(), type="function", function={"name": name, "arguments": arguments})
    return call
# --8<-- [end:tool_calls]
