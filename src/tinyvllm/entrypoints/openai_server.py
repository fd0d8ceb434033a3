"""The OpenAI-compatible HTTP server: ``tinyvllm serve --model DIR``, on FastAPI and uvicorn.

Concept: turn HTTP requests into ``AsyncLLM.generate`` calls and the outputs back into
OpenAI's JSON, or into server-sent events when ``"stream": true``. Every request, streamed
or not, runs as a DELTA request (``SamplingParams.output_kind``): the server sees each
new piece of text as the engine makes it, which gives the streamed chunks and the
per-token latencies alike; a non-streamed answer joins the pieces.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /metrics`` (``entrypoints/metrics.py``).

Mirrors: ``vllm/entrypoints/openai/api_server.py`` and its ``serving_completion.py`` /
``serving_chat.py``, much reduced (no tools, no logprobs, no n > 1, no LoRA).

Errors, all in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 for a body that is not JSON or does not fit the schema, and for every value that
``SamplingParams`` or ``LLM.prepare_request`` refuses (the same messages as offline);
400 for a chat request when the tokenizer has no chat template; 404 for a model name
other than the served one; 503 when ``AsyncLLM`` refuses a request past its bound on
waiting requests; 500 if the engine stopped.

NOTE 1 (the first output before the headers): a streamed response sends its 200 status
with the first chunk. The server therefore awaits the request's first output before it
answers, so that a request the engine refuses still gets its 400 or 503 status.
NOTE 2 (disconnects): a streamed response whose client goes away is cancelled by the
ASGI server; the cancellation closes the ``AsyncLLM.generate`` iterator, which aborts
the request (``async_llm.py`` NOTE 2). A non-streamed request is watched instead: while
it runs, the server polls ``Request.is_disconnected()`` every 0.2 s and cancels it when
the client is gone. Either way the request's KV blocks are free within a step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyvllm.engine.async_llm import AsyncLLM, EngineDeadError, TooManyWaitingRequestsError
from tinyvllm.entrypoints.metrics import ServerMetrics
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, error_body
from tinyvllm.outputs import RequestOutput

COMPLETION_MAX_TOKENS = 16  # protocol.py NOTE 2
DISCONNECT_POLL_S = 0.2


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.kind, self.param), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


class _Disconnected(Exception):
    """The client went away before the answer was ready (NOTE 2)."""


# --8<-- [start:handle]
class OpenAIServing:
    """What the endpoints share: the engine, the served name, the metrics."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.max_model_len = async_llm.llm.config.scheduler_config.max_model_len
        self.metrics = ServerMetrics(async_llm, served_model_name)

    def check_model(self, name: str) -> None:
        if name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    async def start(self, prompt, params, raw_request: Request) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Add the request; return its output stream and its first output (NOTE 1)."""
        stream = self.async_llm.generate(prompt, params, f"req-{uuid.uuid4().hex}")
        try:
            first = await self.until_disconnect(stream.__anext__(), raw_request)
        except (ValueError, TypeError) as error:  # SamplingParams, prepare_request, add_request
            raise bad_request(str(error)) from None
        except TooManyWaitingRequestsError as error:
            raise APIError(503, str(error), "ServiceUnavailableError") from None
        except EngineDeadError as error:
            raise APIError(500, str(error), "InternalServerError") from None
        return stream, first

    async def until_disconnect(self, awaitable, raw_request: Request):
        """Await ``awaitable``, unless the client disconnects first: then cancel it (NOTE 2)."""
        task = asyncio.ensure_future(awaitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw_request.is_disconnected():
                task.cancel()  # the cancellation reaches AsyncLLM.generate, whose finally aborts the request
                await asyncio.gather(task, return_exceptions=True)
                raise _Disconnected()
# --8<-- [end:handle]


class _Timer:
    """Per-request latencies for the histograms: time to first token, time between tokens."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = self.last = time.perf_counter()
        self.seen_first = False

    def tokens(self, out: RequestOutput) -> None:
        n = len(out.outputs[0].token_ids)
        if not n:
            return
        now = time.perf_counter()
        if not self.seen_first:
            self.metrics.time_to_first_token.observe(now - self.arrival)
            self.seen_first = True
        else:
            for _ in range(n):  # several tokens in one output share the gap
                self.metrics.inter_token_latency.observe((now - self.last) / n)
        self.last = now


def _usage(out: RequestOutput, completion_tokens: int) -> dict:
    prompt_tokens = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# --8<-- [start:respond]
async def _respond(serving: OpenAIServing, raw_request: Request, body, prompt, default_max_tokens: int, chat: bool):
    """Run one request and answer it, streamed (SSE) or as one JSON object."""
    try:
        params = body.sampling_params(default_max_tokens, stream=True)  # always DELTA inside (module docstring)
    except (ValueError, TypeError) as error:
        raise bad_request(str(error)) from None
    timer = _Timer(serving.metrics)
    try:
        stream, first = await serving.start(prompt, params, raw_request)
    except _Disconnected:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    timer.tokens(first)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": response_id, "created": created, "model": serving.served_model_name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream_events(stream, first, head, chat, include_usage, timer), media_type="text/event-stream"
        )
    try:
        text, n_tokens, out = await serving.until_disconnect(_collect(stream, first, timer), raw_request)
    except _Disconnected:
        return Response(status_code=499)
    completion = out.outputs[0]
    choice = {"index": 0, "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
              "logprobs": None}  # fmt: skip
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    kind = "chat.completion" if chat else "text_completion"
    return JSONResponse({**head, "object": kind, "choices": [choice], "usage": _usage(out, n_tokens)})


async def _collect(stream, first: RequestOutput, timer: _Timer) -> tuple[str, int, RequestOutput]:
    """Join a non-streamed request's deltas: ``(text, number of tokens, last output)``."""
    text, n_tokens, out = first.outputs[0].text, len(first.outputs[0].token_ids), first
    while not out.finished:
        out = await stream.__anext__()
        timer.tokens(out)
        text += out.outputs[0].text
        n_tokens += len(out.outputs[0].token_ids)
    return text, n_tokens, out


async def _stream_events(stream, first: RequestOutput, head: dict, chat: bool, include_usage: bool, timer: _Timer):
    """Server-sent events: one chunk per output, then the usage (if asked for), then ``[DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    n_tokens = 0
    out = first
    try:
        if chat:  # OpenAI's first chat chunk names the role
            yield _sse({**head, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                             "finish_reason": None}]})  # fmt: skip
        while True:
            completion = out.outputs[0]
            n_tokens += len(completion.token_ids)
            choice = {"index": 0, "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
            if chat:
                choice["delta"] = {"content": completion.text} if completion.text else {}
            else:
                choice["text"] = completion.text
            if completion.text or out.finished:
                yield _sse({**head, "object": kind, "choices": [choice]})
            if out.finished:
                break
            out = await stream.__anext__()
            timer.tokens(out)
        if include_usage:
            yield _sse({**head, "object": kind, "choices": [], "usage": _usage(out, n_tokens)})
    except Exception as error:  # the engine failed mid-stream: the status is sent already, say so in the stream
        yield _sse(error_body(500, str(error), "InternalServerError"))
    finally:
        await stream.aclose()  # a no-op when finished; aborts the request when the client left (NOTE 2)
    yield _sse("[DONE]")
# --8<-- [end:respond]


# --8<-- [start:build_app]
def build_app(async_llm: AsyncLLM, served_model_name: str) -> FastAPI:
    """The FastAPI app serving ``async_llm`` under the name ``served_model_name``."""
    app = FastAPI(title="tinyvllm")
    serving = OpenAIServing(async_llm, served_model_name)
    app.state.serving = serving
    tokenizer = async_llm.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, error: RequestValidationError):  # bad JSON or a field of a wrong type
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = f"{first.get('msg', 'invalid request')}" + (f" (at {where})" if where else "")
        return bad_request(message, where).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):  # unknown route, wrong method
        return APIError(error.status_code, str(error.detail), "NotFoundError" if error.status_code == 404 else
                        "BadRequestError").response()  # fmt: skip

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "tinyvllm",
                "max_model_len": serving.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request):
        serving.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise bad_request(f"one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):  # token ids
            prompt = {"prompt_token_ids": prompt}
        return await _respond(serving, raw_request, body, prompt, COMPLETION_MAX_TOKENS, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request):
        serving.check_model(body.model)
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                f"the model {served_model_name!r} has no chat template (tokenizer_config.json); use /v1/completions",
                "messages",
            )
        messages = body.messages_as_dicts()

        def render() -> dict:  # in the engine thread: the tokenizer is not thread-safe (async_llm.py NOTE 1)
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}

        try:
            prompt = await async_llm.run_in_engine_thread(render)
        except Exception as error:  # a template that raises on these messages
            raise bad_request(f"the chat template failed on these messages: {error}", "messages") from None
        default_max_tokens = max(1, serving.max_model_len - len(prompt["prompt_token_ids"]))  # protocol.py NOTE 2
        return await _respond(serving, raw_request, body, prompt, default_max_tokens, chat=True)

    return app
# --8<-- [end:build_app]


def run_server(llm, served_model_name: str, host: str, port: int, max_waiting_requests: int = 256) -> None:
    """Serve ``llm`` until interrupted (``tinyvllm serve``)."""
    import uvicorn

    async_llm = AsyncLLM(llm, max_waiting_requests=max_waiting_requests)
    uvicorn.run(build_app(async_llm, served_model_name), host=host, port=port, log_level="info")
