"""The server's pieces without a server: request schemas, logprob shapes, choices, the prompt tokenizer.

Everything here is checked with hand-built values: ``Logprob``, ``CompletionOutput`` and
``RequestOutput`` as the engine would make them, request bodies as JSON bytes. So the
response shapes of fields the engine is still learning (logprobs, ``n``, prompt
logprobs) are pinned now; ``tests/test_openai_fields.py`` checks them end to end.
"""

from __future__ import annotations

import math
import random

import pytest
from serve_fixtures import require_serve_extra

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import pydantic  # noqa: E402

from tinyvllm.engine.prompt_tokenizer import PromptTokenizer, max_token_bytes  # noqa: E402
from tinyvllm.engine.chat_template import load_chat_template  # noqa: E402
from tinyvllm.entrypoints.choices import ChoiceBuilder, PromptState  # noqa: E402
from tinyvllm.entrypoints.logprobs_format import chat_logprobs, completion_logprobs, prompt_logprobs_json  # noqa: E402
from tinyvllm.entrypoints.openai_server import invalid_body  # noqa: E402
from tinyvllm.entrypoints.protocol import REFUSED, ChatCompletionRequest, CompletionRequest, RequestError  # noqa: E402
from tinyvllm.entrypoints.serving import param_of  # noqa: E402
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402

NAMES = {10: "a", 11: "b", 12: "c", 13: "dé"}


def decode(token_id: int) -> str:
    return f"<{token_id}>"


def lp(logprob: float, rank: int, token_id: int | None = None) -> Logprob:
    return Logprob(logprob, rank, NAMES.get(token_id) if token_id is not None else None)


def position(chosen: int, entries: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
    """A position's logprobs as the engine orders them: the chosen token first, then the top k."""
    out = {chosen: lp(*entries[chosen], chosen)}
    out.update({t: lp(v, r, t) for t, (v, r) in entries.items() if t != chosen})
    return out


# -- logprobs_format ------------------------------------------------------------------------


def test_completion_logprobs_shape():
    positions = [
        None,  # the prompt's first token
        position(11, {11: (-0.5, 1), 12: (-1.5, 2)}),
        position(12, {12: (-3.0, 3), 10: (-0.1, 1), 11: (-2.0, 2)}),  # chosen outside the top 2: 3 entries
        position(13, {13: (-math.inf, 9), 10: (-0.2, 1), 11: (-0.3, 2)}),
    ]
    got = completion_logprobs([10, 11, 12, 13], positions, 2, decode, text_offset=4)
    assert got["tokens"] == ["<10>", "b", "c", "dé"]  # no Logprob for the first: decode() gives its text
    assert got["token_logprobs"] == [None, -0.5, -3.0, -9999.0]  # -inf is written -9999.0
    assert got["top_logprobs"] == [None, {"b": -0.5, "c": -1.5}, {"a": -0.1, "b": -2.0, "c": -3.0},
                                   {"a": -0.2, "b": -0.3, "dé": -9999.0}]  # fmt: skip
    assert got["text_offset"] == [4, 8, 9, 10]  # where each token's text starts


def test_completion_logprobs_with_k_0_hold_the_chosen_token_and_token_ids_on_request():
    got = completion_logprobs([12], [position(12, {12: (-1.0, 2), 10: (-0.5, 1)})], 0, decode)
    assert got["top_logprobs"] == [{"c": -1.0}]
    got = completion_logprobs([12], [position(12, {12: (-1.0, 2), 10: (-0.5, 1)})], 1, decode, as_token_id=True)
    assert got["tokens"] == ["token_id:12"] and got["top_logprobs"] == [{"token_id:10": -0.5, "token_id:12": -1.0}]


def test_chat_logprobs_shape_keeps_the_k_most_likely_by_rank():
    positions = [position(12, {12: (-3.0, 3), 10: (-0.1, 1), 11: (-2.0, 2)}), position(13, {13: (-0.25, 1)})]
    got = chat_logprobs([12, 13], positions, 2, decode)
    first, second = got["content"]
    assert (first["token"], first["logprob"], first["bytes"]) == ("c", -3.0, [99])
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [("a", -0.1), ("b", -2.0)]  # not "c": rank 3
    assert (second["token"], second["bytes"], [t["token"] for t in second["top_logprobs"]]) == ("dé", [100, 195, 169], ["dé"])
    assert [item["top_logprobs"] for item in chat_logprobs([12], positions[:1], 0, decode)["content"]] == [[]]


def test_prompt_logprobs_json():
    got = prompt_logprobs_json([None, position(11, {11: (-math.inf, 5), 10: (-0.1, 1)})])
    assert got == [None, {"11": {"logprob": -9999.0, "rank": 5, "decoded_token": "b"},
                          "10": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}}]  # fmt: skip


# -- choices ------------------------------------------------------------------------------


def output(index_texts: list[tuple[int, str, list[int], str | None]], finished: bool, prompt=(1, 2), **kw) -> RequestOutput:
    outs = [CompletionOutput(i, text, ids, finish, logprobs=kw.get("logprobs", {}).get(i)) for i, text, ids, finish in index_texts]
    return RequestOutput("r", None, list(prompt), outs, finished, kw.get("cached", 0), RequestMetrics(0.0, None, None),
                         prompt_logprobs=kw.get("prompt_logprobs"))  # fmt: skip


def test_n_choices_from_interleaved_deltas_and_two_prompts():
    builder = ChoiceBuilder([PromptState([1, 2]), PromptState([3])], n=2, chat=False, decode=decode)
    streamed = []
    streamed += builder.update(0, output([(1, "x", [5], None), (0, "a", [6], None)], False, cached=0))
    streamed += builder.update(1, output([(0, "p", [7], None)], False, prompt=(3,)))
    streamed += builder.update(0, output([(0, "b", [8], "length"), (1, "y", [9], "stop")], True, cached=4))
    streamed += builder.update(1, output([(1, "q", [7, 7], "length"), (0, "", [], "length")], True, prompt=(3,)))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in streamed] == [
        (1, "x", None), (0, "a", None), (2, "p", None), (0, "b", "length"), (1, "y", "stop"), (3, "q", "length"),
        (2, "", "length"),
    ]  # fmt: skip
    choices = builder.choices()
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in choices] == [
        (0, "ab", "length", None), (1, "xy", "stop", None), (2, "p", "length", None), (3, "q", "length", None)]  # fmt: skip
    assert builder.usage() == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                               "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip


def test_completion_echo_with_logprobs_puts_the_prompt_first():
    prompt_lps = [None, position(11, {11: (-1.0, 2), 10: (-0.5, 1)})]
    out_lps = {0: [position(12, {12: (-0.1, 1)})]}
    for stream in (True, False):
        builder = ChoiceBuilder([PromptState([10, 11], echo="ab")], n=1, chat=False, decode=decode, logprobs=1, echo=True,
                                want_prompt_logprobs=True)  # fmt: skip
        chunks = builder.update(0, output([(0, "c", [12], "length")], True, prompt=(10, 11), logprobs=out_lps,
                                          prompt_logprobs=prompt_lps))  # fmt: skip
        if stream:
            assert [c["text"] for c in chunks] == ["ab", "c"]
            assert chunks[0]["logprobs"]["tokens"] == ["<10>", "b"] and chunks[1]["logprobs"]["text_offset"] == [2]
            continue
        [choice] = builder.choices()
        assert choice["text"] == "abc"
        assert choice["logprobs"]["tokens"] == ["<10>", "b", "c"]
        assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -0.1]
        assert choice["logprobs"]["text_offset"] == [0, 4, 5]
        assert choice["prompt_logprobs"][0] is None and set(choice["prompt_logprobs"][1]) == {"10", "11"}


def test_echo_with_max_tokens_0_returns_the_prompt_alone():
    builder = ChoiceBuilder([PromptState([1], echo="def")], n=1, chat=False, decode=decode, echo=True, drop_output=True)
    builder.update(0, output([(0, "x", [5], "length")], True, prompt=(1,)))
    assert builder.choices()[0]["text"] == "def" and builder.usage()["completion_tokens"] == 0


def test_chat_stream_opens_with_the_role_then_the_echo():
    builder = ChoiceBuilder([PromptState([1], echo="Sure:")], n=1, chat=True, decode=decode, echo=True,
                            want_prompt_logprobs=True)  # fmt: skip
    chunks = builder.update(0, output([(0, " ok", [5], None)], False, prompt=(1,), prompt_logprobs=[None]))
    chunks += builder.update(0, output([(0, "", [], "stop")], True, prompt=(1,)))
    assert [c["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "Sure:"}, {"content": " ok"}, {}]
    assert chunks[-1]["finish_reason"] == "stop"
    [choice] = builder.choices()
    assert choice["message"] == {"role": "assistant", "content": "Sure: ok"} and "prompt_logprobs" not in choice
    assert builder.prompt_logprobs() == [None]  # chat puts them at the top level


# -- protocol and errors -------------------------------------------------------------------------


def parse(model, body: str):
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as error:
        raise invalid_body(model, error) from None


@pytest.mark.parametrize(
    "body, param, words",
    [
        ('{"prompt": "x", "max_tokens": true}', "max_tokens", "must be an integer or null, got true"),
        ('{"prompt": "x", "max_tokens": "10"}', "max_tokens", 'got "10"'),
        ('{"prompt": "x", "max_tokens": 1.0}', "max_tokens", "got 1.0"),
        ('{"prompt": "x", "temperature": "1"}', "temperature", "must be a number or null"),
        ('{"prompt": "x", "stream": "yes"}', "stream", "must be a boolean or null"),
        ('{"prompt": [true, false]}', "prompt", "array of arrays of integers, got [true, false]"),
        ('{"prompt": "x", "stop": 1}', "stop", "`stop` must be a string or array of strings or null, got 1"),
        ('{"prompt": "x", "stop": [1]}', "stop", "`stop[0]` must be a string, got 1"),  # a list: the list's branch
        ('{"prompt": "x", "logit_bias": {"1": "5"}}', "logit_bias", '`logit_bias["1"]` must be a number, got "5"'),
        ('{"prompt": "x", "stream_options": {"include_usage": 1}}', "stream_options", "`stream_options.include_usage`"),
        ('{"prompt": "x", "frobnicate": 1}', "frobnicate", "Unrecognized request argument supplied: frobnicate"),
        ('{"max_tokens": 3}', "prompt", "`prompt` is required"),
        ('{"prompt": "x", "service_tier": "fastest"}', "service_tier", "one of"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages", '`messages[0].role` must be one of "system"'),
        ("[1, 2]", None, "must be a JSON object"),
        ('{"prompt": ', None, "not valid JSON"),
    ],
)
def test_strict_types_name_the_field(body, param, words):
    model = ChatCompletionRequest if "service_tier" in body or "messages" in body else CompletionRequest
    body = body.replace('"prompt": "x"', '"messages": []') if model is ChatCompletionRequest else body
    with pytest.raises(Exception) as info:
        parse(model, body)
    assert (info.value.param, info.value.status) == (param, 400) and words in info.value.message, info.value.message


def test_chat_content_parts_and_roles_are_typed():
    ok = parse(ChatCompletionRequest, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}')
    assert ok.messages[0].content[0].text == "hi"
    with pytest.raises(Exception) as info:
        parse(ChatCompletionRequest, '{"messages": [{"role": "robot", "content": "hi"}]}')
    assert info.value.param == "messages" and "`messages[0].role`" in info.value.message


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields_pass_the_values_that_ask_for_nothing(name):
    model = CompletionRequest if name in CompletionRequest.model_fields else ChatCompletionRequest
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": []}
    passing = REFUSED[name][0]
    for value in passing:
        model(**base, **{name: value}).check_refused()  # no error
    asking = []
    for value in ("something", True, False, 0.5, 1):  # values of the field's type that ask for something
        if value not in passing:
            try:
                asking.append(model(**base, **{name: value}))
            except pydantic.ValidationError:  # not of the field's type
                pass
    with pytest.raises(RequestError) as info:
        asking[0].check_refused()
    assert info.value.param == name and f"`{name}` is not supported" in str(info.value)


def test_sampling_fields_name_the_request_field_each_came_from():
    body = CompletionRequest(prompt="x", echo=True, logprobs=2, vllm_xargs={"a": 1}, logit_bias={"5": 1.0}, top_k=-1)
    fields = body.sampling_fields()
    assert fields["prompt_logprobs"] == ("echo", 2) and fields["logprobs"] == ("logprobs", 2)
    assert fields["extra_args"] == ("vllm_xargs", {"a": 1}) and fields["logit_bias"] == ("logit_bias", {5: 1.0})
    assert fields["top_k"] == ("top_k", -1) and "temperature" not in fields  # unset: the model's default applies
    chat = ChatCompletionRequest(messages=[], logprobs=True, top_logprobs=3, echo=True)
    assert chat.sampling_fields()["logprobs"] == ("top_logprobs", 3) and "prompt_logprobs" not in chat.sampling_fields()
    with pytest.raises(RequestError, match="keys must be token ids") as info:
        CompletionRequest(prompt="x", logit_bias={"a": 1.0}).sampling_fields()
    assert info.value.param == "logit_bias"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(best_of=3, n=2), "best_of"),
        (dict(best_of=0), "best_of"),
        (dict(stream_options={"include_usage": True}), "stream_options"),
        (dict(prompt_logprobs=1, stream=True), "prompt_logprobs"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(request_id=""), "request_id"),
        (dict(cache_salt=""), "cache_salt"),
    ],
)
def test_rules_between_fields(kwargs, param):
    with pytest.raises(RequestError) as info:
        CompletionRequest(prompt="x", **kwargs).check_refused()
    assert info.value.param == param


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(continue_final_message=True, add_generation_prompt=True), "continue_final_message"),
        (dict(max_tokens=5, max_completion_tokens=7), "max_completion_tokens"),
    ],
)
def test_chat_rules_between_fields(kwargs, param):
    with pytest.raises(RequestError) as info:
        ChatCompletionRequest(messages=[], **kwargs).check_refused()
    assert info.value.param == param
    ChatCompletionRequest(messages=[], max_tokens=7, max_completion_tokens=7).check_refused()  # agreeing is fine


@pytest.mark.parametrize(
    "message, param",
    [
        ("presence_penalty must be in [-2, 2], got 99.0", "presence_penalty"),
        ("min_tokens must be an int in [0, max_tokens=16], got 20", "min_tokens"),
        ("sampling_params: presence_penalty, n not supported by this engine yet", "presence_penalty"),
        ("sampling_params: n not supported by this engine yet", "n"),
        ("sampling_params.logit_bias has token id 600, outside the vocabulary [0, 512)", "logit_bias"),
        ("stop strings must be non-empty, got ('',)", "stop"),
        ("stop_token_ids has token id -1, but token ids are >= 0", "stop_token_ids"),
        ("prompt 0 has 300 tokens, more than max_model_len 128", "prompt"),
        ("extra_args['force_token'] must be a token id >= 0, got -1", "vllm_xargs"),
        ("something else entirely", None),
    ],
)
def test_param_of_finds_the_field_an_engine_message_names(message, param):
    names = {"presence_penalty": "presence_penalty", "min_tokens": "min_tokens", "max_tokens": "max_tokens", "n": "n",
             "logit_bias": "logit_bias", "stop": "stop", "stop_token_ids": "stop_token_ids", "prompt": "prompt",
             "extra_args": "vllm_xargs"}  # fmt: skip
    assert param_of(message, names) == param


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not valid Jinja"):
        load_chat_template("{% for m in messages %}")


# -- the prompt tokenizer's bound -------------------------------------------------------------------


def test_prompt_tokenizer_refuses_only_what_certainly_cannot_fit(tiny_model_dirs):
    from tinyvllm.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dirs["qwen3"])
    longest = max_token_bytes(tokenizer)
    assert longest == max(len(t.encode()) if t in tokenizer.get_added_vocab() else len(t) for t in tokenizer.get_vocab())
    pt = PromptTokenizer(tokenizer, max_model_len=16)
    assert pt.tokenizer is not tokenizer  # a copy of its own
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "\n", "é", "漢", "🙂", "def", "<|endoftext|>", "    "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 400)))
        n = len(tokenizer(text).input_ids)
        try:
            pt.check_text(text)
        except ValueError as error:
            assert n > 16, (text, n)  # the bound never refuses a text that fits
            assert "more than max_model_len 16" in str(error)
        try:
            assert pt.encode(text) == tokenizer(text).input_ids and n <= 16
        except ValueError:
            assert n > 16
    with pytest.raises(ValueError, match=r"prompt 3 has at least \d+ tokens \(\d+ bytes, at most"):
        pt.encode("x" * 16 * longest + "x", index=3)
    pt.shutdown()


def test_no_bound_for_a_tokenizer_with_a_normalizer(tiny_model_dirs):
    from tokenizers import normalizers

    from tinyvllm.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dirs["qwen3"])
    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()  # Qwen's: it may shorten a text
    assert max_token_bytes(tokenizer) is None
