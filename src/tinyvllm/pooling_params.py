"""PoolingParams: what one embedding request asks of the pooler, validated at construction.

Concept: the pooling twin of ``SamplingParams``. A pooling engine (``LLM(runner="pooling")``)
runs a prompt once and returns one vector made from its hidden states, instead of
continuing it; these are the per-request knobs of that vector. How the hidden states become
one vector (last token, mean, first token) is the engine's ``PoolerConfig``, one for every
request, as in vLLM; what a request may change is what happens to that vector after.

Mirrors: ``vllm/pooling_params.py`` (``PoolingParams``: ``dimensions``, ``normalize``,
``task``) and the embedding head of ``vllm/model_executor/layers/pooler.py``.

Fields: ``dimensions`` (None: the whole hidden size; k: the first k values, vLLM's
matryoshka truncation, NOTE 1), ``normalize`` (None: the engine's ``PoolerConfig``; True:
L2-normalised after truncation, NOTE 2), ``task`` ("embed", the one task built: NOTE 3); ``skip_reading_prefix_cache`` is the
engine's, set when it resolves the params (NOTE 4).

Invariants: an instance is frozen; ``dimensions`` is None or an int >= 1; ``normalize`` is
None or a bool. Whether ``dimensions`` fits the model needs the model: the input processor
checks it (``resolve_pooling_params``), before anything is queued.

NOTE 1 (dimensions): keeping the first k values is only meaningful for a model trained so
that every prefix of its embedding is an embedding (matryoshka representation learning).
As vLLM, the engine takes ``dimensions`` only from a model whose ``config.json`` says so
(``is_matryoshka`` or ``matryoshka_dimensions``), and at most the hidden size; otherwise a
ValueError naming the value.
NOTE 2 (order): truncate, then normalise, as vLLM's embedding head: a truncated matryoshka
embedding has unit length too.
NOTE 3 (tasks left out): vLLM's pooling runner also classifies, scores pairs and returns
per-token vectors (``token_embed``); tinyvllm embeds whole prompts only.
NOTE 4 (the prefix cache): a cached block's positions are never computed, so their hidden
states never exist. ``LAST`` reads one position, which the scheduler always computes (a
prompt found whole in the cache still recomputes its last token); ``MEAN`` and ``CLS`` read
positions a hit would skip, so such a request takes no hit (vLLM's
``skip_reading_prefix_cache``), as a request with prompt logprobs takes none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tinyvllm.validation import check_bool, check_optional_int

POOLING_TASKS = ("embed",)  # NOTE 3


@dataclass(frozen=True)
class PoolingParams:
    """How a pooling request's vector is finished (module header)."""

    dimensions: int | None = None  # NOTE 1
    normalize: bool | None = None  # NOTE 2; None: the engine's PoolerConfig.normalize
    task: Literal["embed"] = "embed"  # NOTE 3
    skip_reading_prefix_cache: bool = False  # NOTE 4: the engine's, from its pooling type

    def __post_init__(self) -> None:
        object.__setattr__(self, "dimensions", check_optional_int("dimensions", self.dimensions, 1))
        check_bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache)
        if self.normalize is not None:
            check_bool("normalize", self.normalize)
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS} (classification and scoring are not built), got {self.task!r}")


def resolve_pooling_params(
    label: str, params: PoolingParams, hidden_size: int, matryoshka: bool, default_normalize: bool, pooling_type: str
) -> PoolingParams:
    """``params`` against the model (NOTE 1), with ``normalize`` filled in from the engine's
    pooler config and the prefix-cache rule of its ``pooling_type`` (NOTE 4); a ValueError
    naming ``label`` and the value when the model cannot honour it."""
    if not isinstance(params, PoolingParams):
        raise TypeError(f"{label} must be PoolingParams, got {params!r}")
    if params.dimensions is not None:
        if not matryoshka:
            raise ValueError(
                f"{label}: dimensions={params.dimensions} needs a matryoshka model (config.json's is_matryoshka or "
                "matryoshka_dimensions): keeping the first values of another model's embedding gives no embedding"
            )
        if params.dimensions > hidden_size:
            raise ValueError(f"{label}: dimensions={params.dimensions} is more than the model's hidden size {hidden_size}")
    dimensions = None if params.dimensions == hidden_size else params.dimensions  # the whole vector: nothing to cut
    normalize = default_normalize if params.normalize is None else params.normalize
    return PoolingParams(dimensions, normalize, params.task, skip_reading_prefix_cache=pooling_type != "LAST")
