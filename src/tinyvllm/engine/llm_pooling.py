"""The pooling entry points of ``LLM``: ``encode``, ``embed``, ``classify``, ``reward`` and ``score``.

Concept: a pooling engine (``LLM(model, runner="pooling")``, or ``runner="auto"`` for a
classifier) returns one result per prompt instead of text. Each entry point names a task
(``pooling_params.py`` NOTE 3), queues every prompt with it as ``generate`` queues (``LLM._queue``:
all checked before any is queued) and drives the engine to the end (``LLM._run``):
``embed`` a vector, ``classify`` a classifier's label scores (``reward``: each token's),
``score`` a pair's score, from two embeddings (bi-encoder) or from one prompt holding both
texts (cross-encoder, NOTE 2); ``encode`` the engine's raw results, for the task its params
name (else the model's first; ``pooling_task="token_embed"``: one vector per token).

Mirrors: ``vllm/entrypoints/llm.py`` (``LLM.encode``, ``embed``, ``classify``, ``reward``, ``score``,
``_embedding_score``, ``_cross_encoding_score``).

Invariants: as ``generate``'s, a call queues all of its requests or none and leaves none in
the engine when it returns or raises; results come in prompt (or pair) order.

NOTE 1 (the task a call runs): params with ``task=None`` take the entry point's; params naming
another task are a ValueError naming both, before anything is queued (vLLM refuses to
overwrite ``pooling_params.task`` likewise). A task the model does not do is the input
processor's ValueError (``resolve_pooling_params``).
NOTE 2 (which score): a model that does ``score`` (a classifier with one label) is a
cross-encoder: each pair is one prompt (``scoring.py`` NOTE 5); any other pooling model
embeds each distinct text once and takes the cosine (``scoring.py`` NOTES 1-3).
NOTE 3 (``truncate_prompt_tokens``, vLLM's argument): given, it is set on every params object
of the call (``pooling_params.py`` NOTE 5): each prompt keeps its last k tokens (a
cross-encoder's pair: the pair's last k).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tinyvllm.engine.llm_arguments import params_list, prompt_list
from tinyvllm.engine.scoring import cross_pairs, in_names, pair_token_ids, score_plan
from tinyvllm.outputs import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput,
)  # fmt: skip
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.validation import check_bool

if TYPE_CHECKING:
    from tinyvllm.engine.input_processor import PromptType


def with_task(params: PoolingParams, task: str | None, label: str) -> PoolingParams:
    """NOTE 1: ``params`` running ``task`` (None: the params' own)."""
    if task is None or params.task == task:
        return params
    if params.task is not None:
        raise ValueError(f"{label}: task={params.task!r}, but this call runs task={task!r} (leave task None)")
    return dataclasses.replace(params, task=task)


class PoolingEntryPoints:
    """``LLM``'s pooling methods (module header); ``LLM`` provides ``engine``, ``_queue`` and ``_run``."""

    # --8<-- [start:encode]
    def encode(
        self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True, pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """One result per prompt, in prompt order: the engine's pooling of the prompt's hidden
        states, finished for ``pooling_task`` (None: the params', else the model's first task)
        by its ``PoolingParams``; ``truncate_prompt_tokens`` sets every params' (NOTE 3). Needs a
        pooling engine (``runner="pooling"``)."""
        check_bool("use_tqdm", use_tqdm)
        prompts = prompt_list(prompts)
        default = PoolingParams() if pooling_params is None else pooling_params
        params, label = params_list(default, PoolingParams, "pooling_params", len(prompts))
        params = [with_task(p, pooling_task, label.format(i=i)) for i, p in enumerate(params)]  # NOTE 1
        if truncate_prompt_tokens is not None:  # NOTE 3
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._run(self._queue(prompts, params, label, [0] * len(prompts)), use_tqdm, "Pooling")

    def embed(
        self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt as a list of floats (vLLM's ``LLM.embed``)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, "embed", truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's label scores (``probs``, one per label of the model's ``id2label``), from
        a ``*ForSequenceClassification`` model (vLLM's ``LLM.classify``)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, "classify", truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def reward(
        self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt token's label scores from a classifier, ``outputs.data`` [T, num_labels]
        (vLLM's ``LLM.reward``: ``encode`` with ``token_classify``, a process reward model's scores)."""
        return self.encode(prompts, pooling_params, use_tqdm, "token_classify", truncate_prompt_tokens)
    # --8<-- [end:encode]

    # --8<-- [start:score]
    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType],
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:  # fmt: skip
        """Each pair's score, in pair order: one item and one, one and a list of N, or two lists of
        N (``scoring.py`` NOTE 1); a cross-encoder's, or the cosine of two embeddings (NOTE 2)."""
        check_bool("use_tqdm", use_tqdm)
        model = self.engine.input_processor.pooling_model
        if model is None or "score" not in model.tasks:
            plan = score_plan(data_1, data_2, pools=model is not None)
            embed = pooling_params if pooling_params is not None else PoolingParams()
            return plan.outputs(lambda prompts: self.encode(prompts, embed, use_tqdm, "embed", truncate_prompt_tokens))
        pairs = cross_pairs(data_1, data_2)
        tokenizer = self.engine.input_processor.tokenizer
        prompts: list[Any] = [{"prompt_token_ids": pair_token_ids(tokenizer, a, b, model.use_pad_token)}
                              for a, b, _, _ in pairs]  # fmt: skip
        params = PoolingParams(task="score") if pooling_params is None else pooling_params
        try:
            outputs = self.encode(prompts, params, use_tqdm, "score", truncate_prompt_tokens)
        except (TypeError, ValueError) as error:
            raise in_names(error, [f"the pair ({name_1}, {name_2})" for _, _, name_1, name_2 in pairs]) from None
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), list(o.prompt_token_ids))
                for o in outputs]  # fmt: skip
    # --8<-- [end:score]
