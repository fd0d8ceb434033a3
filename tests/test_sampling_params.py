"""SamplingParams: defaults, and an error naming field and value for every bad field:
TypeError for a wrong type, ValueError for a value out of range."""

import math

import numpy as np
import pytest
import torch

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
        ("temperature", 1e-3, "0.001"), ("temperature", 1e-40, "1e-40"), ("temperature", 1e39, "1e+39"),
        ("top_p", 0.0, "0.0"), ("top_p", 1.5, "1.5"), ("top_p", -1, "-1"),
        ("top_k", -2, "-2"), ("top_k", 2**63, str(2**63)),
        ("min_p", -0.1, "-0.1"), ("min_p", 1.1, "1.1"), ("min_p", math.nan, "nan"),
        ("logit_bias", {-1: 1.0}, "-1"), ("logit_bias", {1: math.inf}, "inf"), ("logit_bias", {1: 100.5}, "100.5"),
        ("logit_bias", {1: -1e39}, "-1e+39"),
        ("min_tokens", -1, "-1"), ("min_tokens", 17, "17"),
        ("max_tokens", 0, "0"),
        ("stop_token_ids", [-1], "-1"),
        ("seed", 2**70, str(2**70)), ("seed", -(2**63) - 1, str(-(2**63) - 1)),
        ("thinking_token_budget", -1, "-1"),
    ],
)
def test_bad_value_raises_value_error_naming_field_and_value(field, value, shown):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message and shown in message, message


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("temperature", "1", "'1'"), ("temperature", None, "None"), ("temperature", True, "True"),
        ("top_p", None, "None"), ("top_p", "0.5", "'0.5'"),
        ("top_k", 2.5, "2.5"), ("top_k", True, "True"), ("top_k", np.bool_(True), "True"),
        ("min_p", "0", "'0'"),
        ("logit_bias", [1, 2], "[1, 2]"), ("logit_bias", {"a": 1.0}, "'a'"), ("logit_bias", {1.0: 1.0}, "1.0"),
        ("logit_bias", {1: "x"}, "'x'"), ("logit_bias", {1: None}, "None"),
        ("min_tokens", 1.0, "1.0"),
        ("max_tokens", 2.0, "2.0"), ("max_tokens", True, "True"), ("max_tokens", "8", "'8'"),
        ("stop_token_ids", ["x"], "'x'"), ("stop_token_ids", "abc", "'abc'"), ("stop_token_ids", 5, "5"),
        ("stop_token_ids", [1.0], "1.0"),
        ("ignore_eos", 1, "1"), ("ignore_eos", "no", "'no'"),
        ("seed", 1.5, "1.5"), ("seed", "7", "'7'"), ("seed", True, "True"),
        ("thinking_token_budget", 2.0, "2.0"),
        ("extra_args", [1], "[1]"), ("extra_args", {1: 2}, "1"),
    ],
)
def test_wrong_type_raises_type_error_naming_field_and_value(field, value, shown):
    with pytest.raises(TypeError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message and shown in message, message


def test_numpy_and_torch_integers_are_accepted_and_stored_as_int():
    p = SamplingParams(
        top_k=np.int32(5), max_tokens=np.int64(9), min_tokens=torch.tensor(2), seed=np.uint8(7),
        stop_token_ids=np.array([3, 4]), logit_bias={np.int64(6): np.float32(1.5)}, temperature=np.float64(0.5),
        thinking_token_budget=np.int16(3),
    )  # fmt: skip
    assert (p.top_k, p.max_tokens, p.min_tokens, p.seed, p.stop_token_ids) == (5, 9, 2, 7, (3, 4))
    assert p.logit_bias == {6: 1.5} and p.thinking_token_budget == 3 and p.temperature == 0.5
    for value in (p.top_k, p.max_tokens, p.min_tokens, p.seed, *p.stop_token_ids, *p.logit_bias, p.thinking_token_budget):
        assert type(value) is int
    assert type(p.temperature) is float and type(p.logit_bias[6]) is float


def test_limits_are_inclusive():
    p = SamplingParams(temperature=0.01, logit_bias={1: 100, 2: -100}, seed=2**63 - 1, top_k=2**63 - 1)
    assert p.logit_bias == {1: 100.0, 2: -100.0}
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_is_frozen():
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.0


def test_reasoning_config_validation():
    rc = ReasoningConfig([1, 2], [3])
    assert rc.reasoning_start_token_ids == (1, 2) and rc.reasoning_end_token_ids == (3,)
    with pytest.raises(ValueError, match="reasoning_end_token_ids.*-4"):
        ReasoningConfig((1,), (-4,))
    with pytest.raises(TypeError, match="reasoning_start_token_ids.*'abc'"):
        ReasoningConfig("abc", (1,))
    with pytest.raises(TypeError, match="reasoning_end_token_ids.*1.5"):
        ReasoningConfig((1,), (1.5,))
    assert ReasoningConfig(np.array([7]), (np.int64(8),)) == ReasoningConfig((7,), (8,))


# -- issue 25: vLLM's whole V1 sampling surface ------------------------------------------------


def test_new_fields_default_to_off_as_in_vllm():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.bad_words == () and p.allowed_token_ids is None
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.n == 1 and p.skip_special_tokens is True


def test_top_k_minus_one_means_off_as_in_vllm():
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(ValueError, match="top_k.*-2"):
        SamplingParams(top_k=-2)


def test_max_tokens_none_means_up_to_the_context():
    p = SamplingParams(max_tokens=None, min_tokens=5)
    assert p.max_tokens is None and p.min_tokens == 5


def test_new_fields_keep_valid_values():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1.3, bad_words=["foo", " bar"],
                       allowed_token_ids=[5, np.int64(7)], logprobs=3, prompt_logprobs=0, n=4, skip_special_tokens=False)  # fmt: skip
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2.0, 2.0, 1.3)
    assert p.bad_words == ("foo", " bar") and p.allowed_token_ids == (5, 7)
    assert (p.logprobs, p.prompt_logprobs, p.n, p.skip_special_tokens) == (3, 0, 4, False)
    assert SamplingParams(bad_words="foo").bad_words == ("foo",)


@pytest.mark.parametrize(
    "field, value, exc, shown",
    [
        ("presence_penalty", 2.5, ValueError, "2.5"), ("presence_penalty", -3, ValueError, "-3"),
        ("frequency_penalty", 99, ValueError, "99"), ("frequency_penalty", math.nan, ValueError, "nan"),
        ("repetition_penalty", 0, ValueError, "0"), ("repetition_penalty", -1.0, ValueError, "-1.0"),
        ("repetition_penalty", math.inf, ValueError, "inf"), ("presence_penalty", "1", TypeError, "'1'"),
        ("bad_words", [""], ValueError, "''"), ("bad_words", [5], TypeError, "5"), ("bad_words", 5, TypeError, "5"),
        ("allowed_token_ids", [], ValueError, "[]"), ("allowed_token_ids", [-1], ValueError, "-1"),
        ("allowed_token_ids", "abc", TypeError, "'abc'"),
        ("logprobs", -2, ValueError, "-2"), ("logprobs", True, TypeError, "True"), ("logprobs", 1.0, TypeError, "1.0"),
        ("prompt_logprobs", -2, ValueError, "-2"), ("n", 0, ValueError, "0"), ("n", "2", TypeError, "'2'"),
        ("n", 16385, ValueError, "16385"), ("n", 2**63, ValueError, "9223372036854775808"),  # vLLM's cap
        ("skip_special_tokens", 1, TypeError, "1"), ("max_tokens", 0, ValueError, "0"),
    ],
)  # fmt: skip
def test_new_fields_refuse_bad_values_naming_field_and_value(field, value, exc, shown):
    with pytest.raises(exc) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and shown in str(info.value), str(info.value)


def test_n_up_to_vllms_cap_is_accepted():
    """``n`` is capped as vLLM caps it (``VLLM_MAX_N_SEQUENCES``, 16384 by default): one
    request may not ask for so many children that adding them exhausts the memory."""
    assert SamplingParams(n=16384).n == 16384
