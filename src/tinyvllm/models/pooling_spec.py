"""PoolingSpec: what a model folder says about embedding with it.

Concept: an embedding model published for sentence-transformers carries its pooling in
files beside the weights: ``modules.json`` lists the modules the library chains after the
transformer (a ``Pooling`` module, often a ``Normalize`` one), and the ``Pooling`` module's
``config.json`` says which pooling it does (``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``). A pooling engine takes the
model's own choice when the user gives none (``config.py``'s ``PoolerConfig``), so that
``LLM(model, runner="pooling")`` embeds as the model was trained to. The model's
``config.json`` says whether its embeddings may be truncated (``is_matryoshka``,
``matryoshka_dimensions``: ``pooling_params.py`` NOTE 1). A classifier's ``config.json`` says
what it is for: its label names (``id2label``), which activation turns its logits into
probabilities (NOTE 1) and how a pair of texts becomes one prompt (NOTE 2).

Mirrors: vLLM's ``get_pooling_config`` and ``get_sentence_transformer_tokenizer_config``
(``vllm/transformers_utils/config.py``), which read the same files; the activations of
``vllm/model_executor/layers/pooler.py`` (``get_classification_activation_function``,
``get_cross_encoder_activation_function``) and ``use_pad_token`` of ``score_utils.py``.

Invariants: every file is read through ``read_json_object`` (``model_files.py``: regular
files inside the folder, bounded); a folder without ``modules.json`` has no pooling of its
own (``pooling_type`` and ``normalize`` None); a ``modules.json`` that is not a list of
objects, or a ``Pooling`` module whose modes name none or several of the three built, is a
ValueError naming the file; so is an ``id2label``, ``problem_type`` or activation name the
engine cannot honour.

NOTE 1 (activations, transformers' losses): ``problem_type`` "regression" is trained on raw
logits (identity), "multi_label_classification" on independent sigmoids; otherwise one label
is a sigmoid and several a softmax. A cross-encoder's score takes the activation its
sentence-transformers config names (``activation_fn``, or the older
``sbert_ce_default_activation_function``: Sigmoid or Identity), else the classifier's.
NOTE 2 (a pair as one prompt): by default the tokenizer joins the two texts as a pair
(``tokenizer(text, text_pair=...)``: its separator tokens, if it has any); a model whose
config says ``use_pad_token: false`` (an LLM used as a reranker) is given the two texts
concatenated, as vLLM does.
NOTE 3 (a causal LM read as a classifier, vLLM's ``classifier_from_token``): given in
``hf_overrides`` with a ``*ForSequenceClassification`` architecture, the tokens' LM-head rows
are the score head, one label per token; with ``method: from_2_way_softmax`` (Qwen3-Reranker's
``is_original_qwen3_reranker: true`` says the same) two tokens make one label whose logit is
the second's row minus the first's: its sigmoid is the causal LM's softmax over the two.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyvllm.models.model_files import read_json_object, read_model_config, read_model_file, require_model_folder
from tinyvllm.pooling_params import PoolingModel, pooling_tasks

# sentence-transformers' pooling modes -> PoolerConfig.pooling_type
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
# NOTE 1: transformers' problem types, and the sentence-transformers activations built
_PROBLEM_TYPES = {"regression": "identity", "multi_label_classification": "sigmoid", "single_label_classification": None}
_SCORE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}


@dataclass(frozen=True)
class PoolingSpec:
    """A model folder's pooling: None where the folder says nothing."""

    pooling_type: str | None = None
    normalize: bool | None = None
    matryoshka: bool = False
    classify_activation: str = "softmax"  # NOTE 1: "softmax" | "sigmoid" | "identity"
    score_activation: str = "sigmoid"  # NOTE 1
    use_pad_token: bool = True  # NOTE 2


def classifier_head(config: dict, arch: str, where: str) -> dict:
    """A ``*ForSequenceClassification`` model's ``ModelSpec`` fields: ``labels``, its
    ``id2label`` names in id order (transformers' default: ``LABEL_0``, ``LABEL_1``), or NOTE 3's
    head made of tokens' rows; ``{}`` (a causal LM) for any other architecture."""
    if not arch.endswith("ForSequenceClassification"):
        return {}
    tokens = config.get("classifier_from_token")
    if tokens is not None:  # NOTE 3
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
            raise ValueError(f"{where}: field 'classifier_from_token' must be a list of token strings, got {tokens!r}"[:300])
        two_way = config.get("method") == "from_2_way_softmax" or config.get("is_original_qwen3_reranker") is True
        if two_way and len(tokens) != 2:
            raise ValueError(f"{where}: from_2_way_softmax takes two tokens (the 'no' and the 'yes' one), got {tokens!r}")
        return {"labels": ("LABEL_0",) if two_way else tuple(tokens), "score_from_tokens": tuple(tokens), "two_way": two_way}
    id2label = config.get("id2label")
    if id2label is None:
        return {"labels": ("LABEL_0", "LABEL_1")}
    keys = [str(i) for i in range(len(id2label))] if isinstance(id2label, dict) else []
    if not keys or sorted(id2label) != sorted(keys) or not all(isinstance(id2label[k], str) for k in keys):
        raise ValueError(f"{where}: field 'id2label' must map the ids 0..n-1 (n >= 1) to str names, got {id2label!r}"[:300])
    return {"labels": tuple(id2label[k] for k in keys)}


def _activations(config: dict, where: str) -> tuple[str, str]:
    """NOTE 1: the classify and score activations ``config.json`` asks for."""
    archs = config.get("architectures")
    labels = classifier_head(config, str(archs[0]) if isinstance(archs, list) and archs else "", where).get("labels", ())
    problem = config.get("problem_type")
    if problem is not None and problem not in _PROBLEM_TYPES:
        raise ValueError(f"{where}: field 'problem_type' must be one of {sorted(_PROBLEM_TYPES)}, got {problem!r}")
    classify = _PROBLEM_TYPES.get(problem) or ("sigmoid" if len(labels) == 1 else "softmax")
    st = config.get("sentence_transformers")
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name if name is not None else config.get("sbert_ce_default_activation_function")
    if name is not None and name not in _SCORE_ACTIVATIONS:
        raise ValueError(f"{where}: the cross-encoder activation {name!r} is not one of {sorted(_SCORE_ACTIVATIONS)}")
    return classify, _SCORE_ACTIVATIONS[name] if name is not None else classify


def read_pooling_spec(folder: str | Path, overrides: Mapping[str, Any] | None = None) -> PoolingSpec:
    """The folder's sentence-transformers pooling, matryoshka flags and a classifier's
    activations and pair joining (module header); ``overrides``: vLLM's ``hf_overrides``."""
    root = require_model_folder(folder)
    config = read_model_config(root, overrides)
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    use_pad_token = config.get("use_pad_token", True)
    if not isinstance(use_pad_token, bool):
        raise ValueError(f"{root / 'config.json'}: field 'use_pad_token' must be true or false, got {use_pad_token!r}")
    model = (matryoshka, *_activations(config, str(root / "config.json")), use_pad_token)
    path = root / "modules.json"
    if not os.path.lexists(path):  # a link to nowhere is refused by the read below
        return PoolingSpec(None, None, *model)
    try:
        modules = json.loads(read_model_file(path, root, "config"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path}: must be a list of module objects, got {modules!r}"[:300])
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    pooling_type = None
    if "Pooling" in kinds:
        sub = str(modules[kinds.index("Pooling")].get("path", ""))
        pooling_path = root / sub / "config.json"
        modes = read_json_object(pooling_path, root)
        chosen = [kind for mode, kind in _MODES.items() if modes.get(mode) is True]
        if len(chosen) != 1:
            raise ValueError(f"{pooling_path}: one of {sorted(_MODES)} must be true (tinyvllm pools that way), got {chosen}")
        pooling_type = chosen[0]
    return PoolingSpec(pooling_type, "Normalize" in kinds, *model)



def resolve_pooling_model(
    pooling_type: str | None, normalize: bool | None, folder: str | Path, hidden_size: int,
    labels: tuple[str, ...] | None, overrides: Mapping[str, Any] | None = None, step_tag_id: int | None = None,
) -> PoolingModel:
    """What a pooling engine's model does (``PoolingModel``): the user's ``pooling_type`` and
    ``normalize`` where given, else the folder's, else vLLM's defaults (LAST, normalised), and
    the folder's matryoshka flag, activations and pair joining (``engine_args.py`` NOTE 12);
    ``hidden_size`` and ``labels`` are the ``ModelSpec``'s."""
    found = read_pooling_spec(folder, overrides)
    pooling_type = pooling_type or found.pooling_type or "LAST"
    normalize = next(v for v in (normalize, found.normalize, True) if v is not None)
    return PoolingModel(
        hidden_size, pooling_tasks(None if labels is None else len(labels)), pooling_type, normalize,
        found.matryoshka, found.classify_activation, found.score_activation, found.use_pad_token, labels, step_tag_id,
    )  # fmt: skip
