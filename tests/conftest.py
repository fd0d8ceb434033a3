"""Fixtures shared by the example-based tests."""

import pytest

from tinyvllm.request import Request
from tinyvllm.sampling_params import SamplingParams


@pytest.fixture
def make_request():
    """Build a ``Request`` from a list of token ids with default sampling params."""

    def _make(request_id: str, token_ids, **kwargs) -> Request:
        sampling = kwargs.pop("sampling_params", None) or SamplingParams()
        return Request(request_id, list(token_ids), sampling, **kwargs)

    return _make


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """Tiny random Qwen3, Qwen2 and Llama folders (real HF format), built once a session."""
    from tinyvllm.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {family: build_tiny_model(root / family, family) for family in ("qwen3", "qwen2", "llama")}
