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

Invariants: the model holds no LM head (NOTE 1); ``score`` is
replicated on every tensor-parallel rank, read whole (a few thousand values); the rows of
``compute_logits`` are in label order, ``spec.labels[i]`` for column ``i``.

NOTE 1 (no LM head): the parent builds one on the meta device and this class drops it
before anything is allocated; an ``lm_head.weight`` in the folder is skipped (``loader.py``
NOTE 7), and the engine refuses ``runner="generate"`` for a classifier.
NOTE 2 (a head made of tokens, ``loader.py`` NOTE 8): a causal LM read as a classifier
(Qwen3-Reranker answers "yes" or "no") has no ``score.weight``; its head is its LM head's rows
of the named tokens, read from the checkpoint at load time: ``[N, hidden]``, or for
``from_2_way_softmax`` the one row ``yes - no``, since ``sigmoid(h . (w_yes - w_no))`` is the
softmax of ``(h . w_no, h . w_yes)`` at ``yes``, taken in the model's dtype (a bfloat16
checkpoint run in float32 subtracts in float32). The whole LM head is never built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tinyvllm.models.llama import DecoderForCausalLM, load_model
from tinyvllm.models.loader import ModelSpec, load_model_spec
from tinyvllm.models.parallel_layers import default_weight_loader
from tinyvllm.models.tokenizer import load_tokenizer


class DecoderForSequenceClassification(DecoderForCausalLM):
    """Llama / Qwen2 / Qwen3 with a ``score`` head (module header). Build it with ``load_model``."""

    def __init__(self, spec: ModelSpec, attention_backend: str = "reference", score_token_ids: tuple[int, ...] = ()) -> None:
        if spec.labels is None:
            raise ValueError(f"{spec.architecture} is not a classifier: its config.json has no labels")
        if bool(spec.score_from_tokens) != bool(score_token_ids):
            raise ValueError("score_token_ids are needed exactly when the spec names classifier_from_token (NOTE 2)")
        super().__init__(spec, attention_backend)
        del self.lm_head  # NOTE 1
        self.score = nn.Linear(spec.hidden_size, len(spec.labels), bias=False)  # [num_labels, hidden]
        self.score_token_ids = score_token_ids  # NOTE 2: () for a checkpoint with score.weight

    def tie_weights(self) -> None:
        """Nothing to tie: there is no LM head (NOTE 1)."""

    def head_sources(self) -> list[tuple[str, nn.Parameter, Callable[..., None], object]]:
        if not self.score_token_ids:
            return [("score.weight", self.score.weight, default_weight_loader, None)]
        name = "model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"
        return [(name, self.score.weight, self._rows_loader, None)]  # NOTE 2

    def _rows_loader(self, param: torch.Tensor, loaded, shard_id: object = None) -> None:
        """NOTE 2: the named tokens' rows of the LM head (only they are read), or yes - no."""
        rows = torch.cat([loaded[i : i + 1] for i in self.score_token_ids]).to(param.dtype)  # [N, hidden]
        with torch.no_grad():  # also run on the meta device, to count what is read
            param.copy_(rows[1:2] - rows[0:1] if self.spec.two_way else rows)

    # --8<-- [start:score]
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, num_labels] float32: each row's label logits (the matmul in the
        model's dtype, as transformers' ``score``)."""
        return self.score(hidden.to(self.score.weight.dtype)).float()
    # --8<-- [end:score]


def load_classifier(folder: str | Path, hf_overrides: dict | None = None, **kwargs) -> DecoderForSequenceClassification:
    """``llama.load_model`` for a classifier's folder: every check, then this class (with the
    ids of ``classifier_from_token``'s tokens, NOTE 2)."""
    tokens = load_model_spec(folder, hf_overrides).score_from_tokens
    ids = score_token_ids(load_tokenizer(folder), tokens) if tokens else ()
    model_class = functools.partial(DecoderForSequenceClassification, score_token_ids=ids)
    return load_model(folder, model_class=model_class, hf_overrides=hf_overrides, **kwargs)


def score_token_ids(tokenizer, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """Each token's id in the vocabulary (NOTE 2); a token the tokenizer does not hold whole
    is a ValueError naming it."""
    ids = []
    for token in tokens:
        found = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(found, int) or found == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(found) != token:
            raise ValueError(f"classifier_from_token: {token!r} is not one token of this model's vocabulary")
        ids.append(found)
    return tuple(ids)
