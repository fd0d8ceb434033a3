"""Embeddings over HTTP: ``POST /v1/embeddings`` on a pooling engine (``tinyvllm serve --runner pooling``).

Concept: the steps one embeddings request takes, in order, each refusal a 400 naming its
field before any engine request exists:

1. checks that need no prompt: the model name (404), an engine that pools (NOTE 2), the
   body's values (``EmbeddingRequest.check``), ``dimensions``/``normalize`` against the model
   (``pooling_params.resolve_pooling_params``), the waiting bound;
2. the inputs, on the tokenizer's thread: each text tokenized (or its ids taken), cut to
   ``truncate_prompt_tokens``, then refused if empty, longer than the context, or holding an
   id outside the vocabulary, naming ``input`` and the index (``input[2]``);
3. the engine: one ``AsyncLLM.encode`` per input, all queued at once, their outputs awaited
   together (``streams.first_outputs``): one that fails, or a client that leaves, aborts the
   others (NOTE 3). ``encode_all`` does it, for ``scoring.py``'s ``/score`` and ``/rerank`` too;
4. the answer: OpenAI's list of ``{"object": "embedding", "embedding", "index"}`` in input
   order, as floats or base64 (NOTE 1), and the usage: the prompts' tokens.

Mirrors: ``vllm/entrypoints/openai/serving_embedding.py`` (``OpenAIServingEmbedding``) and
the embedding request and response of ``vllm/entrypoints/openai/protocol.py``.

Invariants: the answer's ``data[i]`` is input ``i``'s vector, equal to what
``LLM(runner="pooling").embed`` gives for the same ids; every engine request this module
starts has finished or been aborted when the handler returns.

NOTE 1 (base64, what the ``openai`` client asks for by default): the vector's float32
values, little-endian, 4 bytes each, base64-encoded; the client decodes them back to the
same floats. ``"float"`` (the default here, as OpenAI's API) sends them as JSON numbers,
each the exact float32 value.
NOTE 2 (one engine, one kind of work): an engine generates or pools (``engine_args.py``
NOTE 12), so a generating server answers this route with a 400 naming ``model`` (vLLM's
"does not support Embeddings API"), and a pooling server answers completions and chat
with one (``OpenAIServing.check_generates``); each says which server to start.
NOTE 3 (many inputs): each input is its own engine request (``embd-<id>-<i>-<8 hex>``), so
the scheduler batches them as it batches any prompts. Nothing is streamed: a client that
leaves is seen by ``until_disconnect`` (``serving.py`` NOTE 4), which cancels the wait, and
``first_outputs`` closes every ``encode``, aborting the unfinished ones.
NOTE 4 (metrics): each input counts its prompt tokens and one ``request_success`` with
``finished_reason="stop"``; an embedding has no first token, so no latency but end to end.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyvllm.engine.async_llm import TooManyWaitingRequestsError
from tinyvllm.entrypoints.protocol import EmbeddingRequest, PoolingInputRequest, RequestError
from tinyvllm.entrypoints.serving import APIError, Disconnected, OpenAIServing
from tinyvllm.entrypoints.streams import first_outputs
from tinyvllm.outputs import PoolingRequestOutput
from tinyvllm.pooling_params import PoolingParams, resolve_pooling_params

PARAM_WORDS = {"dimensions": "dimensions", "normalize": "normalize", "prompt": "input", "prompt_token_ids": "input"}


def check_pools(serving: OpenAIServing, api: str = "Embeddings API", tasks: tuple[str, ...] = ("embed",)) -> None:
    """NOTE 2: this route needs an engine built with ``runner="pooling"`` whose model does one of ``tasks``."""
    model = serving.async_llm.input_processor.pooling_model
    if model is None:
        raise APIError(400, f"The model does not support {api}: this server generates text; start an "
                       "embedding server with `tinyvllm serve --runner pooling`", "BadRequestError", "model")  # fmt: skip
    if not set(tasks) & set(model.tasks):
        routes = "POST /classify" if "classify" in model.tasks else "POST /v1/embeddings"
        raise APIError(400, f"The model does not support {api}: its tasks are {list(model.tasks)} (send {routes})",
                       "BadRequestError", "model")  # fmt: skip


def pooling_params(serving: OpenAIServing, body: EmbeddingRequest) -> PoolingParams:
    """The request's ``PoolingParams``, checked against the model now (the input processor resolves them again)."""
    try:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize, task="embed")
        resolve_pooling_params("the request", params, serving.async_llm.input_processor.pooling_model)
    except (TypeError, ValueError) as error:
        raise RequestError(str(error), "dimensions") from None  # normalize is a bool already: only dimensions can fail
    return params


# --8<-- [start:token_ids]
def token_ids(serving: OpenAIServing, inputs: list, names: list[str], add_special: bool, truncate: int | None) -> list[list[int]]:
    """In the tokenizer thread: each input's ids, cut to the last ``truncate``, each refused
    (naming ``names[i]``, its field ``input`` of ``input[2]`` the param) if empty, past the
    context or outside the vocabulary."""
    tokenizer, vocab_size = serving.async_llm.prompt_tokenizer, serving.vocab_size
    all_ids = []
    for i, (given, name) in enumerate(zip(inputs, names)):
        field = name.partition("[")[0]
        try:
            ids = tokenizer.encode(given, add_special, i, limit=truncate is None) if isinstance(given, str) else list(given)
            ids = ids if truncate is None else ids[-truncate:]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            tokenizer.check_length(len(ids), i)
        except ValueError as error:  # "prompt 2 has 300 tokens, ..." as "`input[2]` has 300 tokens, ..."
            raise RequestError(f"`{name}` {str(error).removeprefix(f'prompt {i} ')}", field) from None
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(f"`{name}` has token id {bad}, outside the vocabulary [0, {vocab_size})", field)
        all_ids.append(ids)
    return all_ids
# --8<-- [end:token_ids]


def _inputs(given) -> tuple[list, list[str]]:
    """The inputs as a list, and the name of each in messages: ``input`` alone, ``input[i]`` in a list."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given], ["input"]
    return list(given), [f"input[{i}]" for i in range(len(given))]


# --8<-- [start:encoded]
def encoded(values: list[float], encoding_format: str | None) -> list[float] | str:
    """One vector as the request asks (NOTE 1): JSON floats, or base64 of float32 little-endian."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values
# --8<-- [end:encoded]


# --8<-- [start:create_embedding]
async def create_embedding(serving: OpenAIServing, body: EmbeddingRequest, raw_request: Request, request_id: str,
                           arrival: float):  # fmt: skip
    """``POST /v1/embeddings``: the module's four steps."""
    response_id = f"embd-{request_id}"
    outputs = await pool_inputs(serving, body, raw_request, response_id, arrival, lambda: pooling_params(serving, body))
    if isinstance(outputs, Response):
        return outputs  # the client left
    data = [{"object": "embedding", "embedding": encoded(out.outputs.data.tolist(), body.encoding_format), "index": i}
            for i, out in enumerate(outputs)]  # fmt: skip
    return pooling_answer(serving, response_id, data, outputs)


async def pool_inputs(serving: OpenAIServing, body: PoolingInputRequest, raw_request: Request, response_id: str,
                      arrival: float, params_of: Callable[[], PoolingParams], api: str = "Embeddings API",
                      tasks: tuple[str, ...] = ("embed",)) -> list[PoolingRequestOutput] | Response:  # fmt: skip
    """Steps 1 to 3 for one body of inputs (``/v1/embeddings``, ``/classify``): each input's
    output in order, counted (NOTE 4); a 499 ``Response`` if the client left. ``params_of``
    makes the request's params once the engine is known to pool (``api``, ``tasks``: NOTE 2)."""
    serving.check_model(body.model)
    check_pools(serving, api, tasks)  # NOTE 2
    body.check()
    if serving.closing:  # serving.py NOTE 7
        raise APIError(503, "the server is shutting down", "ServiceUnavailableError")
    inputs, names = _inputs(body.input)
    check_bound(serving, len(inputs), "inputs", "input")
    params, priority, truncate = params_of(), serving._priority(body), serving._truncate(body)
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    prompts = await serving.async_llm.run_in_tokenizer_thread(token_ids, serving, inputs, names, add_special, truncate)
    outputs = await encode_all(serving, prompts, params, response_id, priority, raw_request, PARAM_WORDS)
    if not isinstance(outputs, Response):
        count_outputs(serving, outputs, arrival)
    return outputs


def check_bound(serving: OpenAIServing, n: int, what: str, field: str) -> None:
    """A request of ``n`` engine requests that could never wait together is a 400 naming ``field``."""
    bound = serving.async_llm.max_waiting_requests
    if n > bound:
        raise RequestError(f"{n} {what} can never wait together: this server queues at most {bound} "
                           f"(max_waiting_requests); send at most {bound} in one request", field)  # fmt: skip


def pooling_answer(serving: OpenAIServing, response_id: str, data: list, outputs: list) -> JSONResponse:
    """Step 4's envelope: the list of ``data`` and the usage, the prompts' tokens."""
    n_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return JSONResponse({"id": response_id, "object": "list", "created": int(time.time()),
                         "model": serving.served_model_name, "data": data,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})  # fmt: skip
# --8<-- [end:create_embedding]


# --8<-- [start:encode_all]
async def encode_all(serving: OpenAIServing, prompts: list[list[int]], params: PoolingParams, response_id: str,
                     priority: int, raw_request: Request,
                     words: dict[str, str]) -> list[PoolingRequestOutput] | Response:  # fmt: skip
    """Step 3 (NOTE 3): one ``AsyncLLM.encode`` per prompt's ids, all queued at once, every
    output awaited together, in order; a 499 ``Response`` if the client left. An error aborts
    them all (``words``: ``param_of``'s names for the engine's messages)."""
    streams = [serving.async_llm.encode({"prompt_token_ids": ids}, params, f"{response_id}-{i}-{uuid.uuid4().hex[:8]}",
                                        priority=priority) for i, ids in enumerate(prompts)]  # fmt: skip
    try:
        outputs = await serving.until_disconnect(first_outputs(streams), raw_request)  # NOTE 3
    except Disconnected:
        return Response(status_code=499)
    except (ValueError, TypeError) as error:  # the input processor, the engine
        raise serving._bad_request(error, words) from None
    except TooManyWaitingRequestsError as error:
        raise APIError(503, str(error), "ServiceUnavailableError") from None
    except Exception as error:  # a step failed (its requests are aborted), or EngineDeadError
        raise APIError(500, str(error), "InternalServerError") from None
    await asyncio.gather(*(stream.aclose() for stream in streams))  # each finished: nothing to abort
    return outputs
# --8<-- [end:encode_all]


def count_outputs(serving: OpenAIServing, outputs: list, arrival: float) -> None:
    """NOTE 4."""
    metrics, now = serving.metrics, time.perf_counter()
    for out in outputs:
        metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        metrics.request_success["stop"].inc()
        metrics.e2e_request_latency.observe(now - arrival)
