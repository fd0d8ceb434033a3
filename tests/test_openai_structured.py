"""Structured outputs and tool calls over HTTP (``entrypoints/constraints.py``), with the real ``openai`` client.

Pinned down here: the pure mapping (which request field becomes which ``StructuredOutputsParams``,
the schema of ``tool_choice: "required"``), then, against the shipped model served in-process
(one server for the module): ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``structured_outputs`` extra field (``choice``, ``regex``) on both endpoints; a bad schema, a bad
regex, two constraints at once, each a 400 naming the field; streaming; ``tools`` with a named and
a required ``tool_choice`` answering ``tool_calls`` whose arguments validate against the
function's schema, streamed and not; ``tool_choice: "auto"`` refused by name, and, on a server
started with the hermes parser, read out of the text (``<tool_call>`` blocks the test forces with
a regex, since the shipped model never writes one). The shipped model is small: each prompt here
is one it completes (``finish_reason: "stop"``) under its constraint.
"""

from __future__ import annotations

import json
import re

import pytest
from serve_fixtures import require_serve_extra, running_server

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection
pytest.importorskip("xgrammar")  # the engine's grammars

import openai  # noqa: E402

from tinyvllm import LLM  # noqa: E402
from tinyvllm.entrypoints.constraints import (  # noqa: E402
    ToolChoice,
    constraint,
    held_back,
    hermes_tool_calls,
    tool_calls,
    tool_choice,
)
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, RequestError  # noqa: E402
from tinyvllm.sampling_params import StructuredOutputsParams as SO  # noqa: E402

NAME = "stdlib_tiny"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"


def valid(value, schema: dict) -> bool:
    """``value`` against the small object schemas above, by hand (jsonschema is not a dependency)."""
    kinds = {"string": str, "integer": int}
    props = schema["properties"]
    if not isinstance(value, dict) or set(value) - set(props) or not set(schema["required"]) <= set(value):
        return False
    for key, item in value.items():
        rule = props[key]
        if not isinstance(item, kinds[rule["type"]]) or isinstance(item, bool):
            return False
        size = len(item) if isinstance(item, str) else None
        if size is not None and size > rule.get("maxLength", size):
            return False
        if size is None and not rule.get("minimum", item) <= item <= rule.get("maximum", item):
            return False
    return True


def chat_body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


# -- the mapping, without a server -------------------------------------------------------------


def test_each_field_becomes_one_structured_outputs_params():
    json_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert constraint(chat_body(response_format={"type": "text"})) is None
    assert constraint(chat_body(response_format={"type": "json_object"})) == ("response_format", SO(json_object=True))
    assert constraint(chat_body(response_format=json_schema)) == ("response_format", SO(json=PERSON))
    regex = {"regex": "[0-9]+", "disable_any_whitespace": True}
    assert constraint(CompletionRequest(prompt="p", structured_outputs=regex)) == (
        "structured_outputs", SO(regex="[0-9]+", disable_any_whitespace=True))  # fmt: skip
    choice = CompletionRequest.model_validate({"prompt": "p", "structured_outputs": {"choice": ["a", "b"]}})
    assert constraint(choice) == ("structured_outputs", SO(choice=("a", "b")))
    named = chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert constraint(named) == ("tools", SO(json=ADD, disable_any_whitespace=True))
    assert constraint(chat_body(tools=TOOLS, tool_choice="none")) is None


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "send one of `response_format` and `structured_outputs`"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of json, regex"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of json, regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs `json_schema` with its `schema`"),
    ({"tools": TOOLS}, "tool_choice", '`tool_choice: "auto"` (the default when `tools` is sent) needs a parser'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice --tool-call-parser hermes"),
    ({"tools": TOOLS, "tool_choice": "required", "echo": True}, "echo", "`echo` cannot be combined with a `tool_choice`"),
    ({"tool_choice": "required"}, "tool_choice", "`tool_choice` needs `tools`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names the function 'nope', which is not in `tools` (add, get_weather)"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "names the function 'get_weather' twice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "send one of `response_format` and `tool_choice`"),
])  # fmt: skip
def test_a_constraint_the_server_cannot_take_is_refused_naming_the_field(fields, param, words):
    with pytest.raises(RequestError) as info:
        constraint(chat_body(**fields))
    assert info.value.param == param and words in str(info.value), str(info.value)


def test_required_is_an_array_of_named_calls_with_the_tools_defs_on_top():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "$defs": {"point": point}}}},
        {"type": "function", "function": {"name": "stop"}}]  # fmt: skip
    schema = tool_choice(chat_body(tools=tools, tool_choice="required", parallel_tool_calls=False)).schema
    assert schema == {
        "type": "array", "minItems": 1, "maxItems": 1, "$defs": {"point": point},
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["move"]},
                            "parameters": {"type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["stop"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]},
    }  # fmt: skip
    assert tools[0]["function"]["parameters"]["$defs"] == {"point": point}, "the request's own schema is left as sent"
    required = tool_choice(chat_body(tools=tools, tool_choice="required"))
    assert "maxItems" not in required.schema
    assert tool_calls(required, '[{"name": "stop", "parameters": {}}, {"name": "move", "parameters": {"to": {"x": 1}}}]') \
        == ("", [("stop", "{}"), ("move", '{"to": {"x": 1}}')])  # fmt: skip
    assert tool_calls(required, '[{"name": "stop", "param') == ('[{"name": "stop", "param', None)  # cut short: text


def test_the_hermes_parser_reads_qwen3_tool_call_blocks():
    auto = tool_choice(chat_body(tools=TOOLS), parser="hermes")
    assert auto == ToolChoice("auto", {}) and constraint(chat_body(tools=TOOLS), parser="hermes") is None
    assert constraint(chat_body(tools=TOOLS, structured_outputs={"regex": "a"}), parser="hermes")[0] == "structured_outputs"
    two = ('Let me.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}')  # the last one unclosed
    assert tool_calls(auto, two) == ("Let me.\n", [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Paris"}')])
    assert hermes_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>') == (None, [("add", "{}")])
    assert hermes_tool_calls("def f(): pass") == ("def f(): pass", None)
    assert hermes_tool_calls("x <tool_call>{not json</tool_call>") == ("x <tool_call>{not json</tool_call>", None)
    assert hermes_tool_calls('<tool_call>["add"]</tool_call>') == ('<tool_call>["add"]</tool_call>', None)
    assert [held_back(t) for t in ("abc", "abc<", "abc<tool_", "abc<tool_call", "a<b", "<tool_call>")] == [0, 1, 6, 10, 0, 0]


# -- over HTTP, on the shipped model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    llm = LLM(torch_threads=1)
    try:
        with running_server(llm, NAME) as (url, _):
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        llm.engine.shutdown()


def ask(client, **kwargs):
    """Chat, greedy, with one user message ``ask`` (default), or a completion when ``prompt`` is given."""
    kwargs = {"model": NAME, "temperature": 0, "max_tokens": 60, **kwargs}
    if "prompt" in kwargs:
        return client.completions.create(**kwargs)
    kwargs["messages"] = [{"role": "user", "content": kwargs.pop("ask", "Give a person as JSON.")}]
    return client.chat.completions.create(**kwargs)


def test_response_format_json_object_and_json_schema(client):
    out = ask(client, response_format={"type": "json_object"})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict), choice
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = ask(client, prompt="Call a function.", extra_body={"response_format": schema})
    assert out.choices[0].finish_reason == "stop" and valid(json.loads(out.choices[0].text), PERSON), out.choices[0]
    compact = {"json": PERSON, "disable_any_whitespace": True}  # vLLM's field: whitespace off, any prompt finishes
    out = ask(client, extra_body={"structured_outputs": compact})
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and valid(json.loads(text), PERSON) and "\n" not in text, text


def test_the_structured_outputs_field_takes_a_choice_and_a_regex(client):
    out = ask(client, prompt="Is the sky blue?", max_tokens=10, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("no", "stop")
    out = ask(client, ask="Email?", max_tokens=30, extra_body={"structured_outputs": {"regex": EMAIL}})
    assert re.fullmatch(EMAIL, out.choices[0].message.content) and out.choices[0].finish_reason == "stop", out


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "structured_outputs regex is not a valid regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format json is not a valid json"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "structured_outputs grammar is not a valid grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "`structured_outputs.regex` must be a string"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs", "`structured_outputs.json` must be an object or string or null"),
])  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_the_field(client, extra, param, words):
    for api in ("completions", "chat"):
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, extra_body=extra, **({"prompt": "x"} if api == "completions" else {}))
        error = info.value.response.json()["error"]
        assert (error["code"], error["param"]) == (400, param) and words in error["message"], error


def test_constrained_answers_stream(client):
    chunks = list(ask(client, ask="Email?", max_tokens=30, stream=True, extra_body={"structured_outputs": {"regex": EMAIL}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = ask(client, ask="Email?", max_tokens=30, extra_body={"structured_outputs": {"regex": EMAIL}})
    assert text == whole.choices[0].message.content and re.fullmatch(EMAIL, text)
    assert chunks[-1].choices[0].finish_reason == "stop"
    yes_no = {"structured_outputs": {"choice": ["yes", "no"]}}
    chunks = list(ask(client, prompt="Is the sky blue?", stream=True, extra_body=yes_no))
    assert "".join(c.choices[0].text for c in chunks) == "no"


def call_of(call) -> tuple[str, dict]:
    """A tool call's name and its arguments, parsed; both checked against ``TOOLS``."""
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert valid(arguments, SCHEMAS[call.function.name]), (call.function.name, arguments)
    return call.function.name, arguments


def test_a_named_function_answers_one_tool_call_whose_arguments_fit_its_schema(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = ask(client, ask="What is the weather in Paris?", tools=TOOLS, tool_choice=named)
    choice = out.choices[0]
    assert (choice.finish_reason, choice.message.content, len(choice.message.tool_calls)) == ("stop", "", 1)
    name, arguments = call_of(choice.message.tool_calls[0])
    assert name == "get_weather" and set(arguments) == {"city"}
    chunks = [c for c in ask(client, ask="What is the weather in Paris?", tools=TOOLS, tool_choice=named, stream=True)
              if c.choices]  # fmt: skip
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("chatcmpl-tool-") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:]), "one call: its id and name once, then arguments"
    assert "".join(d.function.arguments for d in deltas) == choice.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_required_answers_tool_calls_with_finish_reason_tool_calls(client):
    for prompt in ("What is the weather in Paris?", "add(1, 2)"):
        out = ask(client, ask=prompt, max_tokens=80, tools=TOOLS, tool_choice="required")
        choice = out.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", ""), choice
        calls = choice.message.tool_calls
        assert calls and all(call_of(call)[0] in SCHEMAS for call in calls), calls
    out = ask(client, ask="add(1, 2)", max_tokens=80, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(out.choices[0].message.tool_calls) == 1
    chunks = [c for c in ask(client, ask="add(1, 2)", max_tokens=80, tools=TOOLS, tool_choice="required",
                             parallel_tool_calls=False, stream=True) if c.choices]  # fmt: skip
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [c.choices[0].delta.content for c in chunks] == ["", None], "the array is held back, then comes whole"
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls] == \
        [(0, *call_of(out.choices[0].message.tool_calls[0]))]  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_auto_is_refused_and_none_ignores_the_tools(client):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, tools=TOOLS)
    assert info.value.response.json()["error"]["param"] == "tool_choice"
    plain, ignored = ask(client, max_tokens=8), ask(client, max_tokens=8, tools=TOOLS, tool_choice="none")
    assert ignored.choices[0].message.content == plain.choices[0].message.content
    assert ignored.choices[0].message.tool_calls is None


def test_the_tools_reach_the_chat_template(client):
    """As vLLM renders them: a template that lists the functions sees them, on /tokenize as on chat."""
    import httpx

    template = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    url = str(client.base_url).removesuffix("v1/")
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template, "tools": TOOLS}
    rendered = httpx.post(url + "tokenize", json=body).json()["tokens"]
    assert rendered == httpx.post(url + "tokenize", json={"prompt": "get_weather;add;hi", "add_special_tokens": False}).json()["tokens"]


def test_auto_with_the_hermes_parser_answers_the_calls_the_model_writes():
    """``tool_choice: "auto"`` on a server started with the hermes parser (``--tool-call-parser
    hermes``): a regex makes the shipped model write Qwen3's block, which comes back as a call."""
    llm = LLM(torch_threads=1)
    block = r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
    try:
        with running_server(llm, NAME, tool_call_parser="hermes") as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            out = ask(client, ask="add(1, 2)", tools=TOOLS, extra_body={"structured_outputs": {"regex": block}})
            choice = out.choices[0]
            assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Sure. "), choice
            [call] = choice.message.tool_calls
            assert call_of(call)[0] == "add"
            chunks = [c for c in ask(client, ask="add(1, 2)", tools=TOOLS, stream=True,
                                     extra_body={"structured_outputs": {"regex": block}}) if c.choices]  # fmt: skip
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure. "
            [streamed] = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
            assert (streamed.function.name, streamed.function.arguments) == ("add", call.function.arguments)
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            plain = ask(client, ask="add(1, 2)", tools=TOOLS, max_tokens=12)  # no block: all content, no calls
            assert plain.choices[0].message.tool_calls is None and "<tool_call>" not in plain.choices[0].message.content
            assert plain.choices[0].message.content == ask(client, ask="add(1, 2)", max_tokens=12).choices[0].message.content
    finally:
        llm.engine.shutdown()
