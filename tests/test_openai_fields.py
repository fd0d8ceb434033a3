"""Every field of both request schemas, sent through the real ``openai`` client: its effect, or its 400.

``ROWS`` is the table: one row (or more) per field of ``CompletionRequest`` and
``ChatCompletionRequest``, saying what to send and either what must come of it (``check``)
or that it is refused (a 400 whose ``param`` names the field).
``test_the_table_walks_every_field`` holds the table to both schemas, the schemas to the
``openai`` client's own parameters, and ``test_the_docs_table_gives_every_field_its_fate``
holds the docs page's table to the code.

ENGINE ROWS: a row with ``engine="<SamplingParams field>"`` names the engine field its
effect comes from (penalties, logprobs, ``n`` ...); the row asserts that effect.

The server runs a tiny random Qwen3 whose tokenizer adds a BOS token (so that
``add_special_tokens`` has an effect to see), with a custom logits processor (for
``vllm_xargs``) and the tests' chat template given as ``--chat-template`` would. Every
effect is checked against ``LLM.generate`` on a second engine built from the same folder.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from force_token_procs import Outer
from serve_fixtures import CHAT_TEMPLATE, require_serve_extra, running_server

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import openai  # noqa: E402
from openai.types import completion_create_params, embedding_create_params  # noqa: E402
from openai.types.chat import completion_create_params as chat_create_params  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.beam_search import BeamSearchParams  # noqa: E402
from tinyvllm.entrypoints.protocol import (  # noqa: E402
    INFORMATIONAL, REFUSED, ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
)  # fmt: skip

NAME = "tiny-qwen3"
ENGINE = dict(device="cpu", max_model_len=128, block_size=4)
PROMPT = "def main():\n    return"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
BASE = {"completions": {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        "chat": {"model": NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}}  # fmt: skip
ForceToken = Outer.ForceToken  # vllm_xargs' effect
EOS = {"0": 100}  # logit_bias that makes <|endoftext|> (id 0, the EOS) win every step
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tiny_model_dirs, tmp_path_factory):
    """The tiny Qwen3, its tokenizer adding <|endoftext|> as BOS (a post-processor)."""
    from tokenizers import Tokenizer, processors

    path = tmp_path_factory.mktemp("bos") / "qwen3-bos"
    shutil.copytree(tiny_model_dirs["qwen3"], path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


@dataclasses.dataclass
class Ctx:
    client: openai.OpenAI
    offline: LLM

    def chat_ids(self, messages=MESSAGES, template: str = CHAT_TEMPLATE, add_special: bool = False, **kwargs) -> dict:
        tok = self.offline.get_tokenizer()
        kwargs.setdefault("add_generation_prompt", not kwargs.get("continue_final_message", False))
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
        return {"prompt_token_ids": tok(text, add_special_tokens=add_special).input_ids}

    def ref(self, api: str, prompt=None, **params):
        """The offline engine's output for the row's prompt (the base prompt by default), greedy, 8 tokens."""
        if prompt is None:
            prompt = PROMPT if api == "completions" else self.chat_ids()
        params = {"temperature": 0, "max_tokens": 8, **params}
        [out] = self.offline.generate(prompt, SamplingParams(**params), use_tqdm=False)
        return out


@pytest.fixture(scope="module")
def ctx(folder):
    offline = LLM(folder, logits_processors=[ForceToken], **ENGINE)
    llm = LLM(folder, logits_processors=[ForceToken], **ENGINE)
    with running_server(llm, NAME, chat_template=CHAT_TEMPLATE) as (url, _):
        yield Ctx(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), offline)


# -- reading a response ---------------------------------------------------------------------


def text(out, i: int = 0) -> str:
    if isinstance(out, list):  # a stream's chunks
        pieces = [c.choices[0].text if hasattr(c.choices[0], "text") else (c.choices[0].delta.content or "")
                  for c in out if c.choices and c.choices[0].index == i]  # fmt: skip
        return "".join(pieces)
    choice = out.choices[i]
    return choice.text if hasattr(choice, "text") else choice.message.content


def send(ctx: Ctx, api: str, body: dict):
    """``body`` through the client: its own parameters by name, vLLM's in ``extra_body``."""
    create = ctx.client.completions.create if api == "completions" else ctx.client.chat.completions.create
    own = (completion_create_params.CompletionCreateParamsBase if api == "completions"
           else chat_create_params.CompletionCreateParamsBase).__annotations__  # fmt: skip
    kwargs = {k: v for k, v in body.items() if k in own or k == "stream"}
    extra = {k: v for k, v in body.items() if k not in kwargs}
    out = create(**kwargs, extra_body=extra or None)
    return list(out) if body.get("stream") else out


# -- the checks (each gets the context, the API and the response) -------------------------------


def same_as(**params) -> Callable:
    """The offline engine's text with these params."""

    def check(ctx, api, out):
        assert text(out) == ctx.ref(api, **params).outputs[0].text

    return check


def changes(**params) -> Callable:
    """The offline text with these params, which differs from the text without them."""

    def check(ctx, api, out):
        ref, base = ctx.ref(api, **params).outputs[0], ctx.ref(api).outputs[0]
        assert ref.token_ids != base.token_ids, f"{params} change nothing on this prompt: a weak row"
        assert text(out) == ref.text

    return check


def unchanged(ctx, api, out):
    """An informational field: the output is the one without it."""
    assert text(out) == ctx.ref(api).outputs[0].text


def reasoning_needs_a_parser(ctx, api, out):
    """``include_reasoning``: true asks for nothing here; false needs ``--reasoning-parser``, which
    this server lacks (the split itself: ``test_reasoning_serving.py``)."""
    unchanged(ctx, api, out)
    with pytest.raises(openai.BadRequestError) as info:
        send(ctx, api, {**BASE[api], "include_reasoning": False})
    error = info.value.response.json()["error"]
    assert error["param"] == "include_reasoning" and "needs a reasoning parser" in error["message"], error


def greedy_via(**params) -> Callable:
    """Sampling at temperature 1 that the field makes greedy."""

    def check(ctx, api, out):
        assert ctx.ref(api, temperature=1.0, seed=3).outputs[0].token_ids != ctx.ref(api).outputs[0].token_ids
        assert text(out) == ctx.ref(api).outputs[0].text == ctx.ref(api, temperature=1.0, seed=3, **params).outputs[0].text

    return check


def n_choices(ctx, api, out):
    assert [c.index for c in out.choices] == [0, 1]
    ref = ctx.ref(api, n=2, temperature=1.0, seed=5)
    assert [text(out, i) for i in range(2)] == [c.text for c in ref.outputs]


def counts(n: int, finish: str) -> Callable:
    def check(ctx, api, out):
        assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (n, finish)

    return check


def greedy_text(ctx, api) -> str:
    return ctx.ref(api, max_tokens=16, ignore_eos=True).outputs[0].text


def stop_value(ctx, api) -> list[str]:
    return [greedy_text(ctx, api)[4:6]]


def stops_at_string(include: bool) -> Callable:
    def check(ctx, api, out):
        full, [stop] = greedy_text(ctx, api), stop_value(ctx, api)
        assert text(out) == full[: full.find(stop) + (len(stop) if include else 0)]
        assert out.choices[0].finish_reason == "stop"

    return check


def stop_token_value(ctx, api) -> list[int]:
    """The first token of the greedy output after the first (so that the stop cuts it short)."""
    ids = ctx.ref(api, ignore_eos=True).outputs[0].token_ids
    return [next(t for t in ids[1:] if t != ids[0])]


def stops_at_token(ctx, api, out):
    [token] = stop_token_value(ctx, api)
    ids = ctx.ref(api, ignore_eos=True).outputs[0].token_ids
    ref = ctx.ref(api, ignore_eos=True, stop_token_ids=[token]).outputs[0]
    assert ref.token_ids == ids[: ids.index(token) + 1] and (ref.finish_reason, ref.stop_reason) == ("stop", token)
    assert (text(out), out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == (ref.text, "stop", token)


def bad_word_value(ctx, api) -> list[str]:
    """A word of the greedy output that is one token on its own (so that banning it bans that token)."""
    tok = ctx.offline.get_tokenizer()
    for token in ctx.ref(api).outputs[0].token_ids:
        word = tok.decode([token])
        if word.strip() and tok.encode(word.lstrip(), add_special_tokens=False) == [token]:
            return [word]
    raise AssertionError("the greedy output has no one-token word to ban")


def bans_the_word(ctx, api, out):
    changes(bad_words=bad_word_value(ctx, api))(ctx, api, out)


def streamed(ctx, api, out):
    assert len(out) > 2 and text(out) == ctx.ref(api).outputs[0].text


def streamed_usage(ctx, api, out):
    assert out[-1].choices == [] and out[-1].usage.completion_tokens == len(ctx.ref(api).outputs[0].token_ids)


def min_tokens_4(ctx, api, out):
    ref = ctx.ref(api, logit_bias={0: 100.0}, min_tokens=4).outputs[0]
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (len(ref.token_ids), "stop")
    assert out.usage.completion_tokens >= 4 and ctx.ref(api, logit_bias={0: 100.0}).outputs[0].token_ids == [0]


def keeps_special_tokens(ctx, api, out):
    assert text(out) == "<|endoftext|>" * 3


def truncated(ctx, api, out):
    ids = (ctx.offline.get_tokenizer()(PROMPT).input_ids if api == "completions" else ctx.chat_ids()["prompt_token_ids"])
    assert out.usage.prompt_tokens == 3 and text(out) == ctx.ref(api, {"prompt_token_ids": ids[-3:]}).outputs[0].text


def prompt_logprobs(ctx, api, out):
    got = out.choices[0].model_extra["prompt_logprobs"] if api == "completions" else out.model_extra["prompt_logprobs"]
    assert len(got) == out.usage.prompt_tokens and got[0] is None
    assert all(len(p) >= 1 and all(v["logprob"] <= 0 and v["rank"] >= 1 for v in p.values()) for p in got[1:])


def thinking_prompt(api: str):
    if api == "completions":
        return [5, 6, 1]  # ends in <think>
    return [*MESSAGES, {"role": "assistant", "content": "<think>"}]


def thinks_zero_tokens(ctx, api, out):
    prompt = ({"prompt_token_ids": [5, 6, 1]} if api == "completions"
              else ctx.chat_ids(thinking_prompt(api), continue_final_message=True))  # fmt: skip
    ref = ctx.ref(api, prompt, thinking_token_budget=0).outputs[0]
    assert ref.token_ids[0] == 2 and text(out) == ref.text  # </think> at once


def echoes(ctx, api, out):
    if api == "completions":
        assert text(out) == PROMPT + ctx.ref(api).outputs[0].text
    else:
        messages = [*MESSAGES, {"role": "assistant", "content": "Sure:"}]
        assert text(out) == "Sure:" + ctx.ref(api, ctx.chat_ids(messages)).outputs[0].text


def special_tokens_added(ctx, api, out):
    if api == "completions":  # on by default: the row turns the BOS off
        assert out.usage.prompt_tokens == len(ctx.offline.get_tokenizer()(PROMPT).input_ids) - 1
        return
    ids = ctx.chat_ids(add_special=True)  # off by default for chat (the template writes them): the row turns it on
    assert out.usage.prompt_tokens == len(ids["prompt_token_ids"]) == len(ctx.chat_ids()["prompt_token_ids"]) + 1
    assert text(out) == ctx.ref(api, ids).outputs[0].text


def named(ctx, api, out):
    assert out.id.endswith("-row-id-7") and text(out) == ctx.ref(api).outputs[0].text


def tokens_as_ids(ctx, api, out):
    tokens = out.choices[0].logprobs.tokens if api == "completions" else [c.token for c in out.choices[0].logprobs.content]
    assert len(tokens) == out.usage.completion_tokens and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)


def salted(ctx, api, out):
    body = {**BASE[api], "cache_salt": "salt-a", **_unique(api)}
    again = send(ctx, api, body)
    other = send(ctx, api, {**body, "cache_salt": "salt-b"})
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same salt shares the cached blocks
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another salt never does


def _unique(api: str) -> dict:
    if api == "completions":
        return {"prompt": "cache salt row: " + "x = 1\n" * 8}
    return {"messages": [{"role": "user", "content": "cache salt row: " + "x = 1\n" * 8}]}


def forced_42(ctx, api, out):
    assert text(out) == ctx.ref(api, extra_args={"force_token": 42}).outputs[0].text
    assert ctx.ref(api, extra_args={"force_token": 42}).outputs[0].token_ids == [42] * 8


def constrained(**so) -> Callable:
    """The offline text under ``StructuredOutputsParams(**so)``, which differs from the text without it."""
    from tinyvllm.sampling_params import StructuredOutputsParams

    return changes(structured_outputs=StructuredOutputsParams(**so))


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}]  # fmt: skip


def calls_f(finish: str) -> Callable:
    """One call of ``f`` with its only arguments, ``{}`` (the grammar allows nothing else), ``content`` empty."""

    def check(ctx, api, out):
        message = out.choices[0].message
        calls = [(c.type, c.function.name, c.function.arguments) for c in message.tool_calls]
        assert (calls, message.content, out.choices[0].finish_reason) == ([("function", "f", "{}")], "", finish)

    return check


def served_name(ctx, api, out):
    assert out.model == NAME and text(out) == ctx.ref(api).outputs[0].text


def prompt_list(ctx, api, out):
    prompts = ["def f", "class A"]
    assert [c.index for c in out.choices] == [0, 1]
    assert [text(out, i) for i in range(2)] == [ctx.ref(api, p).outputs[0].text for p in prompts]
    assert out.usage.prompt_tokens == sum(len(ctx.ref(api, p).prompt_token_ids) for p in prompts)


def completion_logprobs(ctx, api, out):
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 2 <= len(top) <= 3 and top[token] == logprob and max(top.values()) >= logprob


def chat_logprobs(k: int) -> Callable:
    def check(ctx, api, out):
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens
        for item in content:
            assert item.logprob <= 0 and item.bytes == list(item.token.encode("utf-8", errors="replace"))
            assert len(item.top_logprobs) == k
            assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
            if k:
                assert item.top_logprobs[0].logprob >= item.logprob

    return check


def parts_joined(ctx, api, out):
    assert text(out) == ctx.ref(api, ctx.chat_ids([MESSAGES[0], {"role": "user", "content": "Write\na loop."}])).outputs[0].text


def without_generation_prompt(ctx, api, out):
    ids = ctx.chat_ids(add_generation_prompt=False)
    assert out.usage.prompt_tokens == len(ids["prompt_token_ids"]) < len(ctx.chat_ids()["prompt_token_ids"])
    assert text(out) == ctx.ref(api, ids).outputs[0].text


def continues(ctx, api, out):
    ids = ctx.chat_ids([*MESSAGES, {"role": "assistant", "content": "for i in"}], continue_final_message=True)
    assert out.usage.prompt_tokens == len(ids["prompt_token_ids"]) and text(out) == ctx.ref(api, ids).outputs[0].text


def beams_as(**params) -> Callable:
    """The texts of ``LLM.beam_search``'s beams, best first, one choice each (``n`` 2 the width)."""

    def check(ctx, api, out):
        prompt = PROMPT if api == "completions" else ctx.chat_ids()
        [ref] = ctx.offline.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=8, **params))
        assert [text(out, i) for i in range(len(out.choices))] == [s.text for s in ref.sequences]

    return check


OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>> "
KWARGS_TEMPLATE = "{{ greeting }}: {% for m in messages %}{{ m['content'] }} {% endfor %}"
DOCS_TEMPLATE = "{% for d in documents %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>{% endfor %}{{ messages[-1]['content'] }}"


def with_template(template: str, **kwargs) -> Callable:
    def check(ctx, api, out):
        ids = ctx.chat_ids(template=template, **kwargs)
        assert out.usage.prompt_tokens == len(ids["prompt_token_ids"]) and text(out) == ctx.ref(api, ids).outputs[0].text

    return check


# -- the table ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    api: str  # "completions" or "chat"
    field: str
    value: Any  # or a function (ctx, api) -> value
    check: Callable | None = None  # None: refused, a 400 naming the field
    extra: dict = dataclasses.field(default_factory=dict)  # other fields the request needs (may be functions)
    engine: str | None = None  # ENGINE ROW: the SamplingParams field its effect comes from

    @property
    def id(self) -> str:
        return f"{self.api}-{self.field}"


def both(field: str, value: Any, check: Callable | None = None, **kw) -> list[Row]:
    return [Row("completions", field, value, check, **kw), Row("chat", field, value, check, **kw)]


SAMPLE = {"temperature": 1.0, "seed": 3}
ROWS: list[Row] = [
    # shared by both: OpenAI's fields
    *both("model", NAME, served_name),
    *both("frequency_penalty", 2.0, changes(frequency_penalty=2.0), engine="frequency_penalty"),
    *both("presence_penalty", 2.0, changes(presence_penalty=2.0), engine="presence_penalty"),
    *both("logit_bias", {"300": 100}, changes(logit_bias={300: 100.0})),
    *both("max_tokens", 5, counts(5, "length"), extra={"ignore_eos": True}),
    *both("n", 2, n_choices, extra={"temperature": 1.0, "seed": 5}, engine="n"),
    *both("seed", 1234, changes(temperature=1.0, seed=1234), extra={"temperature": 1.0}),
    *both("stop", stop_value, stops_at_string(False), extra={"max_tokens": 16, "ignore_eos": True}),
    *both("stream", True, streamed),
    *both("stream_options", {"include_usage": True}, streamed_usage, extra={"stream": True}),
    *both("temperature", 1.0, changes(temperature=1.0, seed=9), extra={"seed": 9}),
    *both("top_p", 0.01, greedy_via(top_p=0.01), extra=SAMPLE),
    *both("response_format", {"type": "json_object"}, constrained(json_object=True)),
    *both("user", "someone", unchanged),
    # shared by both: vLLM's extra fields
    *both("best_of", 2, n_choices, extra={"n": 2, "temperature": 1.0, "seed": 5}, engine="n"),
    *both("top_k", 1, greedy_via(top_k=1), extra=SAMPLE),
    Row("completions", "top_k", -1, same_as()),  # -1 is off, as vLLM
    *both("min_p", 1.0, greedy_via(min_p=1.0), extra=SAMPLE),
    *both("repetition_penalty", 2.0, changes(repetition_penalty=2.0), engine="repetition_penalty"),
    *both("stop_token_ids", stop_token_value, stops_at_token, extra={"ignore_eos": True}),
    *both("include_stop_str_in_output", True, stops_at_string(True), extra={"stop": stop_value, "max_tokens": 16,
                                                                          "ignore_eos": True}),  # fmt: skip
    *both("ignore_eos", True, counts(5, "length"), extra={"logit_bias": EOS, "max_tokens": 5}),
    *both("min_tokens", 4, min_tokens_4, extra={"logit_bias": EOS}),
    *both("skip_special_tokens", False, keeps_special_tokens, extra={"logit_bias": EOS, "ignore_eos": True, "max_tokens": 3},
          engine="skip_special_tokens"),  # fmt: skip
    *both("truncate_prompt_tokens", 3, truncated),
    *both("allowed_token_ids", [300, 301], changes(allowed_token_ids=[300, 301]), engine="allowed_token_ids"),
    *both("bad_words", bad_word_value, bans_the_word, engine="bad_words"),
    *both("prompt_logprobs", 1, prompt_logprobs, engine="prompt_logprobs"),
    Row("completions", "thinking_token_budget", 0, thinks_zero_tokens, extra={"prompt": thinking_prompt("completions")}),
    Row("chat", "thinking_token_budget", 0, thinks_zero_tokens,
        extra={"messages": thinking_prompt("chat"), "continue_final_message": True}),  # fmt: skip
    Row("completions", "echo", True, echoes),
    Row("chat", "echo", True, echoes, extra={"messages": [*MESSAGES, {"role": "assistant", "content": "Sure:"}]}),
    Row("completions", "add_special_tokens", False, special_tokens_added),
    Row("chat", "add_special_tokens", True, special_tokens_added),
    *both("request_id", "row-id-7", named),
    Row("completions", "return_tokens_as_token_ids", True, tokens_as_ids, extra={"logprobs": 1}, engine="logprobs"),  # fmt: skip
    Row("chat", "return_tokens_as_token_ids", True, tokens_as_ids, extra={"logprobs": True}, engine="logprobs"),  # fmt: skip
    *[Row(api, "cache_salt", "salt-a", salted, extra=_unique(api)) for api in ("completions", "chat")],
    *both("vllm_xargs", {"force_token": 42}, forced_42),
    *both("use_beam_search", True, beams_as(), extra={"n": 2}),  # more: test_beam_search_serving.py
    *both("length_penalty", 0.5, beams_as(length_penalty=0.5), extra={"use_beam_search": True, "n": 2}),
    *both("spaces_between_special_tokens", False),
    *both("guided_json", {"type": "object"}),
    *both("guided_regex", "a+"),
    *both("guided_choice", ["yes", "no"]),
    *both("guided_grammar", "root ::= 'a'"),
    *both("guided_decoding_backend", "xgrammar"),
    *both("guided_whitespace_pattern", " "),
    *both("structured_outputs", {"regex": "[0-9]{3}"}, constrained(regex="[0-9]{3}")),
    *both("priority", 0, same_as()),  # honoured; other values need --scheduling-policy priority (test_priority_engine.py)
    *both("logits_processors", ["my_module:MyProcessor"]),
    *both("kv_transfer_params", {"do_remote_decode": True}),
    # completions only
    Row("completions", "prompt", ["def f", "class A"], prompt_list),
    Row("completions", "logprobs", 2, completion_logprobs, engine="logprobs"),
    Row("completions", "suffix", "return x"),
    Row("completions", "prompt_embeds", "AAAA"),
    # chat only: OpenAI's fields
    Row("chat", "messages", [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Write"},
                                                                        {"type": "text", "text": "a loop."}]}],
        parts_joined),  # fmt: skip
    Row("chat", "logprobs", True, chat_logprobs(0), engine="logprobs"),
    Row("chat", "top_logprobs", 2, chat_logprobs(2), extra={"logprobs": True}, engine="logprobs"),
    Row("chat", "max_completion_tokens", 7, counts(7, "length"), extra={"ignore_eos": True, "max_tokens": None}),
    Row("chat", "tools", TOOLS, calls_f("tool_calls"), extra={"tool_choice": "required", "max_tokens": 40}),
    Row("chat", "tool_choice", {"type": "function", "function": {"name": "f"}}, calls_f("stop"),
        extra={"tools": TOOLS, "max_tokens": 40}),  # fmt: skip
    Row("chat", "functions", [{"name": "f"}]),
    Row("chat", "function_call", "auto"),
    Row("chat", "parallel_tool_calls", False, calls_f("tool_calls"),
        extra={"tools": TOOLS, "tool_choice": "required", "max_tokens": 40}),  # fmt: skip
    Row("chat", "audio", {"voice": "alloy", "format": "mp3"}),
    Row("chat", "modalities", ["text", "audio"]),
    Row("chat", "prediction", {"type": "content", "content": "x = 1"}),
    Row("chat", "web_search_options", {}),
    Row("chat", "reasoning_effort", "low"),
    Row("chat", "verbosity", "low"),
    Row("chat", "moderation", {"input": {"mode": "block"}}),
    *[Row("chat", name, value, unchanged) for name, value in (
        ("metadata", {"k": "v"}), ("store", True), ("service_tier", "auto"), ("prompt_cache_key", "k1"),
        ("prompt_cache_options", {"mode": "explicit"}), ("prompt_cache_retention", "24h"),
        ("safety_identifier", "user-1"))],  # fmt: skip
    # chat only: vLLM's extra fields
    Row("chat", "add_generation_prompt", False, without_generation_prompt),
    Row("chat", "continue_final_message", True, continues,
        extra={"messages": [*MESSAGES, {"role": "assistant", "content": "for i in"}]}),  # fmt: skip
    Row("chat", "chat_template", OTHER_TEMPLATE, with_template(OTHER_TEMPLATE)),
    Row("chat", "chat_template_kwargs", {"greeting": "Hello"}, with_template(KWARGS_TEMPLATE, greeting="Hello"),
        extra={"chat_template": KWARGS_TEMPLATE}),  # fmt: skip
    Row("chat", "documents", [{"title": "a", "text": "x = 1"}],
        with_template(DOCS_TEMPLATE, documents=[{"title": "a", "text": "x = 1"}]), extra={"chat_template": DOCS_TEMPLATE}),
    Row("chat", "include_reasoning", True, reasoning_needs_a_parser),
    Row("chat", "structural_tag", '{"structures": []}'),
    Row("chat", "mm_processor_kwargs", {"num_crops": 4}),
]


CONSTRAINTS = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.id)
def test_field(ctx, row: Row):
    if row.field in CONSTRAINTS:
        pytest.importorskip("xgrammar")  # the engine's grammars (absent where the serve extra is, on the GPU machine)
    resolve = lambda v: v(ctx, row.api) if callable(v) else v  # noqa: E731
    body = {**BASE[row.api], **{k: resolve(v) for k, v in row.extra.items()}, row.field: resolve(row.value)}
    if row.check is not None:
        row.check(ctx, row.api, send(ctx, row.api, body))
        return
    with pytest.raises(openai.BadRequestError) as info:
        send(ctx, row.api, body)
    error = info.value.response.json()["error"]
    assert (info.value.status_code, error["code"], error["type"]) == (400, 400, "BadRequestError")
    assert error["param"] == row.field and f"`{row.field}` is not supported" in error["message"], error


def test_the_table_walks_every_field():
    """Every field of each schema has a row; every OpenAI parameter the client knows is a field."""
    for api, model, openai_params in (
        ("completions", CompletionRequest, completion_create_params.CompletionCreateParamsBase),
        ("chat", ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase),
    ):
        fields = set(model.model_fields)
        assert {row.field for row in ROWS if row.api == api} == fields, api
        assert set(openai_params.__annotations__) <= fields, api
    refused_rows = {row.field for row in ROWS if row.check is None}
    assert refused_rows == set(REFUSED), "every refused field has a row that sends a value it refuses"
    assert set(INFORMATIONAL) <= {row.field for row in ROWS if row.check is unchanged}


def test_the_embeddings_schema_takes_every_openai_parameter():
    """``POST /v1/embeddings`` (tests/test_openai_embeddings.py sends each): OpenAI's five
    parameters, and the docs page's table gives every field of the schema its fate."""
    assert set(embedding_create_params.EmbeddingCreateParams.__annotations__) <= set(EmbeddingRequest.model_fields)
    page = (ROOT / "docs" / "serving_embeddings.md").read_text(encoding="utf-8")
    assert set(re.findall(r"^\| `(\w+)` \|", page, re.M)) == set(EmbeddingRequest.model_fields)


def docs_table() -> dict[str, tuple[str, str]]:
    """``docs/serving_endpoints.md``'s field table: ``{field: (endpoints, fate)}``."""
    page = (ROOT / "docs" / "serving_endpoints.md").read_text(encoding="utf-8")
    section = page.split("## Every field, honoured or refused", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| \*\*(\w+)\*\* \|", section, re.M)
    table = {field: (endpoints.strip(), fate) for field, endpoints, fate in rows}
    assert len(table) == len(rows), "a field is listed twice"
    return table


def test_the_docs_table_gives_every_field_its_fate():
    table = docs_table()
    completions, chat = set(CompletionRequest.model_fields), set(ChatCompletionRequest.model_fields)
    assert set(table) == completions | chat
    for field, (endpoints, fate) in table.items():
        where = {"both": completions & chat, "completions": completions - chat, "chat": chat - completions}[endpoints]
        assert field in where, f"{field}: the table says {endpoints}"
        want = "refused" if field in REFUSED else ("informational" if field in INFORMATIONAL else "honoured")
        assert fate == want, f"{field}: the table says {fate}, the code {want}"
