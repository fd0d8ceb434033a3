# --8<-- [start:header]
"""Loading custom logits processors and building the processor set of an engine.

Concept: custom processors come from three places, loaded in this order: installed
plugins (the entry-point group ``"tinyvllm.logits_processors"``), fully qualified class
names ``"package.module:Outer.Inner"``, and class objects passed directly.
``build_logitsprocs`` then instantiates them beside the built-ins, in one of three modes:
pooling model (no processors; custom ones are an error), speculative decoding (MinTokens
only; custom ones are an error), normal (built-ins, then custom ones).

Seed: 001 ch. 11.1-11.5, appendix Q. Mirrors: ``vllm/v1/sample/logits_processor/__init__.py``.

Errors: a malformed FQCN, a name that is not a class, or a class that is not a
``LogitsProcessor`` raise ``ValueError`` naming it; an import failure (of a plugin or of
an FQCN's module) raises ``RuntimeError`` chained to the original exception.

NOTE 1: a config whose ``speculative_config`` is not None (``EngineConfig``'s, set by
``LLM(speculative_config=...)``; the loader's tests pass a fake) selects the spec-decode
mode; ``min_p`` and ``logit_bias`` are refused per request instead (request_checks.py).
NOTE 2: ``validate_logits_processors_parameters`` caches the loaded classes per tuple of
names (``functools.lru_cache``): importing is slow and the set of installed plugins is
fixed for the life of the process. Tests that fake entry points call
``cached_load_custom_logitsprocs.cache_clear()``.
Left out: vLLM's ``guard_cuda_initialization`` (we never fork a CUDA process) and the TPU branch.
"""
# --8<-- [end:header]

from __future__ import annotations

import importlib
import itertools
from collections.abc import Sequence
from functools import lru_cache
from importlib import metadata
from typing import TYPE_CHECKING

import torch

from tinyvllm.sample.logits_processors.builtin import BUILTIN_LOGITS_PROCESSORS, MinTokensLogitsProcessor
from tinyvllm.sample.logits_processors.interface import LogitsProcessor
from tinyvllm.sample.logits_processors.state import LogitsProcessors

if TYPE_CHECKING:
    from tinyvllm.config import EngineConfig
    from tinyvllm.sampling_params import SamplingParams

LOGITSPROCS_GROUP = "tinyvllm.logits_processors"
STR_POOLING_REJECTS_LOGITSPROCS = "Pooling models do not support custom logits processors."
STR_SPEC_DEC_REJECTS_LOGITSPROCS = "Custom logits processors are not supported with speculative decoding."



# --8<-- [start:plugins]
def _load_logitsprocs_plugins() -> list[type[LogitsProcessor]]:
    """Load every class registered under the entry-point group ``LOGITSPROCS_GROUP``.

    A plugin package registers one in its ``pyproject.toml``::

        [project.entry-points."tinyvllm.logits_processors"]
        my_proc = "my_package.procs:MyLogitsProcessor"
    """
    classes: list[type[LogitsProcessor]] = []
    for entry_point in metadata.entry_points(group=LOGITSPROCS_GROUP):
        try:
            obj = entry_point.load()
        except Exception as exc:
            raise RuntimeError(f"failed to load LogitsProcessor plugin {entry_point.name!r}") from exc
        classes.append(_check_class(obj, f"plugin {entry_point.name!r}"))
    return classes


def _check_class(obj: object, origin: str) -> type[LogitsProcessor]:
    if not isinstance(obj, type):
        raise ValueError(f"{origin} must name a class, got {obj!r}")
    if not issubclass(obj, LogitsProcessor):
        raise ValueError(f"{origin}: {obj.__name__} is not a subclass of LogitsProcessor")
    return obj


def _load_logitsprocs_by_fqcns(logits_processors: "Sequence[str | type[LogitsProcessor]] | None") -> list[type[LogitsProcessor]]:
    """Resolve classes and ``"module.path:Qual.Name"`` strings to LogitsProcessor classes."""
    classes: list[type[LogitsProcessor]] = []
    for ldx, spec in enumerate(logits_processors or ()):
        if isinstance(spec, type):
            classes.append(_check_class(spec, f"logits processor {ldx}"))
            continue
        if not isinstance(spec, str):
            raise ValueError(f"logits processor {ldx} must be a class or a 'module:QualName' string, got {spec!r}")
        module_path, sep, qualname = spec.partition(":")
        if not sep or not module_path or not qualname or ":" in qualname:
            raise ValueError(f"malformed logits processor FQCN {spec!r}: expected 'module.path:QualName'")
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            raise RuntimeError(f"failed to import module {module_path!r} of logits processor {ldx} ({spec!r})") from exc
        obj: object = module
        for attr in qualname.split("."):
            if not hasattr(obj, attr):
                raise ValueError(f"logits processor FQCN {spec!r}: {attr!r} not found")
            obj = getattr(obj, attr)
        classes.append(_check_class(obj, f"logits processor FQCN {spec!r}"))
    return classes


def _load_custom_logitsprocs(logits_processors: "Sequence[str | type[LogitsProcessor]] | None") -> list[type[LogitsProcessor]]:
    """Plugins first, then the names and classes the user gave."""
    return _load_logitsprocs_plugins() + _load_logitsprocs_by_fqcns(logits_processors)
# --8<-- [end:plugins]


# --8<-- [start:build]
def build_logitsprocs(
    config: "EngineConfig",
    device: torch.device,
    is_pin_memory: bool,
    is_pooling_model: bool,
    custom_logitsprocs: "Sequence[str | type[LogitsProcessor]]" = (),
) -> LogitsProcessors:
    """Instantiate the engine's processors in one of the three modes of ch. 11.4."""
    if is_pooling_model:
        if custom_logitsprocs:
            raise ValueError(f"{STR_POOLING_REJECTS_LOGITSPROCS} Got {list(custom_logitsprocs)!r}")
        return LogitsProcessors()
    if getattr(config, "speculative_config", None) is not None:  # NOTE 1
        if custom_logitsprocs:
            raise ValueError(f"{STR_SPEC_DEC_REJECTS_LOGITSPROCS} Got {list(custom_logitsprocs)!r}")
        return LogitsProcessors([MinTokensLogitsProcessor(config, device, is_pin_memory)])
    custom_classes = _load_custom_logitsprocs(custom_logitsprocs)
    return LogitsProcessors(
        cls(config, device, is_pin_memory) for cls in itertools.chain(BUILTIN_LOGITS_PROCESSORS, custom_classes)
    )
# --8<-- [end:build]


# --8<-- [start:validate]
cached_load_custom_logitsprocs = lru_cache(_load_custom_logitsprocs)  # NOTE 2


def validate_logits_processors_parameters(
    logits_processors: "Sequence[str | type[LogitsProcessor]] | None",
    sampling_params: "SamplingParams",
) -> None:
    """Ask every custom processor whether it accepts ``sampling_params`` (raises ValueError if not)."""
    key = tuple(logits_processors) if logits_processors is not None else None
    for cls in cached_load_custom_logitsprocs(key):
        cls.validate_params(sampling_params)
# --8<-- [end:validate]
