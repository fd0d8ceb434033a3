"""The OpenAI API's request bodies, strictly typed, and the fate of every field.

Concept: what ``POST /v1/completions`` and ``POST /v1/chat/completions`` accept, field by
field, and how a body becomes ``SamplingParams`` keyword arguments. Every field that
OpenAI's two APIs or vLLM's extra parameters define has one of three fates (the table on
docs/serving_endpoints.md, section "Every field, honoured or refused"):

- honoured: it reaches ``SamplingParams``, the prompt, the chat template or the response;
- refused: a value that asks for anything is a 400 naming the field (``REFUSED``);
- informational: accepted, and it does not change the output (``INFORMATIONAL``).

A field no schema knows is a 400 too, as OpenAI answers ("Unrecognized request argument
supplied: ..."): nothing a client sends is silently dropped.

Mirrors: ``vllm/entrypoints/openai/protocol.py`` (``CompletionRequest``,
``ChatCompletionRequest``, ``to_sampling_params``, ``ErrorResponse``).

Invariants: the models are pydantic ``strict`` (NOTE 1); a field left out is None, so
"unset" and "set to the default" differ, and only set fields override the model's
sampling defaults (``sampling_defaults.py`` NOTE 1); ``sampling_fields`` names, for each
``SamplingParams`` field it fills, the request field it came from (the ``param`` of a
later error).

NOTE 1 (strict types): a bool is not an int (``max_tokens: true``), a string is not a
number (``"10"``) nor a bool (``stream: "yes"``), and a list of bools is not a prompt of
token ids. An int is a number (``temperature: 1``), as JSON has one number type.
NOTE 2 (defaults): ``max_tokens`` left out is 16 for completions (OpenAI's legacy
endpoint) and up to the context for chat; an explicit null is up to the context for
both, as vLLM reads it. ``serving.py`` computes it with the prompt's length.
NOTE 3 (refused values): each refused field has the values that ask for nothing, which
pass (``functions: []``, ``modalities: ["text"]``), so a client that always sends them
still works; any other value is a 400.
NOTE 4 (vLLM differences): chat's ``echo`` does not ask for prompt logprobs (vLLM's
turns ``top_logprobs`` into ``prompt_logprobs``); ``max_tokens`` together with a
different ``max_completion_tokens`` is a 400 (vLLM takes the second silently); chat's
``top_logprobs`` keeps the k most likely tokens by rank.
NOTE 5 (constraints): ``response_format``, ``structured_outputs``, ``tools`` and
``tool_choice`` are typed here; ``constraints.py`` turns them into one constraint.
NOTE 6 (beam search, vLLM's ``use_beam_search``): ``to_beam_search_params`` is vLLM's
mapping: ``n`` beams, ``max_tokens``, ``ignore_eos``, ``length_penalty`` (1 unset),
``include_stop_str_in_output``, and ``temperature``, unset the model's default as for any
request. The search ranks whole sequences by the model's logprobs, so a field that shapes
sampling, stops a sequence or constrains it is a 400 naming it (``BEAM_SEARCH_REFUSED``; vLLM
ignores most of them), unless its value asks for nothing; so is ``length_penalty`` without
``use_beam_search``, and ``logprobs`` past the ``2 * n`` candidates a step keeps per token.
NOTE 7 (embeddings, ``POST /v1/embeddings``): ``EmbeddingRequest`` takes OpenAI's five fields
and vLLM's extras that a pooling engine honours; ``entrypoints/embeddings.py`` serves it.
Left out: tool-call parsers but hermes (``constraints.py`` NOTE 4), multimodal inputs,
prompt embeddings.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.beam_search import BeamSearchParams


class RequestError(ValueError):
    """A request the server refuses with 400, naming the request field ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")  # NOTE 1; unknown fields are a 400


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


# --8<-- [start:fates]
# Refused unless the value asks for nothing (NOTE 3): field -> (values that pass, why not).
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None,), "no fill-in-the-middle"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "functions": ((None, []), "OpenAI's older name: send `tools`"),
    "function_call": ((None, "none"), "OpenAI's older name: send `tool_choice`"),
    "guided_json": ((None,), "vLLM's older name: send `structured_outputs`"),
    "guided_regex": ((None,), "vLLM's older name: send `structured_outputs`"),
    "guided_choice": ((None,), "vLLM's older name: send `structured_outputs`"),
    "guided_grammar": ((None,), "vLLM's older name: send `structured_outputs`"),
    "guided_decoding_backend": ((None,), "one backend, xgrammar (vLLM's older name)"),
    "guided_whitespace_pattern": ((None,), "vLLM's older name; xgrammar takes no whitespace pattern"),
    "structural_tag": ((None,), "no structural tags; send `structured_outputs` or `tools`"),
    "audio": ((None,), "text only"),
    "modalities": ((None, ["text"]), "text only"),
    "prediction": ((None,), "no predicted outputs"),
    "web_search_options": ((None,), "no web search"),
    "reasoning_effort": ((None,), "no reasoning-effort control"),
    "verbosity": ((None,), "no verbosity control"),
    "spaces_between_special_tokens": ((None, True), "special tokens are decoded as the tokenizer writes them"),
    "logits_processors": ((None, []), "logits processors are chosen at start-up (LLM(logits_processors=...))"),
    "mm_processor_kwargs": ((None,), "text only"),
    "kv_transfer_params": ((None,), "no disaggregated serving"),
    "moderation": ((None,), "no moderation"),
}
# Accepted, and they do not change the output (OpenAI's bookkeeping fields).
INFORMATIONAL = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_options",
                 "prompt_cache_retention", "safety_identifier")  # fmt: skip
# --8<-- [end:fates]


# --8<-- [start:constraint_fields]
class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``strict``: ``constraints.py`` NOTE 5)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` extra field: ``StructuredOutputsParams``' fields, by name."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # (``json`` is a BaseModel method)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatCompletionTool(_Strict):
    """One of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": "f"}}``."""

    type: Literal["function"]
    function: NamedFunction
# --8<-- [end:constraint_fields]


# --8<-- [start:beam_search_fates]
# With ``use_beam_search``, refused unless the value asks for nothing (NOTE 6): field -> values that pass.
BEAM_SEARCH_REFUSED: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0.0), "seed": (None,),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}), "stop": (None, []), "stop_token_ids": (None, []), "min_tokens": (None, 0),
    "bad_words": (None, []), "allowed_token_ids": (None,), "prompt_logprobs": (None,),
    "thinking_token_budget": (None,), "echo": (None, False), "skip_special_tokens": (None, True),
    "vllm_xargs": (None, {}), "structured_outputs": (None,), "response_format": (None, ResponseFormat(type="text")),
    "priority": (None, 0), "tool_choice": (None, "none"),
}  # fmt: skip
# --8<-- [end:beam_search_fates]


class _RequestFields(_Strict):
    """The fields both endpoints take (the rest are on ``CompletionRequest`` and ``ChatCompletionRequest``)."""

    model: str | None = None  # None: the served model, as vLLM
    # OpenAI's sampling and output fields
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    response_format: ResponseFormat | None = None  # constraints.py
    # vLLM's sampling extras
    best_of: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    thinking_token_budget: int | None = None  # tinyvllm's, from vLLM's thinking-budget processor
    echo: bool | None = None
    add_special_tokens: bool | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    vllm_xargs: dict[str, str | int | float] | None = None
    structured_outputs: StructuredOutputsField | None = None  # constraints.py
    use_beam_search: bool | None = None  # NOTE 6
    length_penalty: float | None = None
    # refused (REFUSED)
    spaces_between_special_tokens: bool | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    priority: int | None = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    user: str | None = None  # informational (INFORMATIONAL)

    def check_refused(self) -> None:
        """A 400 for the first refused field that asks for something (NOTE 3)."""
        for name, (passing, why) in REFUSED.items():
            if name in type(self).model_fields and getattr(self, name) not in passing:
                raise RequestError(f"`{name}` is not supported ({why})", name)
        if self.stream_options is not None and not self.stream:
            raise RequestError("`stream_options` is only allowed with `stream: true`", "stream_options")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError(f"`best_of` must equal `n` ({self.n or 1}) here, got {self.best_of}", "best_of")
        if self.prompt_logprobs and self.stream:  # vLLM's rule
            raise RequestError("`prompt_logprobs` are not available with `stream: true`", "prompt_logprobs")
        k = self.truncate_prompt_tokens
        if k is not None and not (k >= 1 or k == -1):
            raise RequestError(f"`truncate_prompt_tokens` must be >= 1 or -1, got {k}", "truncate_prompt_tokens")
        if self.request_id == "" or self.cache_salt == "":
            name = "request_id" if self.request_id == "" else "cache_salt"
            raise RequestError(f"`{name}` must be a non-empty string", name)
        self.check_beam_search()

    # --8<-- [start:beam_search]
    def check_beam_search(self) -> None:
        """NOTE 6: with ``use_beam_search``, a 400 for the first field the search cannot honour;
        without it, for a ``length_penalty`` that asks for something."""
        if not self.use_beam_search:
            if self.length_penalty not in (None, 1.0):
                raise RequestError("`length_penalty` needs `use_beam_search: true` (it ranks finished beams)",
                                   "length_penalty")  # fmt: skip
            return
        for name, passing in BEAM_SEARCH_REFUSED.items():
            if name in type(self).model_fields and getattr(self, name) not in passing:
                raise RequestError(f"`{name}` is not supported with `use_beam_search` (the search ranks whole "
                                   "sequences by the model's logprobs)", name)  # fmt: skip
        param, k = self.sampling_fields().get("logprobs", (None, 0))
        candidates = 2 * (1 if self.n is None else self.n)
        if k > candidates:
            raise RequestError(f"`{param}` {k} is more than the {candidates} candidates beam search keeps per "
                               "token (2 x `n`)", param)  # fmt: skip

    def to_beam_search_params(self, max_tokens: int, default_temperature: float) -> BeamSearchParams:
        """vLLM's mapping (NOTE 6): ``n`` is the width; an unset temperature is the model's default."""
        return BeamSearchParams(
            beam_width=1 if self.n is None else self.n, max_tokens=max_tokens, ignore_eos=bool(self.ignore_eos),
            temperature=default_temperature if self.temperature is None else self.temperature,
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
        )  # fmt: skip
    # --8<-- [end:beam_search]

    # --8<-- [start:sampling_fields]
    def sampling_fields(self) -> dict[str, tuple[str, Any]]:
        """``{SamplingParams field: (request field, value)}`` for every field the request set
        (``max_tokens`` aside: ``serving.py`` sets it, NOTE 2)."""
        same = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                "bad_words", "allowed_token_ids", "prompt_logprobs", "n", "thinking_token_budget", "stop",
                "stop_token_ids")  # fmt: skip
        fields = {name: (name, getattr(self, name)) for name in same if getattr(self, name) is not None}
        if self.logit_bias is not None:  # JSON object keys are strings: "42" is token 42
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.lstrip("-").isdigit():
                    raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
                bias[int(key)] = value
            fields["logit_bias"] = ("logit_bias", bias)
        if self.vllm_xargs is not None:
            fields["extra_args"] = ("vllm_xargs", dict(self.vllm_xargs))
        return fields
    # --8<-- [end:sampling_fields]


class CompletionRequest(_RequestFields):
    """``POST /v1/completions``: a prompt (text or token ids), or a list of prompts."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    suffix: Any = None
    prompt_embeds: Any = None

    def sampling_fields(self) -> dict[str, tuple[str, Any]]:
        fields = super().sampling_fields()
        if self.logprobs is not None:
            fields["logprobs"] = ("logprobs", self.logprobs)
            if self.echo and self.prompt_logprobs is None:  # the echoed prompt's logprobs, as vLLM
                fields["prompt_logprobs"] = ("echo", self.logprobs)
        return fields


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served (``chat.py``)."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; keys other than these (``tool_calls``, ``tool_call_id``, ...) go to the template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_RequestFields):
    """``POST /v1/chat/completions``: messages, rendered by a chat template (``chat.py``)."""

    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[ChatCompletionTool] | None = None  # constraints.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call (constraints.py NOTE 2)
    include_reasoning: bool | None = None  # vLLM's (default true); false needs --reasoning-parser (reasoning.py)
    # refused (REFUSED)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    structural_tag: Any = None
    mm_processor_kwargs: Any = None
    moderation: Any = None
    # informational (INFORMATIONAL)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None

    def check_beam_search(self) -> None:
        if self.use_beam_search and self.tools and self.tool_choice != "none":  # "auto" when left out
            raise RequestError('`tool_choice` is not supported with `use_beam_search`: send `tool_choice: "none"` '
                               "for `tools` the template alone reads", "tool_choice")  # fmt: skip
        super().check_beam_search()

    def check_refused(self) -> None:
        super().check_refused()
        if self.top_logprobs and not self.logprobs:  # OpenAI's and vLLM's rule
            raise RequestError("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "`continue_final_message` and `add_generation_prompt` cannot both be true", "continue_final_message"
            )
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):  # fmt: skip
            raise RequestError(
                f"`max_tokens` ({self.max_tokens}) and `max_completion_tokens` ({self.max_completion_tokens}) "
                "disagree; send one of them", "max_completion_tokens",
            )  # fmt: skip

    def sampling_fields(self) -> dict[str, tuple[str, Any]]:
        fields = super().sampling_fields()
        if self.logprobs:
            k = self.top_logprobs or 0
            fields["logprobs"] = ("top_logprobs" if self.top_logprobs else "logprobs", k)
        return fields


class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` with a prompt (vLLM's): its token ids, their number, the context length."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeChatRequest(_Strict):
    """``POST /tokenize`` with messages: the ids of the prompt the chat template renders."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    tools: list[ChatCompletionTool] | None = None  # given to the chat template, as a chat request's
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: the text of token ids."""

    model: str | None = None
    tokens: list[int]


# --8<-- [start:embedding_request]
class PoolingInputRequest(_Strict):
    """The fields ``/v1/embeddings`` and ``/classify`` share: one input or a batch, as text or ids."""

    model: str | None = None  # None: the served model, as vLLM
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None  # informational
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # None: True, as for completions
    request_id: str | None = None
    priority: int | None = None

    def check(self) -> None:
        """A 400 naming the field for a value no model could take (the model's own checks come later)."""
        k = self.truncate_prompt_tokens
        if k is not None and not (k >= 1 or k == -1):
            raise RequestError(f"`truncate_prompt_tokens` must be >= 1 or -1, got {k}", "truncate_prompt_tokens")
        if self.request_id == "":
            raise RequestError("`request_id` must be a non-empty string", "request_id")
        if self.input == [] or self.input == "":
            raise RequestError("`input` must not be empty", "input")


class EmbeddingRequest(PoolingInputRequest):
    """``POST /v1/embeddings`` (NOTE 7): OpenAI's fields and vLLM's extras."""

    encoding_format: Literal["float", "base64"] | None = None  # None: "float"
    dimensions: int | None = None  # a matryoshka model's first values (pooling_params.py NOTE 1)
    normalize: bool | None = None  # None: the engine's --pooler-config


class ClassificationRequest(PoolingInputRequest):
    """``POST /classify`` (vLLM's): each input's label scores from a classifier."""

    use_activation: bool | None = None  # None: on (softmax or sigmoid, as the model says)


class PoolingRequest(PoolingInputRequest):
    """``POST /pooling`` (vLLM's): each input's result for ``task``, as the pooler makes it."""

    task: str | None = None  # None: the model's first (pooling_params.py NOTE 3)
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    encoding_format: Literal["float", "base64"] | None = None  # None: "float"; base64: pooling.py NOTE 2
# --8<-- [end:embedding_request]
