"""Chat templates: a conversation (a list of messages) to one prompt text.

Concept: a chat model reads one token sequence, and its tokenizer ships a Jinja template
(``tokenizer_config.json`` or ``chat_template.jinja``) that writes a conversation as that
text: each message in the model's own markup, and, with ``add_generation_prompt``, the
opening of the assistant's turn; with ``continue_final_message`` the last message is left
open so the model continues it. transformers' ``apply_chat_template`` runs the template.
The text is then tokenized *without* special tokens, since the template writes them.
``LLM.chat`` (offline) and the server's ``/v1/chat/completions``
(``entrypoints/chat.py``) both render through this module.

Mirrors: ``vllm/entrypoints/chat_utils.py`` (``load_chat_template``,
``apply_hf_chat_template``, text content parts joined into one string) and
``vllm/entrypoints/llm.py`` (``LLM.chat``).

Invariants: nothing here imports torch or the server's packages; every refusal is a
``ValueError`` (or ``TypeError``) whose message names the message, part or argument.

NOTE 1 (content parts): a message's content is a string, or a list of parts as OpenAI's
API sends them; only ``{"type": "text", "text": ...}`` parts are supported (no images),
joined with newlines, as vLLM does for a model whose template expects a string.
NOTE 2 (chat_template_kwargs): extra variables for the template (``enable_thinking`` is
Qwen3's). A name that ``apply_chat_template`` itself takes (``tools``, ``tokenize``, ...) is
refused, so it cannot change how the prompt is rendered.
Left out: tools and documents for ``LLM.chat`` (the server passes them through), multimodal
parts, and vLLM's detection of templates that iterate over content parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# apply_chat_template's own parameters, which chat_template_kwargs may not set (NOTE 2)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def load_chat_template(value: str, where: str = "--chat-template") -> str:
    """A template given as a file's path or as its text (it has a ``{``), checked by Jinja's
    parser; ValueError naming ``where`` otherwise (vLLM's ``load_chat_template``)."""
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
        raise ValueError(f"{where} {value!r} is neither a file nor a Jinja template (no '{{')")
    check_template(template, where)
    return template


def check_template(template: str, where: str) -> None:
    """A Jinja syntax error in ``template`` becomes a ValueError naming ``where``."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"{where}: the chat template is not valid Jinja: {error} (line {error.lineno})") from None


# --8<-- [start:flatten]
def flatten_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template reads them: each a dict with a ``role`` and a string
    ``content``, text parts joined with newlines (NOTE 1)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of message dicts, got {messages!r}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        if "role" not in message:
            raise ValueError(f"messages[{i}] needs a 'role', got {dict(message)!r}")
        if not isinstance(message["role"], str):
            raise TypeError(f"messages[{i}]['role'] must be a str, got {message['role']!r}")
        item, content = dict(message), message.get("content")  # None or left out: OpenAI allows it
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    what = f"type {kind!r}" if kind != "text" else "a text part without a str 'text'"
                    raise ValueError(f"messages[{i}].content[{j}]: {what} is not supported (text parts only)")
                texts.append(part["text"])
            item["content"] = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise TypeError(f"messages[{i}]['content'] must be a str or a list of text parts, got {content!r}")
        out.append(item)
    return out
# --8<-- [end:flatten]


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as a dict; ValueError for a name the renderer owns (NOTE 2)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {kwargs!r}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved[0]!r} (NOTE 2 of engine/chat_template.py)")
    return dict(kwargs)


# --8<-- [start:render]
def render_chat(
    tokenizer,
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any],
    documents: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of ``messages`` (already flattened); a template that raises on them
    is a ValueError. ``tools``: the server's OpenAI function tools, for the template."""
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, documents=documents, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **template_kwargs,
        )  # fmt: skip
    except Exception as error:  # a template that raises on these messages, or does not parse
        raise ValueError(f"the chat template failed on these messages: {error}") from None
# --8<-- [end:render]
