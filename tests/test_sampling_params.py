"""SamplingParams: defaults, and a ValueError naming field and value for every bad field."""

import math

import pytest

from tinyvllm.config import ReasoningConfig
from tinyvllm.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert p.logit_bias is None and p.min_tokens == 0 and p.max_tokens == 16
    assert p.stop_token_ids == () and p.ignore_eos is False and p.seed is None
    assert p.thinking_token_budget is None and p.extra_args is None
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy


def test_valid_values_are_kept():
    bias = {3: 1, 5: -0.5}
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, logit_bias=bias, min_tokens=2,
                       max_tokens=8, stop_token_ids=[1, 2], ignore_eos=True, seed=7, thinking_token_budget=0,
                       extra_args={"a": 1})
    assert p.stop_token_ids == (1, 2)
    assert p.logit_bias == {3: 1.0, 5: -0.5}
    bias[3] = 100  # a private copy
    assert p.logit_bias[3] == 1.0
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("temperature", -0.1, "-0.1"), ("temperature", math.nan, "nan"), ("temperature", math.inf, "inf"),
        ("temperature", "1", "'1'"),
        ("top_p", 0.0, "0.0"), ("top_p", 1.5, "1.5"), ("top_p", -1, "-1"), ("top_p", None, "None"),
        ("top_k", -1, "-1"), ("top_k", 2.5, "2.5"), ("top_k", True, "True"),
        ("min_p", -0.1, "-0.1"), ("min_p", 1.1, "1.1"), ("min_p", math.nan, "nan"),
        ("logit_bias", [1, 2], "[1, 2]"), ("logit_bias", {-1: 1.0}, "-1"), ("logit_bias", {"a": 1.0}, "'a'"),
        ("logit_bias", {1: math.inf}, "inf"),
        ("min_tokens", -1, "-1"), ("min_tokens", 17, "17"), ("min_tokens", 1.0, "1.0"),
        ("max_tokens", 0, "0"), ("max_tokens", 2.0, "2.0"), ("max_tokens", True, "True"),
        ("stop_token_ids", [-1], "-1"), ("stop_token_ids", ["x"], "'x'"), ("stop_token_ids", "abc", "'abc'"),
        ("ignore_eos", 1, "1"),
        ("seed", 1.5, "1.5"), ("seed", "7", "'7'"),
        ("thinking_token_budget", -1, "-1"), ("thinking_token_budget", 2.0, "2.0"),
        ("extra_args", [1], "[1]"),
    ],
)
def test_invalid_field_raises_value_error_naming_field_and_value(field, value, shown):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message and shown in message, message


def test_is_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.0


def test_reasoning_config_validation():
    rc = ReasoningConfig([1, 2], [3])
    assert rc.reasoning_start_token_ids == (1, 2) and rc.reasoning_end_token_ids == (3,)
    with pytest.raises(ValueError, match="reasoning_end_token_ids.*-4"):
        ReasoningConfig((1,), (-4,))
    with pytest.raises(ValueError, match="reasoning_start_token_ids"):
        ReasoningConfig("abc", (1,))
