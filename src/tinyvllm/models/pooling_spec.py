"""PoolingSpec: what a model folder says about embedding with it.

Concept: an embedding model published for sentence-transformers carries its pooling in
files beside the weights: ``modules.json`` lists the modules the library chains after the
transformer (a ``Pooling`` module, often a ``Normalize`` one), and the ``Pooling`` module's
``config.json`` says which pooling it does (``pooling_mode_lasttoken``,
``pooling_mode_mean_tokens``, ``pooling_mode_cls_token``). A pooling engine takes the
model's own choice when the user gives none (``config.py``'s ``PoolerConfig``), so that
``LLM(model, runner="pooling")`` embeds as the model was trained to. The model's
``config.json`` says whether its embeddings may be truncated (``is_matryoshka``,
``matryoshka_dimensions``: ``pooling_params.py`` NOTE 1).

Mirrors: vLLM's ``get_pooling_config`` and ``get_sentence_transformer_tokenizer_config``
(``vllm/transformers_utils/config.py``), which read the same files.

Invariants: every file is read through ``read_json_object`` (``model_files.py``: regular
files inside the folder, bounded); a folder without ``modules.json`` has no pooling of its
own (``pooling_type`` and ``normalize`` None); a ``modules.json`` that is not a list of
objects, or a ``Pooling`` module whose modes name none or several of the three built, is a
ValueError naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.models.model_files import read_json_object, read_model_file, require_model_folder

# sentence-transformers' pooling modes -> PoolerConfig.pooling_type
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class PoolingSpec:
    """A model folder's pooling: None where the folder says nothing."""

    pooling_type: str | None = None
    normalize: bool | None = None
    matryoshka: bool = False


def read_pooling_spec(folder: str | Path) -> PoolingSpec:
    """The folder's sentence-transformers pooling and matryoshka flags (module header)."""
    root = require_model_folder(folder)
    config = read_json_object(root / "config.json", root)
    matryoshka = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    path = root / "modules.json"
    if not os.path.lexists(path):  # a link to nowhere is refused by the read below
        return PoolingSpec(matryoshka=matryoshka)
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
    return PoolingSpec(pooling_type, "Normalize" in kinds, matryoshka)
