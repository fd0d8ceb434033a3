"""The decoder as a sequence classifier: the same layers, a ``score`` head in place of the LM head.

Concept: a ``*ForSequenceClassification`` checkpoint (a reward model, a sentiment
classifier, a cross-encoder reranker) is the causal decoder of ``llama.py`` with its LM head
``[V, hidden]`` replaced by a small ``score`` matrix ``[num_labels, hidden]`` and no bias.
transformers applies ``score`` to every position and keeps the last token's row; a pooling
engine pools first (``LAST``, one row per prompt) and applies it to that row alone, the same
numbers for a fraction of the work. ``compute_logits`` is that head: ``[R, hidden] -> [R,
num_labels]`` float32, so the worker's memory profile and the pooler call it as they would
the LM head. ``load_classifier`` loads one (``llama.load_model`` with this class).

Mirrors: ``vllm/model_executor/models/adapters.py`` (``as_seq_cls_model``: a generative
architecture with a ``score`` layer and a classification pooler) and transformers'
``GenericForSequenceClassification``.

Invariants: the model holds no LM head (the checkpoint has none, NOTE 1); ``score`` is
replicated on every tensor-parallel rank, read whole (a few thousand values); the rows of
``compute_logits`` are in label order, ``spec.labels[i]`` for column ``i``.

NOTE 1 (no LM head): the parent builds one on the meta device and this class drops it
before anything is allocated; an ``lm_head.weight`` in the folder is skipped (``loader.py``
NOTE 7), and the engine refuses ``runner="generate"`` for a classifier.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tinyvllm.models.llama import DecoderForCausalLM, load_model
from tinyvllm.models.loader import ModelSpec
from tinyvllm.models.parallel_layers import default_weight_loader


class DecoderForSequenceClassification(DecoderForCausalLM):
    """Llama / Qwen2 / Qwen3 with a ``score`` head (module header). Build it with ``load_model``."""

    def __init__(self, spec: ModelSpec, attention_backend: str = "reference") -> None:
        if spec.labels is None:
            raise ValueError(f"{spec.architecture} is not a classifier: its config.json has no labels")
        super().__init__(spec, attention_backend)
        del self.lm_head  # NOTE 1
        self.score = nn.Linear(spec.hidden_size, len(spec.labels), bias=False)  # [num_labels, hidden]

    def tie_weights(self) -> None:
        """Nothing to tie: there is no LM head (NOTE 1)."""

    def head_sources(self) -> list[tuple[str, nn.Parameter, Callable[..., None], object]]:
        return [("score.weight", self.score.weight, default_weight_loader, None)]

    # --8<-- [start:score]
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, num_labels] float32: each row's label logits (the matmul in the
        model's dtype, as transformers' ``score``)."""
        return self.score(hidden.to(self.score.weight.dtype)).float()
    # --8<-- [end:score]


def load_classifier(folder: str | Path, **kwargs) -> DecoderForSequenceClassification:
    """``llama.load_model`` for a classifier's folder: every check, then this class."""
    return load_model(folder, model_class=DecoderForSequenceClassification, **kwargs)
