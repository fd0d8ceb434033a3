"""Sampling defaults from the model's ``generation_config.json``, and merging them into a request.

Concept: a model's creator often says how it should be sampled (Qwen3's folder asks for
temperature 0.6, top_p 0.95, top_k 20). vLLM reads that advice at start-up and uses it
for every field a user leaves unset; ``LLM(generation_config=...)`` chooses where it comes
from:

- ``"auto"`` (the default): the model folder's ``generation_config.json``;
- ``"vllm"``: nowhere, ``SamplingParams``' own defaults;
- a folder path: that folder's ``generation_config.json`` (it must have one).

``load_generation_defaults`` reads the file (through ``models/model_files.py``'s checked
reader, as the loader reads every file of the folder) and checks its fields (NOTE 2);
``generation_defaults`` picks the source, and ``merge_defaults`` lays explicit values over
the defaults (NOTE 1). ``LLM.get_default_sampling_params()`` is ``SamplingParams(**defaults)``.

Mirrors: ``vllm/config/model.py`` (``ModelConfig.get_diff_sampling_param``,
``try_get_generation_config``), ``vllm/entrypoints/llm.py``
(``LLM.get_default_sampling_params``), the OpenAI server's ``to_sampling_params`` (a
request's value, else the model's default, else vLLM's).

NOTE 1 (explicit wins): the server and the command line pass only the fields the user
set; each replaces the default of its own field and no other. ``LLM.generate`` with a
``SamplingParams`` object takes it whole, as vLLM's ``LLM.generate`` does: an object has
no "unset" fields.
NOTE 2 (vLLM's six fields): vLLM's ``ModelConfig.get_diff_sampling_param`` keeps six
fields of ``generation_config.json``, ``max_new_tokens`` renamed ``max_tokens``; a null
is as good as absent, every other key (``do_sample`` too) is ignored. ``SamplingParams``
checks each value, so the ranges are a request's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinyvllm.models.model_files import json_type, read_json_object, require_model_folder
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# NOTE 2: generation_config.json field -> SamplingParams field (vLLM's six)
GENERATION_DEFAULT_FIELDS = {
    "repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
    "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens",
}  # fmt: skip


def check_generation_config(value: object) -> str:
    """``"auto"``, ``"vllm"`` or a folder holding a ``generation_config.json`` (a str or a
    path, returned as a str); anything else is a TypeError or ValueError naming the value."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    wanted = "'auto', 'vllm' or a folder holding a generation_config.json"
    if not isinstance(value, str):
        raise TypeError(f"generation_config must be {wanted} (a str), got {value!r} ({type(value).__name__})")
    if value in GENERATION_CONFIG_CHOICES:
        return value
    if not Path(value).is_dir():
        raise ValueError(f"generation_config must be {wanted}, got {value!r} (no such folder)")
    if not os.path.lexists(Path(value) / "generation_config.json"):  # what is there, the loader checks
        raise ValueError(f"generation_config {value!r} is a folder with no generation_config.json")
    return value


# --8<-- [start:load_generation_defaults]
def load_generation_defaults(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults of ``folder/generation_config.json`` as ``SamplingParams``
    keyword arguments (NOTE 2): ``{}`` when the file is absent or sets none of the fields.
    A malformed value is a ValueError naming the file, the field and the value."""
    gen = require_model_folder(folder) / "generation_config.json"
    if not os.path.lexists(gen):
        return {}
    config = read_json_object(gen, Path(folder))  # within bounds, a JSON object
    defaults: dict[str, Any] = {}
    for key, name in GENERATION_DEFAULT_FIELDS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{gen}: field {key!r} must be a number, got {value!r} ({json_type(value)})")
        try:
            SamplingParams(**{name: value})  # the same ranges as a request's
        except (TypeError, ValueError) as e:
            raise ValueError(f"{gen}: field {key!r} is refused: {e}") from None
        defaults[name] = value
    return defaults
# --8<-- [end:load_generation_defaults]


# --8<-- [start:generation_defaults]
def generation_defaults(generation_config: str, model_folder: str | Path) -> dict[str, Any]:
    """The model's sampling defaults as ``SamplingParams`` keyword arguments, from the
    source ``generation_config`` names (``check_generation_config``'s value)."""
    if generation_config == "vllm":
        return {}
    folder = model_folder if generation_config == "auto" else generation_config
    defaults = load_generation_defaults(folder)  # ValueError naming the file and the field
    if defaults:
        logger.info(
            "Default sampling parameters have been overridden by the model's Hugging Face generation config "
            "(%s: %s); pass generation_config='vllm' (--generation-config vllm) to ignore it",
            Path(folder) / "generation_config.json", defaults,
        )  # fmt: skip
    return defaults


# --8<-- [end:generation_defaults]


# --8<-- [start:merge_defaults]
def merge_defaults(defaults: SamplingParams, explicit: Mapping[str, Any]) -> SamplingParams:
    """``defaults`` with every field of ``explicit`` (the ones a user set) laid over it
    (NOTE 1). An unknown field name is a TypeError; a bad value fails ``SamplingParams``'
    own checks, naming the field."""
    unknown = sorted(set(explicit) - _FIELDS)
    if unknown:
        raise TypeError(f"{unknown[0]!r} is not a SamplingParams field")
    return dataclasses.replace(defaults, **explicit)  # __post_init__ checks the merged values again
# --8<-- [end:merge_defaults]
