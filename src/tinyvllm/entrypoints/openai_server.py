"""The OpenAI-compatible HTTP server: ``tinyvllm serve --model DIR``, on FastAPI and uvicorn.

Concept: the HTTP layer around ``serving.py``: the routes, reading and checking a body,
the errors in OpenAI's shape, and four middlewares (NOTE 1). What a request does once
its body is checked is ``serving.py``'s.

Endpoints: ``GET``/``HEAD /health``, ``GET /version``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/embeddings`` (a pooling
engine's, ``embeddings.py``), ``POST /classify`` (a classifier's, ``classify.py``), ``POST /pooling``
(any pooling task, ``pooling.py``), ``POST /score`` and ``/rerank`` (a pooling engine's, ``scoring.py``),
``POST /tokenize``, ``POST /detokenize``, ``GET /metrics`` (``metrics.py``).

Mirrors: ``vllm/entrypoints/openai/api_server.py`` (its routes, ``--api-key``'s
``AuthenticationMiddleware``, ``--allowed-origins``' CORS, the ``X-Request-Id`` header of
``--enable-request-id-headers``, the ``validation_exception_handler``).

Errors, all ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the
request field where there is one: 400 for a body that is not JSON, does not fit the
schema (NOTE 2), or holds a value the server or the engine refuses; 401 for a missing or
wrong API key; 404 for an unknown route or model; 413 for a body over the limit; 503 past
the waiting bound or while shutting down; 500 if the engine stopped.

NOTE 1 (middlewares, outermost first): CORS (only with ``allowed_origins``; a preflight
``OPTIONS`` is answered before anything else), the request id (every response carries
``X-Request-Id``: the client's, else the body's ``request_id``, else a new one), the API
key (only ``/v1/...`` routes, as vLLM; ``Authorization: Bearer KEY`` compared in constant
time), the body limit (``Content-Length`` over ``max_request_body_bytes`` is a 413 before
anything is read; a body sent without a length is counted as it arrives).
NOTE 2 (reading a body): the server reads the bytes itself and validates them with
pydantic's strict JSON mode (``protocol.py`` NOTE 1), so a wrong type is a 400 naming the
field, and a field no schema knows is a 400 naming it. The message names the deepest place
every union branch failed at (``messages[0].content``, ``prompt[0][1]``; pydantic's branch
names left out of the path) and that place's JSON type; a value only one branch could read
(a list for ``content``) is reported inside that branch.
NOTE 3 (start and stop, vLLM's ``--shutdown-timeout``): once it listens, ``run_server``
prints a banner (name, address, ``max_model_len``, KV blocks). On SIGTERM or Ctrl-C it
stops accepting, lets the running requests go on for ``shutdown_timeout`` seconds (0, the
default as in vLLM: none), then aborts the rest: each answer ends with ``finish_reason:
"abort"`` (``serving.py`` NOTE 7). uvicorn cuts what is still open 5 s later.
Left out: vLLM's ``--root-path``, ``--allow-credentials``, SSL flags, the ``/ping``,
``/load`` and LoRA routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import sys
import time
import types
import typing
import uuid

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import tinyvllm
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.entrypoints.classify import create_classification
from tinyvllm.entrypoints.constraints import TOOL_CALL_PARSERS
from tinyvllm.entrypoints.embeddings import create_embedding
from tinyvllm.entrypoints.pooling import create_pooling
from tinyvllm.entrypoints.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    RequestError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
)
from tinyvllm.entrypoints.scoring import RerankRequest, ScoreRequest, create_rerank, create_score
from tinyvllm.entrypoints.serving import APIError, OpenAIServing
from tinyvllm.entrypoints.tokenization import detokenize as detokenize_ids
from tinyvllm.entrypoints.tokenization import tokenize as tokenize_text
from tinyvllm.validation import check_real

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024  # 16 MiB
DEFAULT_SHUTDOWN_TIMEOUT_S = 0.0  # vLLM's --shutdown-timeout default: abort what runs at once (NOTE 3)
SHUTDOWN_GRACE_S = 5.0  # after the aborts, how long the answers get to end before uvicorn cuts them


class BodyTooLarge(Exception):
    """A body without ``Content-Length`` grew past the limit while it was read (NOTE 1)."""


def _json_response(status: int, body: dict, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _too_large(limit: int) -> JSONResponse:
    return _json_response(413, error_body(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)",
                                          "RequestTooLargeError"))  # fmt: skip


# --8<-- [start:middleware]
class BodyLimitMiddleware:
    """413 past ``limit`` bytes, before the JSON is parsed (NOTE 1)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _too_large(self.limit)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge()
            return message

        await self.app(scope, counted, send)


class RequestIdMiddleware:
    """Every response carries ``X-Request-Id`` (NOTE 1)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")
        state = scope.setdefault("state", {})
        fallback = given.decode("latin-1") if given else uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                request_id = state.get("request_id") or fallback  # the id serving.py used, if it ran
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyMiddleware:
    """``/v1/...`` needs ``Authorization: Bearer <key>`` (NOTE 1); 401 in OpenAI's shape otherwise."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        body = error_body(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                          "AuthenticationError")  # fmt: skip
        await _json_response(401, body, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
# --8<-- [end:middleware]


_NOUNS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}


def _json_noun(annotation) -> str:
    """A type in JSON's words: ``list[list[int]]`` is "array of arrays of integers"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_json_noun(a) for a in args)
    if origin is list:
        inner = _json_noun(args[0])
        return "array of " + (inner.replace("array of", "arrays of", 1) if inner.startswith("array") else inner + "s")
    if origin is typing.Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)):
        return "object"
    return _NOUNS.get(annotation, "any value")


def _json_type(annotation) -> str:
    """``int | None`` is "an integer or null"."""
    words = _json_noun(annotation)
    return words if words.startswith("one of") else ("an " if words[0] in "aeiou" else "a ") + words


# --8<-- [start:invalid_body]
def _members(annotation) -> tuple:
    """A union's types, None left out (``int | None`` is ``(int,)``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _label(annotation) -> str:
    """How pydantic names a union's branch in an error's location (``list[ContentPart]``)."""
    args = typing.get_args(annotation)
    if not args:
        return getattr(annotation, "__name__", str(annotation))
    return f"{typing.get_origin(annotation).__name__}[{','.join(_label(a) for a in args)}]"


def _child(annotation, key):
    """The type of ``value[key]`` for a value of type ``annotation`` (None: unknown)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and isinstance(key, int):
        return args[0]
    if origin is dict and isinstance(key, str):
        return args[1]
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel) and isinstance(key, str):
        fields = annotation.model_fields
        info = fields.get(key) or next((f for f in fields.values() if f.alias == key), None)  # ``json``: ``json_``
        return None if info is None else info.annotation
    return None


def _site(model: type[pydantic.BaseModel], loc: tuple) -> tuple[tuple, typing.Any]:
    """``loc`` without pydantic's union branch names, and the type of the value there (NOTE 2)."""
    path: list = []
    here = current = model
    for key in loc:
        members = _members(current) if current is not None else ()
        if len(members) > 1 and isinstance(key, str):  # a union: the key names the branch pydantic tried
            current = next((m for m in members if _label(m) == key), None)
            continue
        path.append(key)
        here = current = _child(members[0] if members else None, key)
    return tuple(path), here


def _where(path: tuple) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    rest = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if p.isidentifier() else f"[{json.dumps(p)}]"
                   for p in path[1:])  # fmt: skip
    return f"{path[0]}{rest}"


def invalid_body(model: type[pydantic.BaseModel], error: pydantic.ValidationError) -> APIError:
    """A pydantic error as a 400 naming the top-level field, and the deepest place the body
    went wrong with what that place must be (NOTE 2)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first['msg']}", "BadRequestError")
    if not first["loc"]:
        return APIError(400, "the body must be a JSON object", "BadRequestError")
    field = str(first["loc"][0])
    if first["type"] == "extra_forbidden" and len(first["loc"]) == 1:
        return APIError(400, f"Unrecognized request argument supplied: {field}", "BadRequestError", field)
    if first["type"] == "missing" and len(first["loc"]) == 1:
        return APIError(400, f"`{field}` is required", "BadRequestError", field)
    mine = [(e, *_site(model, e["loc"])) for e in errors if e["loc"] and e["loc"][0] == first["loc"][0]]
    deepest = max(len(path) for _, path, _ in mine)
    tried = [e["loc"] for e, path, _ in mine if len(path) == deepest]
    common = tried[0][: next((i for i, part in enumerate(zip(*tried)) if len(set(part)) > 1), min(map(len, tried)))]
    path, annotation = _site(model, common)  # where every deepest branch went wrong: a union there, or one error
    at = [e for e, p, _ in mine if p == path]
    value = (at[0] if at else min((e for e, _, _ in mine), key=lambda e: len(e["loc"])))["input"]
    got = json.dumps(value, default=str)
    got = got if len(got) <= 60 else got[:57] + "..."
    single = at[0] if len(at) == 1 and len(tried) == 1 else None
    wrong_type = single is None or single["type"].endswith("_type") or single["type"] == "literal_error"
    if annotation is not None and wrong_type:
        message = f"`{_where(path)}` must be {_json_type(annotation)}, got {got}"
    else:
        message = f"`{_where(path)}`: {(single or first)['msg']}, got {got}"
    return APIError(400, message, "BadRequestError", field)
# --8<-- [end:invalid_body]


async def _parse(raw_request: Request, model: type[pydantic.BaseModel]):
    raw = await raw_request.body()
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as error:
        raise invalid_body(model, error) from None


def _request_id(raw_request: Request, body) -> str:
    """The header's id, else the body's ``request_id``, else a new one; the response header says which."""
    request_id = raw_request.headers.get("x-request-id") or getattr(body, "request_id", None) or uuid.uuid4().hex
    raw_request.state.request_id = request_id
    return request_id


# --8<-- [start:build_app]
def build_app(
    async_llm: AsyncLLM,
    served_model_name: str,
    *,
    chat_template: str | None = None,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``async_llm`` as ``served_model_name`` (``chat_template``: the
    ``--chat-template`` text, which wins over the tokenizer's; ``tool_call_parser``: what reads
    ``tool_choice: "auto"`` answers, ``constraints.py`` NOTE 4; ``reasoning_parser``: what splits
    chat answers into ``reasoning`` and ``content``, ``reasoning.py``; a bad one is a ValueError)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS} or None, got {tool_call_parser!r}")
    serving = OpenAIServing(async_llm, served_model_name, chat_template, tool_call_parser, reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # the metrics observe the engine's steps while the app runs
        async_llm.engine.add_observer(serving.metrics)  # metrics.py NOTE 3
        try:
            yield
        finally:
            async_llm.engine.remove_observer(serving.metrics)

    app = FastAPI(title="tinyvllm", version=tinyvllm.__version__, lifespan=lifespan)
    app.state.serving = serving
    app.add_middleware(BodyLimitMiddleware, limit=max_request_body_bytes)  # innermost (NOTE 1)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["X-Request-Id"])  # fmt: skip

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError):
        return APIError(400, str(error), "BadRequestError", error.param).response()

    @app.exception_handler(BodyTooLarge)
    async def _body_too_large(request: Request, error: BodyTooLarge):
        return _too_large(max_request_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException):  # unknown route, wrong method
        kind = "NotFoundError" if error.status_code == 404 else "BadRequestError"
        return APIError(error.status_code, str(error.detail), kind).response()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": tinyvllm.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "tinyvllm",
                "max_model_len": serving.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        arrival = time.perf_counter()
        body = await _parse(raw_request, CompletionRequest)
        return await serving.completions(body, raw_request, _request_id(raw_request, body), arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request):
        arrival = time.perf_counter()
        body = await _parse(raw_request, ChatCompletionRequest)
        return await serving.chat(body, raw_request, _request_id(raw_request, body), arrival)

    @app.post("/v1/embeddings")
    async def embeddings(raw_request: Request):
        arrival = time.perf_counter()
        body = await _parse(raw_request, EmbeddingRequest)
        return await create_embedding(serving, body, raw_request, _request_id(raw_request, body), arrival)

    @app.post("/classify")
    async def classify(raw_request: Request):
        arrival = time.perf_counter()
        body = await _parse(raw_request, ClassificationRequest)
        return await create_classification(serving, body, raw_request, _request_id(raw_request, body), arrival)

    @app.post("/pooling")
    async def pooling(raw_request: Request):
        arrival = time.perf_counter()
        body = await _parse(raw_request, PoolingRequest)
        return await create_pooling(serving, body, raw_request, _request_id(raw_request, body), arrival)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(raw_request: Request):
        arrival = time.perf_counter()
        body = await _parse(raw_request, ScoreRequest)
        return await create_score(serving, body, raw_request, _request_id(raw_request, body), arrival)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(raw_request: Request):
        arrival = time.perf_counter()
        body = await _parse(raw_request, RerankRequest)
        return await create_rerank(serving, body, raw_request, _request_id(raw_request, body), arrival)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request):
        raw = await raw_request.body()
        try:
            is_chat = b'"messages"' in raw and "messages" in json.loads(raw)
        except (ValueError, TypeError):
            is_chat = False
        model = TokenizeChatRequest if is_chat else TokenizeCompletionRequest
        try:
            body = model.model_validate_json(raw)
        except pydantic.ValidationError as error:
            raise invalid_body(model, error) from None
        return await tokenize_text(serving, body)

    @app.post("/detokenize")
    async def detokenize(raw_request: Request):
        return await detokenize_ids(serving, await _parse(raw_request, DetokenizeRequest))

    return app
# --8<-- [end:build_app]


# --8<-- [start:run_server]
class DrainingServer(uvicorn.Server):
    """uvicorn's server with tinyvllm's start-up banner and a drain of at most
    ``shutdown_timeout`` seconds (NOTE 3)."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.serving, self.shutdown_timeout = serving, shutdown_timeout

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print("\n".join(f"[tinyvllm] {line}" for line in banner(self.serving, host, port, self.shutdown_timeout)),
                  file=sys.stderr, flush=True)  # fmt: skip

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.ensure_future(self._abort_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)  # stops accepting, waits for the open answers
        finally:
            deadline.cancel()
            await asyncio.gather(deadline, return_exceptions=True)

    async def _abort_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        aborted: set[str] = set()
        while True:  # again until the answers are done: a request may reach the engine after a round
            new = await self.serving.abort_all()
            if new - aborted:
                aborted |= new
                count = f"{len(aborted)} request{'' if len(aborted) == 1 else 's'}"
                print(f"[tinyvllm] shutdown_timeout {seconds:g} s passed: aborted {count} still running",
                      file=sys.stderr, flush=True)  # fmt: skip
            await asyncio.sleep(0.1)


def banner(serving: OpenAIServing, host: str, port: int, shutdown_timeout: float) -> list[str]:
    """What ``serve`` prints once it listens: the model, where, the context and the KV cache."""
    engine = serving.async_llm.engine
    blocks = engine.scheduler.kv_cache_manager.num_gpu_blocks
    block_size = engine.config.cache_config.block_size
    address = f"[{host}]" if ":" in host else host
    return [
        f"serving {serving.served_model_name!r} at http://{address}:{port}/v1",
        f"max_model_len {serving.max_model_len}; KV cache {blocks} blocks of {block_size} tokens "
        f"({blocks * block_size} tokens)",
        f"max_waiting_requests {serving.async_llm.max_waiting_requests}; shutdown_timeout {shutdown_timeout:g} s",
    ]


def run_server(
    llm, served_model_name: str, host: str, port: int, max_waiting_requests: int = 256,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, sock: socket.socket | None = None, **app_options,
) -> None:  # fmt: skip
    """Serve ``llm`` until SIGTERM or Ctrl-C (``tinyvllm serve``); ``app_options`` go to
    ``build_app``. On the signal the server stops accepting, lets the running requests go
    on for ``shutdown_timeout`` seconds, then aborts the rest (NOTE 3). ``sock``: a socket
    already bound to ``host:port`` (the CLI binds it before the model loads), else uvicorn
    binds one."""
    shutdown_timeout = check_real("shutdown_timeout", shutdown_timeout)
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout!r}")
    async_llm = AsyncLLM(llm.engine, max_waiting_requests=max_waiting_requests)
    app = build_app(async_llm, served_model_name, **app_options)
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S)  # fmt: skip
    DrainingServer(config, app.state.serving, shutdown_timeout).run(sockets=None if sock is None else [sock])
# --8<-- [end:run_server]
