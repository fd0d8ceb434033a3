"""Chat: messages to one prompt, through a Jinja chat template, in the tokenizer's thread.

Concept: a chat request is a list of messages; the model reads one token sequence. The
chat template (Jinja, run by transformers' ``apply_chat_template``) writes the messages
as text, with the opening of the assistant's turn when ``add_generation_prompt`` (the
default) asks for it, or leaving the last message open with ``continue_final_message``.
The text is then tokenized without special tokens (the template writes them), unless the
request's ``add_special_tokens`` asks for them.

Which template, first match: the request's ``chat_template``, the server's
``--chat-template``, the tokenizer's own (``tokenizer_config.json`` or
``chat_template.jinja``; the shipped model has one, see its model card). None at all is
a 400 naming ``messages``.

Mirrors: ``vllm/entrypoints/chat_utils.py`` (``apply_hf_chat_template``,
``load_chat_template``, content parts flattened to a string) and ``serving_chat.py``
(``echo`` of the last message).

Invariants: ``render`` runs in the tokenizer thread (``engine/prompt_tokenizer.py``): the
template and the tokenizer copy are used by that thread alone. Every content part is
text, joined with newlines; any other part type is a 400 naming its place.

NOTE 1 (chat_template_kwargs): extra variables for the template (``enable_thinking`` is
Qwen3's). A name that ``apply_chat_template`` itself takes (``tools``, ``tokenize``, ...)
is a 400, so it cannot change how the server renders.
NOTE 2 (echo): as vLLM's, ``echo`` prepends the last message's content to the answer
when that message is the assistant's (the model continues it); otherwise it adds nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinyvllm.entrypoints.protocol import ChatCompletionRequest, RequestError

# apply_chat_template's own parameters, which chat_template_kwargs may not set (NOTE 1)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the template itself (it has a ``{``), checked by
    Jinja's parser; ValueError naming the flag otherwise (vLLM's ``load_chat_template``)."""
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # a template too long to be a path name
        is_file = False
    if is_file:
        template = path.read_text(encoding="utf-8")
    elif "{" in value:
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template (no '{{')")
    check_template(template, "--chat-template")
    return template


def check_template(template: str, where: str) -> None:
    """A Jinja syntax error in ``template`` becomes a ValueError naming ``where``."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"{where}: the chat template is not valid Jinja: {error} (line {error.lineno})") from None


def messages_as_dicts(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template reads them: content parts joined into one string."""
    out = []
    for i, message in enumerate(request.messages):
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    what = f"type {part.type!r}" if part.type != "text" else "a text part without 'text'"
                    raise RequestError(
                        f"messages[{i}].content[{j}]: {what} is not supported (text parts only)", "messages"
                    )
                texts.append(part.text)
            item["content"] = "\n".join(texts)
        out.append(item)
    if not out:
        raise RequestError("`messages` must hold at least one message", "messages")
    return out


def echo_text(request: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """What ``echo`` prepends to every answer (NOTE 2)."""
    if not request.echo or messages[-1].get("role") != "assistant":
        return ""
    return messages[-1].get("content") or ""


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(request.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {reserved[0]!r} (NOTE 1 of chat.py)", "chat_template_kwargs")
    return kwargs


# --8<-- [start:render]
def render(tokenizer, template: str, messages: list[dict[str, Any]], request: ChatCompletionRequest) -> str:
    """The prompt text of ``messages`` (in the tokenizer thread); a template that raises is a 400."""
    continue_final = bool(request.continue_final_message)
    add_generation_prompt = not continue_final if request.add_generation_prompt is None else request.add_generation_prompt
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, documents=request.documents, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
            **template_kwargs(request),
        )  # fmt: skip
    except RequestError:
        raise
    except Exception as error:  # a template that raises on these messages, or does not parse
        raise RequestError(f"the chat template failed on these messages: {error}", "messages") from None
# --8<-- [end:render]
