"""Classification over HTTP: ``POST /classify`` on a classifier's server (``tinyvllm serve`` of a
``*ForSequenceClassification`` folder).

Concept: the embeddings route's four steps (``embeddings.py``: checks, tokenization on the
tokenizer's thread, one ``AsyncLLM.encode`` per input awaited together, the answer) with the
task ``classify``: each input's label scores (``worker/pooler.py`` NOTE 3), answered as
vLLM's ``ClassificationResponse``: ``{"index", "label", "probs", "num_classes"}`` per input,
in input order, ``label`` the name (``id2label``) of the highest score.

Mirrors: ``vllm/entrypoints/openai/serving_classification.py`` (``ServingClassification``)
and its request and response in ``protocol.py``.

Invariants: ``data[i]`` is input ``i``'s, its ``probs`` equal to ``LLM.classify``'s for the
same ids; a server whose model does not classify answers 400 naming ``model`` before any
engine request exists (``embeddings.py`` NOTE 2); every engine request this route starts has
finished or been aborted when the handler returns.

NOTE 1 (fields, vLLM's): ``model``, ``input`` (a string, a list of strings, token ids or a
list of them), ``user``, ``truncate_prompt_tokens``, ``add_special_tokens``, ``request_id``,
``priority`` and ``use_activation`` (False: the raw logits, and ``label`` still their argmax).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from tinyvllm.entrypoints.embeddings import pool_inputs, pooling_answer
from tinyvllm.entrypoints.protocol import ClassificationRequest
from tinyvllm.entrypoints.serving import OpenAIServing
from tinyvllm.pooling_params import PoolingParams


# --8<-- [start:create_classification]
async def create_classification(serving: OpenAIServing, body: ClassificationRequest, raw_request: Request,
                                request_id: str, arrival: float):  # fmt: skip
    """``POST /classify``: each input's label scores and its best label."""
    response_id = f"classify-{request_id}"
    params = PoolingParams(use_activation=body.use_activation, task="classify")
    outputs = await pool_inputs(serving, body, raw_request, response_id, arrival, lambda: params,
                                "Classification API", ("classify",))  # fmt: skip
    if isinstance(outputs, Response):
        return outputs  # the client left
    labels = serving.async_llm.input_processor.pooling_model.labels
    data = []
    for i, out in enumerate(outputs):
        probs = out.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": probs, "num_classes": len(probs)})
    return pooling_answer(serving, response_id, data, outputs)
# --8<-- [end:create_classification]
