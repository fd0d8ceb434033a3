"""The raw pooling route: ``POST /pooling``, any task the served model does, its tensor as JSON.

Concept: ``/v1/embeddings`` and ``/classify`` each answer one task in its own shape; ``/pooling``
(vLLM's) answers whichever task the body names (``task``; None: the model's first,
``pooling_params.py`` NOTE 3) with each input's result as it comes out of the pooler: a list
of floats for a pooled task, a list of lists for a token task (``token_embed``: one vector
per token; ``token_classify``: one label distribution per token, a reward model's scores).
The steps are the embeddings route's (``embeddings.pool_inputs``).

Mirrors: ``vllm/entrypoints/openai/serving_pooling.py`` (``OpenAIServingPooling``) and its
request and response in ``protocol.py``.

Invariants: ``data[i]["data"]`` is input ``i``'s result, equal to ``LLM.encode(...,
pooling_task=task)``'s ``outputs.data`` for the same ids; the params are checked against the
model (``resolve_pooling_params``) before any engine request exists, a 400 naming the field.

NOTE 1 (fields): ``PoolingInputRequest``'s (``input`` as for embeddings, ``truncate_prompt_tokens``,
``add_special_tokens``, ``request_id``, ``priority``) with ``task``, ``dimensions``,
``normalize``, ``use_activation`` and ``encoding_format``. A step-tag reward model's
``step_tag_id`` is the server's (``--pooler-config``), as in vLLM.
NOTE 2 (``encoding_format: "base64"``, vLLM's): the tensor flattened in row order, float32
little-endian, base64-encoded (``embeddings.py`` NOTE 1), so a token task's ``[T, C]`` comes
back as ``T * C`` floats; the client knows ``C`` (the model's labels or hidden size).
vLLM's ``embed_dtype`` and ``endianness`` options are left out.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from tinyvllm.entrypoints.embeddings import encoded, pool_inputs, pooling_answer
from tinyvllm.entrypoints.protocol import PoolingRequest, RequestError
from tinyvllm.entrypoints.serving import OpenAIServing
from tinyvllm.pooling_params import POOLING_TASKS, PoolingParams, resolve_pooling_params


def _params(serving: OpenAIServing, body: PoolingRequest) -> PoolingParams:
    """The body's params, resolved against the model now (the input processor does it again)."""
    try:
        params = PoolingParams(body.dimensions, body.normalize, body.use_activation, body.task)
        resolve_pooling_params("the request", params, serving.async_llm.input_processor.pooling_model)
    except (TypeError, ValueError) as error:  # the field the message names first
        field = next((f for f in ("dimensions", "use_activation", "normalize") if f in str(error)), "task")
        raise RequestError(str(error), field) from None
    return params


def _data(tensor, encoding_format: str | None) -> list | str:
    """One result as the body asks: nested JSON floats, or base64 of its values in row order (NOTE 2)."""
    return encoded(tensor.flatten().tolist(), "base64") if encoding_format == "base64" else tensor.tolist()


# --8<-- [start:create_pooling]
async def create_pooling(serving: OpenAIServing, body: PoolingRequest, raw_request: Request, request_id: str,
                         arrival: float):  # fmt: skip
    """``POST /pooling``: each input's result for the body's task, as nested lists of floats."""
    response_id = f"pool-{request_id}"
    outputs = await pool_inputs(serving, body, raw_request, response_id, arrival, lambda: _params(serving, body),
                                "Pooling API", POOLING_TASKS)  # fmt: skip
    if isinstance(outputs, Response):
        return outputs  # the client left
    data = [{"index": i, "object": "pooling", "data": _data(out.outputs.data, body.encoding_format)} for i, out in enumerate(outputs)]
    return pooling_answer(serving, response_id, data, outputs)
# --8<-- [end:create_pooling]
