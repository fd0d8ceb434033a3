"""Logits processors (seed 001 ch. 7.4, 9-12): interface, built-ins, container, loading, adapter."""

from tinyvllm.sample.logits_processors.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from tinyvllm.sample.logits_processors.builtin import (
    BUILTIN_LOGITS_PROCESSORS,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from tinyvllm.sample.logits_processors.interface import LogitsProcessor
from tinyvllm.sample.logits_processors.loader import (
    LOGITSPROCS_GROUP,
    STR_POOLING_REJECTS_LOGITSPROCS,
    STR_SPEC_DEC_REJECTS_LOGITSPROCS,
    build_logitsprocs,
    cached_load_custom_logitsprocs,
    validate_logits_processors_parameters,
)
from tinyvllm.sample.logits_processors.state import LogitsProcessors, process_dict_updates

__all__ = [
    "AdapterLogitsProcessor",
    "BUILTIN_LOGITS_PROCESSORS",
    "LOGITSPROCS_GROUP",
    "LogitBiasLogitsProcessor",
    "LogitsProcessor",
    "LogitsProcessors",
    "MinPLogitsProcessor",
    "MinTokensLogitsProcessor",
    "RequestLogitsProcessor",
    "STR_POOLING_REJECTS_LOGITSPROCS",
    "STR_SPEC_DEC_REJECTS_LOGITSPROCS",
    "build_logitsprocs",
    "cached_load_custom_logitsprocs",
    "process_dict_updates",
    "validate_logits_processors_parameters",
]
