"""tinyvllm: a small, documented, test-first reference implementation of the vLLM V1 engine.

The top level stays free of torch so that ``import tinyvllm.core`` (the scheduler side)
never pulls it in; a test enforces that.
"""

from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams

__all__ = ["Request", "RequestStatus", "SamplingParams"]
__version__ = "0.1.0"
