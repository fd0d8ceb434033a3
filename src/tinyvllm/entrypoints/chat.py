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

The rendering itself (loading and checking templates, joining text parts, the reserved
``chat_template_kwargs``, ``apply_chat_template``) is ``engine/chat_template.py``, shared with
the offline ``LLM.chat``; this module turns its ValueErrors into 400s naming the field.

Mirrors: ``vllm/entrypoints/chat_utils.py`` (``apply_hf_chat_template``,
``load_chat_template``, content parts flattened to a string) and ``serving_chat.py``
(``echo`` of the last message).

Invariants: ``render`` runs in the tokenizer thread (``engine/prompt_tokenizer.py``): the
template and the tokenizer copy are used by that thread alone. Every content part is
text, joined with newlines; any other part type is a 400 naming its place.

NOTE 1 (chat_template_kwargs): extra variables for the template (``enable_thinking`` is
Qwen3's). A name that ``apply_chat_template`` itself takes (``tools``, ``tokenize``, ...)
is a 400, so it cannot change how the server renders (``engine/chat_template.py`` NOTE 2).
NOTE 2 (echo): as vLLM's, ``echo`` prepends the last message's content to the answer
when that message is the assistant's (the model continues it); otherwise it adds nothing.
NOTE 3 (tools): the request's ``tools`` reach the template as ``tools`` (whatever
``tool_choice`` says, as vLLM renders them), so a template that describes functions to the
model (Qwen3's) does; the shipped model's template ignores them.
"""

from __future__ import annotations

from typing import Any

from tinyvllm.engine.chat_template import check_template_kwargs, flatten_messages, render_chat
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, RequestError


def messages_as_dicts(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template reads them: content parts joined into one string."""
    if not request.messages:
        raise RequestError("`messages` must hold at least one message", "messages")
    try:
        return flatten_messages([message.model_dump(exclude_none=True) for message in request.messages])
    except (TypeError, ValueError) as error:
        raise RequestError(str(error), "messages") from None


def echo_text(request: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
    """What ``echo`` prepends to every answer (NOTE 2)."""
    if not request.echo or messages[-1].get("role") != "assistant":
        return ""
    return messages[-1].get("content") or ""


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    try:
        return check_template_kwargs(request.chat_template_kwargs)
    except ValueError as error:
        raise RequestError(str(error), "chat_template_kwargs") from None


# --8<-- [start:render]
def render(tokenizer, template: str, messages: list[dict[str, Any]], request: ChatCompletionRequest) -> str:
    """The prompt text of ``messages`` (in the tokenizer thread); a template that raises is a 400."""
    continue_final = bool(request.continue_final_message)
    add_generation_prompt = not continue_final if request.add_generation_prompt is None else request.add_generation_prompt
    kwargs = template_kwargs(request)
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None  # NOTE 3
    try:
        return render_chat(
            tokenizer, template, messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final, template_kwargs=kwargs, documents=request.documents, tools=tools,
        )  # fmt: skip
    except ValueError as error:
        raise RequestError(str(error), "messages") from None
# --8<-- [end:render]
