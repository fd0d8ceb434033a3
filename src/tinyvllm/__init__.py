"""tinyvllm: a small, documented, test-first reference implementation of the vLLM V1 engine.

``from tinyvllm import LLM, SamplingParams``. ``LLM`` is imported lazily, on first use, so
that ``import tinyvllm.core`` (the scheduler side) never pulls in torch; a test enforces it.
"""

from tinyvllm.beam_search import BeamSearchOutput, BeamSearchParams
from tinyvllm.outputs import (
    ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput,
    RequestOutput, ScoringOutput, ScoringRequestOutput,
)  # fmt: skip
from tinyvllm.pooling_params import PoolingParams
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "ClassificationOutput", "ClassificationRequestOutput",
           "CompletionOutput", "EmbeddingRequestOutput", "PoolingParams",
           "PoolingRequestOutput", "Request", "RequestOutput", "RequestStatus", "SamplingParams", "ScoringOutput",
           "ScoringRequestOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from tinyvllm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tinyvllm' has no attribute {name!r}")
