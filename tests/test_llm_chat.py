"""``LLM.chat``: conversations rendered by the chat template, then generated as ``generate``
does, as vLLM's offline ``LLM.chat``. On the shipped model, whose template writes a
conversation as Python comments (its model card, "Chat").

Contract: each conversation's prompt is the template's text (``add_generation_prompt`` opens
the assistant's turn, ``continue_final_message`` leaves the last message open), tokenized
without special tokens (the template writes them); the tokens are what ``generate`` gives
those ids; outputs come back in conversation order; text parts of a message are joined with
newlines; ``chat_template`` and ``chat_template_kwargs`` reach the template. Every bad
argument is a ValueError (or TypeError) naming it, raised before any request is queued.
"""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.stdlib_tiny import STDLIB_TINY

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
HELLO = [{"role": "user", "content": "write a function that adds two numbers"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(STDLIB_TINY, device="cpu", max_model_len=256)


def test_chat_renders_the_template_then_generates_like_generate(llm):
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert text == "# user: write a function that adds two numbers\n# assistant:\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    [out] = llm.chat(HELLO, GREEDY, use_tqdm=False)
    assert out.prompt == text and out.prompt_token_ids == ids
    [reference] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids and len(out.outputs[0].token_ids) == 6


def test_chat_takes_a_batch_of_conversations_in_order(llm):
    other = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}]
    outs = llm.chat([HELLO, other, HELLO], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == [
        "# user: write a function that adds two numbers\n# assistant:\n",
        "# system: be brief\n# user: sort a list\n# assistant:\n",
        "# user: write a function that adds two numbers\n# assistant:\n",
    ]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids  # greedy: same prompt, same answer
    assert len({o.request_id for o in outs}) == 3


def test_chat_joins_text_parts_and_continues_the_final_message(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "two numbers"}]}]
    [joined] = llm.chat(parts, GREEDY, use_tqdm=False)
    assert joined.prompt == "# user: add\n# two numbers\n# assistant:\n"
    conversation = [*HELLO, {"role": "assistant", "content": "def add(a, b):"}]
    [open_turn] = llm.chat(
        conversation, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )  # fmt: skip
    assert open_turn.prompt.endswith("# assistant:\ndef add(a, b):"), open_turn.prompt  # no closing newline
    [closed] = llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert closed.prompt.endswith("def add(a, b):\n")


def test_chat_uses_the_given_template_and_its_kwargs(llm):
    template = "{% for m in messages %}<{{ m['role'] }}|{{ tone }}>{{ m['content'] }}{% endfor %}"
    [out] = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template=template, chat_template_kwargs={"tone": "calm"})
    assert out.prompt == "<user|calm>write a function that adds two numbers"


@pytest.mark.parametrize(
    "messages, kwargs, error, match",
    [
        ([], {}, ValueError, "conversation 0 holds no message"),
        ([[]], {}, ValueError, "conversation 0 holds no message"),
        ("hello", {}, TypeError, "messages must be a list of message dicts"),
        ([{"content": "hi"}], {}, ValueError, r"messages\[0\] needs a 'role'"),
        ([{"role": 3, "content": "hi"}], {}, TypeError, r"messages\[0\]\['role'\] must be a str"),
        ([{"role": "user", "content": 3}], {}, TypeError, r"messages\[0\]\['content'\] must be a str or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
            ValueError, r"messages\[0\]\.content\[0\]: type 'image_url' is not supported",
        ),
        ([HELLO, [{"content": "hi"}]], {}, ValueError, r"conversation 1: messages\[0\] needs a 'role'"),
        (HELLO, {"continue_final_message": True}, ValueError, "add_generation_prompt=False"),
        (HELLO, {"chat_template": "{% for m in messages %}"}, ValueError, "chat_template: .*not valid Jinja"),
        (HELLO, {"chat_template_kwargs": {"tokenize": True}}, ValueError, "chat_template_kwargs may not set 'tokenize'"),
        (HELLO, {"chat_template": "{{ raise_exception('no system role') }}"}, ValueError,
         "conversation 0: the chat template failed on these messages: no system role"),
        (HELLO, {"use_tqdm": "yes"}, TypeError, "use_tqdm"),
    ],
)  # fmt: skip
def test_chat_refuses_bad_input_before_queuing_anything(llm, messages, kwargs, error, match):
    kwargs = {"use_tqdm": False} | kwargs
    with pytest.raises(error, match=match):
        llm.chat(messages, GREEDY, **kwargs)
    assert not llm.engine.has_unfinished_requests()
    assert llm.chat(HELLO, GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_chat_refuses_a_model_without_a_chat_template(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=64)
    assert not getattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template: pass chat_template="):
        llm.chat(HELLO, GREEDY, use_tqdm=False)
    [out] = llm.chat(HELLO, GREEDY, use_tqdm=False, chat_template="{{ messages[0]['content'] }}")
    assert out.prompt == HELLO[0]["content"]


def test_chat_checks_each_rendered_prompt_as_generate_does(llm):
    # conversation i is checked as generate's prompt i: here the second is too long
    long = [{"role": "user", "content": "x " * 400}]
    with pytest.raises(ValueError, match="prompt 1 has .* tokens, more than max_model_len 256"):
        llm.chat([HELLO, long], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_cli_generate_chat_sends_the_prompt_as_a_user_message(capsys):
    from transformers import AutoTokenizer

    from tinyvllm.cli import main

    argv = ["generate", "--prompt", "sort a list", "--chat", "--max-tokens", "3", "--temperature", "0"]
    assert main([*argv, "--device", "cpu", "--max-model-len", "256"]) == 0
    ids = AutoTokenizer.from_pretrained(STDLIB_TINY)("# user: sort a list\n# assistant:\n", add_special_tokens=False)
    assert f"prompt {len(ids.input_ids)} tokens, generated 3 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--chat-template-kwargs", "{}"], "--chat-template-kwargs needs --chat"),
        (["--chat", "--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object, got '[1]'"),
        (["--chat", "--chat-template-kwargs", "{bad"], "--chat-template-kwargs must be a JSON object"),
        (["--chat", "--chat-template-kwargs", '{"tokenize": true}'], "chat_template_kwargs may not set 'tokenize'"),
    ],
)  # fmt: skip
def test_cli_generate_chat_flags_are_checked_first(capsys, monkeypatch, flags, message):
    from tinyvllm import cli

    monkeypatch.setattr(cli, "llm_from_args", lambda args: pytest.fail("the model was loaded before the flags were checked"))
    assert cli.main(["generate", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tinyvllm: error: ") and message in err and err.count("\n") == 1
