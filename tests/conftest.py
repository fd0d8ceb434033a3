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
