"""``serve --reasoning-parser``: chat answers split into ``reasoning`` and ``content``, through
the real ``openai`` client against a real server on 127.0.0.1.

The tiny random Qwen3's tokenizer has ``<think>`` (id 1) and ``</think>`` (id 2) as single
tokens, so the engine has a reasoning config. A test logits processor (``ForceAt``, sent
as ``vllm_xargs``) forces those tokens, or a whole scripted answer, at chosen output
positions; the model writes the rest. Every answer is checked against ``LLM.generate`` on a
second engine with the same processor: the split must be the reference's token ids cut at
the end token, each side decoded.
"""

from __future__ import annotations

import json
import re

import pytest
from force_token_procs import ForceAt
from serve_fixtures import CHAT_TEMPLATE, require_serve_extra, running_server

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

import openai  # noqa: E402
from test_cli import assert_one_line_error, run_cli  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.config import ReasoningConfig  # noqa: E402
from tinyvllm.engine.async_llm import AsyncLLM  # noqa: E402
from tinyvllm.engine.detokenizer import decode_text  # noqa: E402
from tinyvllm.entrypoints.openai_server import build_app  # noqa: E402

NAME = "tiny-qwen3"
ENGINE = dict(device="cpu", max_model_len=128, block_size=4)
START, END, EOS = 1, 2, 0
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
THINK = f"0:{START},4:{END}"  # <think>, three tokens of the model's, </think>, then the model's
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def offline(folder):
    return LLM(folder, logits_processors=[ForceAt], **ENGINE)


@pytest.fixture(scope="module")
def client(folder):
    llm = LLM(folder, logits_processors=[ForceAt], **ENGINE)
    with running_server(llm, NAME, chat_template=CHAT_TEMPLATE, tool_call_parser="hermes",
                        reasoning_parser="qwen3") as (url, _):  # fmt: skip
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, force_at: str, max_tokens: int = 10, **body):
    extra = {"vllm_xargs": {"force_at": force_at}, **body.pop("extra_body", {})}
    body = {"temperature": 0, "ignore_eos": True, **body}
    own = {k: body.pop(k) for k in ("temperature", "n", "seed", "stream", "logprobs", "stop", "tools", "tool_choice")
           if k in body}  # fmt: skip
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=max_tokens, **own,
                                         extra_body={**extra, **body})  # fmt: skip
    return list(out) if own.get("stream") else out


def reference(offline, force_at: str, max_tokens: int = 10, **params):
    """The offline engine's completions of the same chat prompt."""
    tok = offline.get_tokenizer()
    prompt = tok(tok.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False).input_ids  # fmt: skip
    params = {"temperature": 0, "ignore_eos": True, "max_tokens": max_tokens, **params}
    [out] = offline.generate({"prompt_token_ids": prompt}, SamplingParams(**params, extra_args={"force_at": force_at}),
                             use_tqdm=False)  # fmt: skip
    return out.outputs


def split_of(offline, token_ids) -> tuple[str | None, str | None]:
    """The rule on the reference's ids: before the end token (the start left out), after it."""
    tok, ids = offline.get_tokenizer(), list(token_ids)
    if END not in ids:
        return decode_text(tok, [t for t in ids if t != START]) or None, None
    cut = ids.index(END)
    return decode_text(tok, [t for t in ids[:cut] if t != START]) or None, decode_text(tok, ids[cut + 1 :]) or None


def message(out, i: int = 0) -> tuple[str | None, str | None]:
    msg = out.choices[i].message
    return msg.model_extra["reasoning"], msg.content


def joined(chunks, i: int = 0) -> tuple[str | None, str | None]:
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == i]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    return reasoning or None, "".join(d.content or "" for d in deltas) or None


def test_the_message_carries_reasoning_and_content(client, offline):
    out = chat(client, THINK)
    [ref] = reference(offline, THINK)
    assert ref.token_ids[0] == START and ref.token_ids[4] == END and END not in ref.token_ids[5:]
    reasoning, content = split_of(offline, ref.token_ids)
    assert reasoning and content  # text on both sides
    assert message(out) == (reasoning, content)
    assert reasoning + content == ref.text  # the think tokens are special: no text of their own
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("length", 10)  # unchanged


def test_streamed_deltas_join_to_the_message(client, offline):
    chunks = chat(client, THINK, stream=True)
    assert joined(chunks) == message(chat(client, THINK)) == split_of(offline, reference(offline, THINK)[0].token_ids)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    # each chunk with text: r (reasoning), c (content) or b (both: the piece where the engine's held-back
    # byte of the reasoning came out with the content's first text): all reasoning, then all content
    kinds = "".join({(True, False): "r", (False, True): "c", (True, True): "b"}.get(
        (bool((d.model_extra or {}).get("reasoning")), bool(d.content)), "") for d in deltas[1:])  # fmt: skip
    assert re.fullmatch(r"r*b?c*", kinds) and set(kinds) & {"r", "b"} and set(kinds) & {"c", "b"}, kinds
    assert chunks[-1].choices[0].finish_reason == "length"


def test_no_end_token_is_reasoning_cut_short_unless_thinking_is_off(client, offline):
    [ref] = reference(offline, f"0:{START}", max_tokens=6)
    assert END not in ref.token_ids
    assert message(chat(client, f"0:{START}", max_tokens=6)) == (ref.text, None)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    [plain] = reference(offline, f"5:{EOS}", max_tokens=6)  # no think token at all
    assert message(chat(client, f"5:{EOS}", max_tokens=6, **off)) == (None, plain.text)
    assert joined(chat(client, f"5:{EOS}", max_tokens=6, stream=True, **off)) == (None, plain.text)


def test_include_reasoning_false_drops_the_reasoning_only(client, offline):
    reasoning, content = split_of(offline, reference(offline, THINK)[0].token_ids)
    out = chat(client, THINK, include_reasoning=False, logprobs=True)
    assert message(out) == (None, content)
    assert len(out.choices[0].logprobs.content) == 10  # every token's logprob, the reasoning's too
    chunks = chat(client, THINK, include_reasoning=False, stream=True, logprobs=True)
    assert joined(chunks) == (None, content)
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 10


def test_each_of_n_choices_is_split_on_its_own(client, offline):
    sampled = {"temperature": 1.0, "seed": 7, "n": 2}
    refs = reference(offline, THINK, **sampled)
    assert refs[0].token_ids != refs[1].token_ids
    out, chunks = chat(client, THINK, **sampled), chat(client, THINK, stream=True, **sampled)
    for i, ref in enumerate(refs):
        assert message(out, i) == joined(chunks, i) == split_of(offline, ref.token_ids)


def scripted(offline, reasoning: str, answer: str) -> str:
    """``force_at`` for the whole output: <think> reasoning </think> answer, then EOS."""
    tok = offline.get_tokenizer()
    ids = [START, *tok(reasoning, add_special_tokens=False).input_ids, END, *tok(answer, add_special_tokens=False).input_ids, EOS]
    return ",".join(f"{i}:{t}" for i, t in enumerate(ids))


CALL = '<tool_call>{"name": "f", "arguments": {"x": 4}}</tool_call>'


def test_a_tool_call_after_the_think_section(client, offline):
    force = scripted(offline, "I should call f.", CALL)
    out = chat(client, force, max_tokens=60, ignore_eos=False, tools=TOOLS)
    msg = out.choices[0].message
    assert (msg.model_extra["reasoning"], msg.content, out.choices[0].finish_reason) == ("I should call f.", None, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("f", {"x": 4})]
    chunks = chat(client, force, max_tokens=60, ignore_eos=False, tools=TOOLS, stream=True)
    assert joined(chunks) == ("I should call f.", None)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("f", {"x": 4})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_call_in_the_reasoning_is_not_a_call(client, offline):
    out = chat(client, scripted(offline, CALL, "No call."), max_tokens=60, ignore_eos=False, tools=TOOLS)
    msg = out.choices[0].message
    assert (msg.model_extra["reasoning"], msg.content, msg.tool_calls) == (CALL, "No call.", None)
    assert out.choices[0].finish_reason == "stop"


def test_a_forced_tool_call_has_no_think_section(client):
    """reasoning.py NOTE 2: the grammar applies from the first token (the prompt opens no think
    section), so the arguments are content, not reasoning cut short."""
    pytest.importorskip("xgrammar")
    out = chat(client, f"30:{EOS}", max_tokens=40, ignore_eos=False, tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "f"}})  # fmt: skip
    msg = out.choices[0].message
    assert msg.model_extra["reasoning"] is None and msg.tool_calls[0].function.name == "f"
    assert "x" in json.loads(msg.tool_calls[0].function.arguments)


def test_a_stop_string_cuts_the_content_as_it_cuts_the_text(client, offline):
    reasoning, content = split_of(offline, reference(offline, THINK)[0].token_ids)
    stop = content[3:5]
    assert stop not in reasoning + content[:4]
    [ref] = reference(offline, THINK, stop=[stop])
    assert ref.text == reasoning + content[:3]
    assert message(chat(client, THINK, stop=[stop])) == (reasoning, content[:3])


def test_beam_search_splits_each_beam(client, offline):
    """The model never writes a think token unforced (beam search refuses ``vllm_xargs``): each
    beam, no end token in it, is all reasoning, as its text."""
    from tinyvllm.beam_search import BeamSearchParams

    tok = offline.get_tokenizer()
    prompt = tok(tok.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False).input_ids  # fmt: skip
    [found] = offline.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, n=2,
                                         extra_body={"use_beam_search": True, "ignore_eos": True})  # fmt: skip
    assert [message(out, i) for i in range(2)] == [(beam.text, None) for beam in found.sequences]


def test_completions_are_not_split(client, offline):
    out = client.completions.create(model=NAME, prompt="def main():", max_tokens=8, temperature=0,
                                    extra_body={"vllm_xargs": {"force_at": THINK}, "ignore_eos": True})  # fmt: skip
    [ref] = offline.generate("def main():", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                           extra_args={"force_at": THINK}), use_tqdm=False)  # fmt: skip
    assert out.choices[0].text == ref.outputs[0].text and "reasoning" not in (out.choices[0].model_extra or {})


def test_the_shipped_model_thinks_when_the_prompt_opens_the_section():
    """docs/serving_reasoning.md's example: the prompt ends in <think> (as Qwen3.5's template
    writes it), the thinking budget closes the section after 8 tokens, the split follows."""
    llm = LLM(torch_threads=1)  # the shipped model: <think> and </think> are ids 1 and 2 of its vocabulary
    with running_server(llm, "stdlib_tiny", reasoning_parser="qwen3") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ask = [{"role": "user", "content": "Sort a list."}, {"role": "assistant", "content": "<think>"}]
        extra = {"continue_final_message": True, "add_generation_prompt": False, "thinking_token_budget": 8}
        out = client.chat.completions.create(model="stdlib_tiny", messages=ask, temperature=0, max_tokens=24,
                                             extra_body=extra)  # fmt: skip
        want = ("_name = '()'\ndef", '_version(version):\n    """Return the version of the version number.')
        assert message(out) == want and out.usage.completion_tokens == 24
        chunks = client.chat.completions.create(model="stdlib_tiny", messages=ask, temperature=0, max_tokens=24,
                                                extra_body=extra, stream=True)  # fmt: skip
        assert joined(list(chunks)) == want
        plain = client.chat.completions.create(model="stdlib_tiny", messages=ask[:1], temperature=0, max_tokens=12)
        off = client.chat.completions.create(model="stdlib_tiny", messages=ask[:1], temperature=0, max_tokens=12,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
        assert message(plain) == ('# - 1)  -- "no-age" ', None) and message(off) == (None, '# - 1)  -- "no-age" ')


# -- start-up ------------------------------------------------------------------------------------


def test_a_model_without_think_ids_is_refused_at_start_up(folder):
    llm = LLM(folder, reasoning_config=ReasoningConfig((START,), (END, END)), **ENGINE)
    with pytest.raises(ValueError, match=r"--reasoning-parser qwen3 needs the model's think start and end as one token each"):
        build_app(AsyncLLM(llm.engine), NAME, reasoning_parser="qwen3")


def test_an_unknown_parser_name_is_refused_before_the_model_is_read(tmp_path):
    out = run_cli("serve", "--model", str(tmp_path / "no-such-model"), "--reasoning-parser", "qwen")
    assert_one_line_error(out, "--reasoning-parser: unknown reasoning parser 'qwen'; choose one of deepseek_r1, qwen3")
