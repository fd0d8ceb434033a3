"""Scores and reranking over HTTP on an embedding server: ``POST /score`` and ``POST /rerank``.

Concept: vLLM's score API on an embedding model: the score of a pair of texts is the cosine
of their two embeddings (``engine/scoring.py``); on a cross-encoder, the model's score of the
pair read as one prompt (NOTE 5). ``/score`` (also ``/v1/score``) pairs
``text_1`` with ``text_2`` by ``LLM.score``'s rule; ``/rerank`` (also ``/v1/rerank`` and
``/v2/rerank``, Jina's and Cohere's shape) scores one ``query`` against each of
``documents`` and answers them best first, cut to ``top_n``. One request, in order, each
refusal a 400 naming its field before any engine request exists:

1. checks that need no prompt: the model name (404), an engine that pools
   (``embeddings.py`` NOTE 2), the body's values, the pairing rule (``engine/scoring.py``
   NOTE 1), the waiting bound (one engine request per distinct text);
2. the texts, on the tokenizer's thread (``embeddings.token_ids``): each distinct one
   tokenized, cut to ``truncate_prompt_tokens``, refused if empty or past the context,
   named by its place (``documents[2]``);
3. the engine: ``embeddings.encode_all``, one ``AsyncLLM.encode`` per distinct text, every
   output awaited together; one that fails, or a client that leaves, aborts the rest;
4. the answer: one cosine per pair (NOTE 1), and the usage (NOTE 2).

Mirrors: ``vllm/entrypoints/openai/serving_score.py`` (``ServingScores``, its
``_embedding_score``), the score and rerank models of ``vllm/entrypoints/openai/protocol.py``,
and their routes in ``api_server.py``.

Invariants: ``data[i]`` (``/score``) is pair ``i``'s score, equal within float32 rounding
to ``LLM(runner="pooling").score``'s for the same texts; ``/rerank``'s ``results`` are sorted
by ``relevance_score``, highest first (ties in document order), each ``index`` the
document's place in the request; every engine request this module starts has finished or
been aborted when the handler returns.

NOTE 1 (the score): the pair's two vectors, each L2-normalised in float32, then their dot
product (``engine/scoring.py`` NOTE 3): the server and ``LLM.score`` run the same function
on the same vectors. The engine's ``normalize`` does not change it.
NOTE 2 (usage, vLLM's count): each pair counts both of its prompts' tokens, so a 1-to-N
request counts the query N times, though it ran once (``engine/scoring.py`` NOTE 2): the
usage is the pairs' size, the same whichever texts repeat. ``/rerank`` counts every
document, not only the ``top_n`` it returns.
NOTE 3 (fields, vLLM's): ``/score`` takes ``model``, ``text_1``, ``text_2`` (a string or a
list of strings), ``truncate_prompt_tokens`` and ``priority``; ``/rerank`` takes ``model``,
``query``, ``documents`` (a list of strings), ``top_n`` (left out or 0: every document;
negative: a 400), ``truncate_prompt_tokens`` and ``priority``. vLLM's cross-encoder and
multimodal fields (``activation``, ``use_activation``, ``mm_processor_kwargs``, content
parts) and Cohere's ``return_documents`` are unknown fields here, a 400 naming them as any
unknown field (``protocol.py`` NOTE 1): every result carries its document, as vLLM's does.
NOTE 4 (metrics): each distinct text is one engine request, counted as an embeddings input
is (``embeddings.py`` NOTE 4).
NOTE 5 (a cross-encoder's server): when the model does ``score`` (a classifier with one
label), each pair is one engine request holding both texts (``engine/scoring.py`` NOTE 5),
tokenized together on the tokenizer's thread and cut to ``truncate_prompt_tokens``; its
score is the model's, and a pair too long for the context is a 400 naming the pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyvllm.engine.scoring import cosine, cross_pairs, pair_token_ids, score_plan
from tinyvllm.entrypoints.embeddings import check_bound, check_pools, count_outputs, encode_all, token_ids
from tinyvllm.entrypoints.protocol import RequestError, _Strict
from tinyvllm.entrypoints.serving import APIError, OpenAIServing
from tinyvllm.pooling_params import PoolingParams

PARAM_WORDS = {"priority": "priority"}  # the engine's messages that name a field (all else is checked first)


# --8<-- [start:requests]
class ScoreRequest(_Strict):
    """``POST /score``, ``/v1/score`` (NOTE 3): pairs of texts, by ``LLM.score``'s rule."""

    model: str | None = None  # None: the served model, as vLLM
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int | None = None

    def check(self) -> None:
        _check_truncate(self.truncate_prompt_tokens)


class RerankRequest(_Strict):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (NOTE 3): a query against documents."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # None or 0: every document, as vLLM
    truncate_prompt_tokens: int | None = None
    priority: int | None = None

    def check(self) -> None:
        _check_truncate(self.truncate_prompt_tokens)
        if self.top_n is not None and self.top_n < 0:
            raise RequestError(f"`top_n` must be >= 0 (0: every document), got {self.top_n}", "top_n")
        if not self.documents:
            raise RequestError("`documents` must not be empty", "documents")
# --8<-- [end:requests]


def _check_truncate(k: int | None) -> None:
    if k is not None and not (k >= 1 or k == -1):
        raise RequestError(f"`truncate_prompt_tokens` must be >= 1 or -1, got {k}", "truncate_prompt_tokens")


# --8<-- [start:pair_scores]
async def pair_scores(serving: OpenAIServing, body: ScoreRequest | RerankRequest, side_1, side_2,
                      names: tuple[str, str], raw_request: Request, response_id: str,
                      arrival: float) -> list[tuple[float, int]] | Response:  # fmt: skip
    """Steps 1 to 3 and each pair's score: ``(score, the pair's prompt tokens)`` in pair order;
    a 499 ``Response`` if the client left."""
    serving.check_model(body.model)
    check_pools(serving, "Score API" if isinstance(body, ScoreRequest) else "Rerank API", ("embed", "score"))
    body.check()
    if serving.closing:  # serving.py NOTE 7
        raise APIError(503, "the server is shutting down", "ServiceUnavailableError")
    model = serving.async_llm.input_processor.pooling_model
    if "score" in model.tasks:  # NOTE 5: a cross-encoder
        return await _cross_scores(serving, body, side_1, side_2, names, raw_request, response_id, arrival)
    plan = _paired(score_plan, side_1, side_2, names)
    check_bound(serving, len(plan.prompts), "distinct texts", names[1])
    priority, truncate = serving._priority(body), serving._truncate(body)
    prompts = await serving.async_llm.run_in_tokenizer_thread(token_ids, serving, plan.prompts, plan.names, True,
                                                              truncate)  # fmt: skip
    outputs = await encode_all(serving, prompts, PoolingParams(task="embed"), response_id, priority, raw_request,
                               PARAM_WORDS)  # fmt: skip
    if isinstance(outputs, Response):
        return outputs  # the client left
    count_outputs(serving, outputs, arrival)  # NOTE 4
    return [(cosine(outputs[i].outputs.data, outputs[j].outputs.data), len(prompts[i]) + len(prompts[j]))
            for i, j in plan.pairs]  # fmt: skip


async def _cross_scores(serving: OpenAIServing, body: ScoreRequest | RerankRequest, side_1, side_2,
                        names: tuple[str, str], raw_request: Request, response_id: str,
                        arrival: float) -> list[tuple[float, int]] | Response:  # fmt: skip
    """NOTE 5: each pair one prompt (its two texts joined by the tokenizer), one engine request."""
    pairs = _paired(cross_pairs, side_1, side_2, names)
    check_bound(serving, len(pairs), "pairs", names[1])
    priority, truncate = serving._priority(body), serving._truncate(body)
    use_pad_token = serving.async_llm.input_processor.pooling_model.use_pad_token

    def pair_ids() -> list[list[int]]:  # on the tokenizer's thread
        tokenizer = serving.async_llm.input_processor.tokenizer
        ids = [pair_token_ids(tokenizer, a, b, use_pad_token) for a, b, _, _ in pairs]
        return token_ids(serving, ids, [name_2 for _, _, _, name_2 in pairs], True, truncate)  # named by its second text

    prompts = await serving.async_llm.run_in_tokenizer_thread(pair_ids)
    outputs = await encode_all(serving, prompts, PoolingParams(task="score"), response_id, priority, raw_request,
                               PARAM_WORDS)  # fmt: skip
    if isinstance(outputs, Response):
        return outputs  # the client left
    count_outputs(serving, outputs, arrival)  # NOTE 4
    return [(float(out.outputs.data[0]), len(ids)) for out, ids in zip(outputs, prompts)]

# --8<-- [end:pair_scores]


def _paired(pair: Callable[..., Any], side_1, side_2, names: tuple[str, str]) -> Any:
    """``engine/scoring.py``'s pairing (``score_plan`` or ``cross_pairs``), a bad pairing a 400
    naming the side at fault (the empty one, else the second)."""
    try:
        return pair(side_1, side_2, names)
    except ValueError as error:
        raise RequestError(str(error), names[0] if side_1 == [] else names[1]) from None


# --8<-- [start:create_score]
async def create_score(serving: OpenAIServing, body: ScoreRequest, raw_request: Request, request_id: str,
                       arrival: float):  # fmt: skip
    """``POST /score``: each pair's score, in pair order."""
    response_id = f"score-{request_id}"
    scores = await pair_scores(serving, body, body.text_1, body.text_2, ("text_1", "text_2"), raw_request,
                               response_id, arrival)  # fmt: skip
    if isinstance(scores, Response):
        return scores
    n_tokens = sum(n for _, n in scores)  # NOTE 2
    return JSONResponse({"id": response_id, "object": "list", "created": int(time.time()),
                         "model": serving.served_model_name,
                         "data": [{"index": i, "object": "score", "score": s} for i, (s, _) in enumerate(scores)],
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})  # fmt: skip
# --8<-- [end:create_score]


# --8<-- [start:create_rerank]
async def create_rerank(serving: OpenAIServing, body: RerankRequest, raw_request: Request, request_id: str,
                        arrival: float):  # fmt: skip
    """``POST /rerank``: the documents best first, cut to ``top_n``, each with its index."""
    response_id = f"rerank-{request_id}"
    scores = await pair_scores(serving, body, body.query, body.documents, ("query", "documents"), raw_request,
                               response_id, arrival)  # fmt: skip
    if isinstance(scores, Response):
        return scores
    ranked = sorted(range(len(scores)), key=lambda j: scores[j][0], reverse=True)  # stable: ties keep their order
    results = [{"index": j, "document": {"text": body.documents[j]}, "relevance_score": scores[j][0]}
               for j in ranked[: body.top_n or len(ranked)]]  # fmt: skip
    return JSONResponse({"id": response_id, "model": serving.served_model_name,
                         "usage": {"total_tokens": sum(n for _, n in scores)}, "results": results})  # fmt: skip
# --8<-- [end:create_rerank]
