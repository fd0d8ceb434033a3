"""``POST /tokenize`` and ``POST /detokenize``: the served tokenizer, over HTTP (vLLM's routes).

Concept: a client counts a prompt's tokens before it sends it, or reads the text of ids.
``/tokenize`` takes a ``prompt`` or chat ``messages`` (rendered by the same template as a
chat request, ``chat.py``, its ``tools`` too) and answers ``{"count", "max_model_len", "tokens",
"token_strs"}``; ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. Both run
on the tokenizer's thread (``engine/prompt_tokenizer.py``).

Mirrors: ``vllm/entrypoints/openai/serving_tokenization.py``.

Invariants: a text that certainly has more than ``max_model_len`` tokens is refused
without tokenizing (``prompt_tokenizer.py`` NOTE 2), so no request ties the tokenizer's
thread up for seconds; otherwise the count is given even past ``max_model_len`` (a client
may want to know by how much to cut). Ids outside the vocabulary are a 400 naming
``tokens``.
"""

from __future__ import annotations

from tinyvllm.entrypoints.chat import messages_as_dicts, render
from tinyvllm.entrypoints.protocol import DetokenizeRequest, RequestError, TokenizeChatRequest, TokenizeCompletionRequest
from tinyvllm.entrypoints.serving import OpenAIServing


# --8<-- [start:tokenize]
async def tokenize(serving: OpenAIServing, body: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    """``/tokenize``: the prompt's (or the rendered messages') ids, on the tokenizer's thread."""
    serving.check_model(body.model)
    tokenizer = serving.async_llm.prompt_tokenizer
    if isinstance(body, TokenizeChatRequest):
        messages, template = messages_as_dicts(body), serving.template(body)

        def work() -> str:
            return render(tokenizer.tokenizer, template, messages, body)

        text, field = await serving.async_llm.run_in_tokenizer_thread(work), "messages"
        add_special = bool(body.add_special_tokens)  # the template writes the special tokens
    else:
        text, field = body.prompt, "prompt"
        add_special = True if body.add_special_tokens is None else body.add_special_tokens

    def encode() -> tuple[list[int], list[str] | None]:
        try:
            tokenizer.check_text(text)  # certainly too long: refused without tokenizing
        except ValueError as error:
            raise RequestError(str(error), field) from None
        ids = tokenizer.encode(text, add_special, limit=False)
        return ids, tokenizer.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None

    ids, strs = await serving.async_llm.run_in_tokenizer_thread(encode)
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}
# --8<-- [end:tokenize]


async def detokenize(serving: OpenAIServing, body: DetokenizeRequest) -> dict:
    """``/detokenize``: the text of ``tokens`` (special tokens kept, as vLLM's)."""
    serving.check_model(body.model)
    bad = next((t for t in body.tokens if not 0 <= t < serving.vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {serving.vocab_size})", "tokens")
    decode = serving.async_llm.prompt_tokenizer.tokenizer.decode
    return {"prompt": await serving.async_llm.run_in_tokenizer_thread(decode, body.tokens)}
