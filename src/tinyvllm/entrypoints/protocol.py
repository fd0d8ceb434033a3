"""The OpenAI API's request bodies and error shape, as pydantic models.

Concept: what ``POST /v1/completions`` and ``POST /v1/chat/completions`` accept, and how
a request body becomes ``SamplingParams``. The models only check the JSON types;
``SamplingParams`` checks the values (one place for every range check), and its
``TypeError`` or ``ValueError`` becomes an HTTP 400 in ``openai_server.py``.

Mirrors: ``vllm/entrypoints/openai/protocol.py`` (``CompletionRequest``,
``ChatCompletionRequest``, ``ErrorResponse``), a much smaller subset.

NOTE 1 (fields): the sampling fields are OpenAI's (``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop``, ``logit_bias``, ``n``) plus vLLM's extras (``top_k``,
``min_p``, ``ignore_eos``, ``include_stop_str_in_output``). Fields the server does not
know are ignored, as OpenAI's own server ignores unknown fields it does not use; ``n``
must be 1 (one completion per request; send n requests for n completions).
NOTE 2 (defaults): ``max_tokens`` defaults to 16 for completions, as OpenAI's legacy
endpoint; for chat it defaults to what the context leaves (``max_model_len`` minus the
prompt), as vLLM does. ``temperature`` defaults to 1, as OpenAI's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tinyvllm.sampling_params import RequestOutputKind, SamplingParams


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


class StreamOptions(BaseModel):
    include_usage: bool = False


# --8<-- [start:sampling_fields]
class _SamplingFields(BaseModel):
    """The fields both endpoints share (NOTE 1); turned into ``SamplingParams`` by ``sampling_params``."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def sampling_params(self, default_max_tokens: int, stream: bool) -> SamplingParams:
        """The request's ``SamplingParams``; TypeError or ValueError (an HTTP 400) for a bad value."""
        if self.n != 1:
            raise ValueError(f"n must be 1 (this server returns one completion per request), got {self.n}")
        bias = None
        if self.logit_bias is not None:  # JSON object keys are strings: "42" is token 42
            bias = {}
            for key, value in self.logit_bias.items():
                if not key.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                bias[int(key)] = value
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            logit_bias=bias,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )
# --8<-- [end:sampling_fields]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a text prompt, or a prompt given as token ids."""

    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages, rendered by the tokenizer's chat template."""

    messages: list[ChatMessage]

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]
