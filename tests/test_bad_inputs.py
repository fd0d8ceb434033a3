"""Bad inputs, one case each, as a new user would try them: every one is refused before
anything runs, and the engine is as good as new afterwards.

Each case asserts three things:
1. the exception type (TypeError for a wrong type, ValueError for a wrong value; the
   loader's RuntimeError for a module that cannot be imported) and that the message names
   the parameter and the value;
2. no request is left in the scheduler and every KV block is free;
3. a good request afterwards gives the tokens a fresh engine gives for it.
Generate-time cases share one module-scoped ``LLM`` (which is what makes 3. a real check:
the same engine must still work); constructor cases build a fresh ``LLM`` after the failed
one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ReasoningConfig

ENGINE = dict(device="cpu", max_model_len=64, block_size=4)
GOOD_PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
GOOD_PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
VOCAB = 512  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def no_think_folder(tiny_model_dirs, tmp_path_factory):
    """The tiny Qwen3 with ``<think>``/``</think>`` renamed: its engine has no reasoning config."""
    copy = tmp_path_factory.mktemp("no_think") / "qwen3"
    shutil.copytree(tiny_model_dirs["qwen3"], copy)
    path = copy / "tokenizer.json"
    text = path.read_text(encoding="utf-8")
    assert "<think>" in text and "</think>" in text
    path.write_text(text.replace("<think>", "<mark>").replace("</think>", "</mark>"), encoding="utf-8")
    return str(copy)


def _good_tokens(llm: LLM) -> list[int]:
    [out] = llm.generate(GOOD_PROMPT, GOOD_PARAMS, use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.fixture(scope="module")
def fresh_tokens(folder):
    """What a fresh engine generates for the good request (computed once)."""
    return _good_tokens(LLM(folder, **ENGINE))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, **ENGINE)


@pytest.fixture(scope="module")
def llm_no_reasoning(no_think_folder):
    llm = LLM(no_think_folder, **ENGINE)
    assert llm.config.reasoning_config is None
    return llm


def _assert_engine_as_new(llm: LLM, fresh_tokens: list[int]) -> None:
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks
    assert _good_tokens(llm) == fresh_tokens


def _raises(exc: type[Exception], words: tuple[str, ...], call: Callable[[], object]) -> None:
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# -- generate-time cases: one shared engine ----------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[LLM], object]
    exc: type[Exception]
    words: tuple[str, ...]  # the parameter's name and the value, as the message shows them
    engine: str = "llm"  # which module fixture: "llm" or "llm_no_reasoning"


def gen(prompt=GOOD_PROMPT, **params) -> Callable[[LLM], object]:
    """Generate ``prompt`` with ``SamplingParams(**params)`` (built inside the call)."""
    return lambda llm: llm.generate(prompt, SamplingParams(**{"max_tokens": 3, **params}), use_tqdm=False)


def gen_raw(prompts, sampling_params=None, **kwargs) -> Callable[[LLM], object]:
    return lambda llm: llm.generate(prompts, sampling_params, use_tqdm=kwargs.get("use_tqdm", False))


def add(request_id="r", ids=(5, 6, 7), params=GOOD_PARAMS, **kwargs) -> Callable[[LLM], object]:
    return lambda llm: llm.engine.add_request(request_id, list(ids), params, **kwargs)


GENERATE_CASES = [
    # logit_bias: keys in the vocabulary, values finite and in [-100, 100]
    Case("logit_bias_key_past_vocab", gen(logit_bias={600: 1.0}), ValueError, ("logit_bias", "600", "[0, 512)")),
    Case("logit_bias_key_at_vocab_size", gen(logit_bias={VOCAB: 1.0}), ValueError, ("logit_bias", "512")),
    Case("logit_bias_key_negative", gen(logit_bias={-1: 1.0}), ValueError, ("logit_bias", "-1")),
    Case("logit_bias_key_str", gen(logit_bias={"5": 1.0}), TypeError, ("logit_bias", "'5'")),
    Case("logit_bias_value_1e39", gen(logit_bias={5: 1e39}), ValueError, ("logit_bias[5]", "1e+39")),
    Case("logit_bias_value_above_100", gen(logit_bias={5: 100.5}), ValueError, ("logit_bias[5]", "100.5")),
    Case("logit_bias_value_nan", gen(logit_bias={5: float("nan")}), ValueError, ("logit_bias[5]", "nan")),
    Case("logit_bias_value_minus_inf", gen(logit_bias={5: float("-inf")}), ValueError, ("logit_bias[5]", "-inf")),
    Case("logit_bias_value_str", gen(logit_bias={5: "1"}), TypeError, ("logit_bias[5]", "'1'")),
    Case("logit_bias_list", gen(logit_bias=[5, 1.0]), TypeError, ("logit_bias", "[5, 1.0]")),
    # stop_token_ids
    Case("stop_id_past_vocab_with_min_tokens", gen(stop_token_ids=[600], min_tokens=2), ValueError,
         ("stop_token_ids", "600")),
    Case("stop_id_at_vocab_size", gen(stop_token_ids=[VOCAB]), ValueError, ("stop_token_ids", "512")),
    Case("stop_ids_an_int", gen(stop_token_ids=5), TypeError, ("stop_token_ids", "5")),
    Case("stop_ids_a_str", gen(stop_token_ids="abc"), TypeError, ("stop_token_ids", "'abc'")),
    Case("stop_id_negative", gen(stop_token_ids=[-3]), ValueError, ("stop_token_ids", "-3")),
    # seed
    Case("seed_2_pow_70", gen(seed=2**70), ValueError, ("seed", str(2**70))),
    Case("seed_str", gen(seed="abc"), TypeError, ("seed", "'abc'")),
    Case("seed_float", gen(seed=1.5), TypeError, ("seed", "1.5")),
    Case("seed_bool", gen(seed=True), TypeError, ("seed", "True")),
    # the other sampling knobs
    Case("temperature_1e-40", gen(temperature=1e-40), ValueError, ("temperature", "1e-40")),
    Case("temperature_past_float32", gen(temperature=1e39), ValueError, ("temperature", "1e+39")),
    Case("temperature_negative", gen(temperature=-1), ValueError, ("temperature", "-1")),
    Case("temperature_str", gen(temperature="0.5"), TypeError, ("temperature", "'0.5'")),
    Case("top_k_past_int64", gen(top_k=10**30), ValueError, ("top_k", str(10**30))),
    Case("top_k_bool", gen(top_k=True), TypeError, ("top_k", "True")),
    Case("top_p_zero", gen(top_p=0.0), ValueError, ("top_p", "0.0")),
    Case("top_p_none", gen(top_p=None), TypeError, ("top_p", "None")),
    Case("min_p_two", gen(min_p=2), ValueError, ("min_p", "2")),
    Case("max_tokens_zero", gen(max_tokens=0), ValueError, ("max_tokens", "0")),
    Case("max_tokens_str", gen(max_tokens="8"), TypeError, ("max_tokens", "'8'")),
    Case("min_tokens_above_max_tokens", gen(min_tokens=4), ValueError, ("min_tokens", "4")),
    Case("ignore_eos_str", gen(ignore_eos="no"), TypeError, ("ignore_eos", "'no'")),
    Case("thinking_budget_negative", gen(thinking_token_budget=-1), ValueError, ("thinking_token_budget", "-1")),
    Case("extra_args_int_key", gen(extra_args={1: 2}), TypeError, ("extra_args", "1")),
    Case("thinking_budget_without_reasoning_config", gen(thinking_token_budget=3), ValueError,
         ("thinking_token_budget", "3", "reasoning_config"), engine="llm_no_reasoning"),
    # prompts
    Case("prompts_none", gen_raw(None), TypeError, ("prompts", "None")),
    Case("prompts_int", gen_raw(5), TypeError, ("prompts", "5")),
    Case("prompts_bytes", gen_raw(b"abc"), TypeError, ("prompts", "b'abc'")),
    Case("prompt_bare_id_list", gen_raw([[5, 6, 7]]), TypeError, ("prompt 0", "[5, 6, 7]", "prompt_token_ids")),
    Case("prompt_id_at_vocab_size", gen_raw({"prompt_token_ids": [1, VOCAB]}), ValueError,
         ("prompt 0", "512", "[0, 512)")),
    Case("prompt_id_negative", gen_raw({"prompt_token_ids": [1, -2]}), ValueError, ("prompt 0", "-2")),
    Case("prompt_id_float", gen_raw({"prompt_token_ids": [1, 2.0]}), TypeError, ("prompt 0", "2.0")),
    Case("prompt_id_bool", gen_raw({"prompt_token_ids": [True]}), TypeError, ("prompt 0", "True")),
    Case("prompt_ids_a_str", gen_raw({"prompt_token_ids": "abc"}), TypeError, ("prompt 0", "'abc'")),
    Case("prompt_ids_none", gen_raw({"prompt_token_ids": None}), TypeError, ("prompt 0", "None")),
    Case("prompt_ids_2d_array", gen_raw({"prompt_token_ids": np.ones((2, 2), dtype=np.int64)}), TypeError,
         ("prompt 0", "array")),
    Case("prompt_ids_empty", gen_raw({"prompt_token_ids": []}), ValueError, ("prompt 0", "empty")),
    Case("prompt_text_empty", gen_raw(""), ValueError, ("prompt 0", "empty")),
    Case("prompt_too_long", gen_raw({"prompt_token_ids": [7] * 65}), ValueError, ("prompt 0", "65", "max_model_len")),
    Case("prompt_unknown_key", gen_raw({"prompt_ids": [5, 6]}), ValueError, ("prompt 0", "'prompt_ids'")),
    Case("prompt_dict_without_text_or_ids", gen_raw({"cache_salt": "a"}), ValueError,
         ("prompt 0", "'prompt'", "'prompt_token_ids'")),
    Case("prompt_text_not_str", gen_raw({"prompt": 5}), TypeError, ("prompt 0", "'prompt'", "5")),
    Case("cache_salt_int", gen_raw({"prompt_token_ids": [5, 6], "cache_salt": 5}), TypeError,
         ("cache_salt", "5")),
    Case("second_prompt_bad_nothing_runs", gen_raw([GOOD_PROMPT, {"prompt_token_ids": [600]}]), ValueError,
         ("prompt 1", "600")),
    # sampling_params and use_tqdm
    Case("sampling_params_int", gen_raw(GOOD_PROMPT, 5), TypeError, ("sampling_params", "5")),
    Case("sampling_params_dict", gen_raw(GOOD_PROMPT, {"temperature": 0}), TypeError,
         ("sampling_params", "'temperature'")),
    Case("sampling_params_item_wrong", gen_raw([GOOD_PROMPT, GOOD_PROMPT], [GOOD_PARAMS, 5]), TypeError,
         ("sampling_params[1]", "5")),
    Case("sampling_params_count", gen_raw(GOOD_PROMPT, [GOOD_PARAMS, GOOD_PARAMS]), ValueError,
         ("2 sampling params", "1 prompts")),
    Case("second_params_bias_past_vocab", gen_raw([GOOD_PROMPT] * 2, [GOOD_PARAMS, SamplingParams(logit_bias={700: 1})]),
         ValueError, ("sampling_params[1].logit_bias", "700")),
    Case("use_tqdm_str", gen_raw(GOOD_PROMPT, GOOD_PARAMS, use_tqdm="no"), TypeError, ("use_tqdm", "'no'")),
    # LLMEngine.add_request, for callers that skip generate
    Case("add_request_id_at_vocab_size", add(ids=[5, VOCAB]), ValueError, ("prompt_token_ids", "512", "[0, 512)")),
    Case("add_request_bias_past_vocab", add(params=SamplingParams(logit_bias={900: 1.0})), ValueError,
         ("logit_bias", "900")),
    Case("add_request_stop_past_vocab", add(params=SamplingParams(stop_token_ids=[512], min_tokens=1)), ValueError,
         ("stop_token_ids", "512")),
    Case("add_request_salt_int", add(cache_salt=7), TypeError, ("cache_salt", "7")),
    # vLLM's API refuses an empty salt; here it would have counted as a salt of its own
    Case("add_request_salt_empty", add(cache_salt=""), ValueError, ("cache_salt", "''", "non-empty")),
    Case("cache_salt_empty", gen_raw([GOOD_PROMPT, {"prompt_token_ids": [5, 6], "cache_salt": ""}]), ValueError,
         ("prompt 1", "cache_salt", "''")),
    Case("add_request_id_int", add(request_id=7), TypeError, ("request_id", "7")),
    Case("add_request_params_dict", add(params={"temperature": 0}), TypeError, ("sampling_params", "'temperature'")),
    Case("add_request_thinking_without_reasoning_config", add(params=SamplingParams(thinking_token_budget=2)),
         ValueError, ("thinking_token_budget", "reasoning_config"), engine="llm_no_reasoning"),
]  # fmt: skip


@pytest.mark.parametrize("case", GENERATE_CASES, ids=[c.id for c in GENERATE_CASES])
def test_bad_generate_input_is_refused_and_leaves_the_engine_as_new(case, request, fresh_tokens):
    llm = request.getfixturevalue(case.engine)
    _raises(case.exc, case.words, lambda: case.call(llm))
    _assert_engine_as_new(llm, fresh_tokens)


def test_the_engine_without_reasoning_config_gives_the_same_tokens(llm_no_reasoning, fresh_tokens):
    """The shared fresh tokens are also right for the engine whose tokenizer was edited."""
    assert _good_tokens(llm_no_reasoning) == fresh_tokens


def test_numpy_and_torch_token_ids_are_accepted_everywhere(llm, fresh_tokens):
    ids = GOOD_PROMPT["prompt_token_ids"]
    for prompt_ids in (np.array(ids), [np.int64(t) for t in ids], torch.tensor(ids), tuple(ids)):
        [out] = llm.generate({"prompt_token_ids": prompt_ids}, GOOD_PARAMS, use_tqdm=False)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == fresh_tokens
    unused = next(t for t in range(VOCAB) if t not in fresh_tokens)
    params = SamplingParams(temperature=0, max_tokens=np.int64(3), ignore_eos=True, min_tokens=np.int32(1),
                            logit_bias={np.int64(fresh_tokens[0]): np.float32(0.0)},
                            stop_token_ids=np.array([unused]), seed=np.int64(3))  # fmt: skip
    [out] = llm.generate({"prompt_token_ids": np.array(ids)}, params, use_tqdm=False)
    assert out.outputs[0].token_ids == fresh_tokens
    llm.engine.add_request("np", np.array(ids, dtype=np.int32), GOOD_PARAMS)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += llm.engine.step()
    assert [o.outputs[0].token_ids for o in outs] == [fresh_tokens]


def test_boundary_values_are_accepted(llm):
    """The limits themselves are fine: the last token id, a bias of +-100, the int64 seeds."""
    params = [
        SamplingParams(temperature=0, max_tokens=2, logit_bias={VOCAB - 1: 100.0, 0: -100.0}),
        SamplingParams(temperature=0.01, max_tokens=2, seed=2**63 - 1, stop_token_ids=[VOCAB - 1], min_tokens=1),
        SamplingParams(max_tokens=2, seed=-(2**63), top_k=2**63 - 1),
    ]
    outs = llm.generate([{"prompt_token_ids": [VOCAB - 1, 0]}] * 3, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [VOCAB - 1, VOCAB - 1]  # +100 wins every greedy step
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)


# -- constructor cases: a fresh engine each ------------------------------------------------


@dataclass(frozen=True)
class InitCase:
    id: str
    kwargs: dict
    exc: type[Exception]
    words: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


class NotAProcessor:
    pass


INIT_CASES = [
    InitCase("model_none", {"model": None}, TypeError, ("model", "None")),
    InitCase("model_int", {"model": 5}, TypeError, ("model", "5")),
    InitCase("device_none", {"device": None}, TypeError, ("device", "None")),
    InitCase("device_unknown", {"device": "tpu"}, ValueError, ("device", "'tpu'")),
    InitCase("dtype_none", {"dtype": None}, TypeError, ("dtype", "None")),
    InitCase("dtype_unknown", {"dtype": "float64"}, ValueError, ("dtype", "'float64'")),
    InitCase("gpu_memory_utilization_str", {"gpu_memory_utilization": "0.5"}, TypeError,
             ("gpu_memory_utilization", "'0.5'")),
    InitCase("gpu_memory_utilization_zero", {"gpu_memory_utilization": 0}, ValueError, ("gpu_memory_utilization", "0")),
    InitCase("gpu_memory_utilization_above_one", {"gpu_memory_utilization": 1.5}, ValueError,
             ("gpu_memory_utilization", "1.5")),
    InitCase("seed_str", {"seed": "abc"}, TypeError, ("seed", "'abc'")),
    InitCase("seed_2_pow_70", {"seed": 2**70}, ValueError, ("seed", str(2**70))),
    InitCase("block_size_zero_with_override", {"block_size": 0, "num_gpu_blocks_override": 10}, ValueError,
             ("block_size", "0")),
    InitCase("block_size_str", {"block_size": "16"}, TypeError, ("block_size", "'16'")),
    InitCase("block_size_float", {"block_size": 4.0}, TypeError, ("block_size", "4.0")),
    InitCase("override_past_memory", {"num_gpu_blocks_override": 10**9}, ValueError,
             ("1000000000 blocks", "GiB", "available", "num_gpu_blocks_override")),
    InitCase("override_zero", {"num_gpu_blocks_override": 0}, ValueError, ("num_gpu_blocks_override", "0")),
    InitCase("override_bool", {"num_gpu_blocks_override": True}, TypeError, ("num_gpu_blocks_override", "True")),
    InitCase("override_too_small", {"num_gpu_blocks_override": 8}, ValueError, ("num_gpu_blocks_override", "8 blocks")),
    InitCase("max_num_batched_tokens_zero", {"max_num_batched_tokens": 0}, ValueError, ("max_num_batched_tokens", "0")),
    InitCase("max_num_batched_tokens_str", {"max_num_batched_tokens": "8"}, TypeError,
             ("max_num_batched_tokens", "'8'")),
    InitCase("enable_prefix_caching_str", {"enable_prefix_caching": "no"}, TypeError,
             ("enable_prefix_caching", "'no'")),
    InitCase("enable_prefix_caching_int", {"enable_prefix_caching": 0}, TypeError, ("enable_prefix_caching", "0")),
    InitCase("max_num_seqs_zero", {"max_num_seqs": 0}, ValueError, ("max_num_seqs", "0")),
    InitCase("max_num_seqs_bool", {"max_num_seqs": True}, TypeError, ("max_num_seqs", "True")),
    InitCase("max_model_len_zero", {"max_model_len": 0}, ValueError, ("max_model_len", "0")),
    InitCase("max_model_len_str", {"max_model_len": "64"}, TypeError, ("max_model_len", "'64'")),
    InitCase("max_model_len_past_model", {"max_model_len": 100_000}, ValueError, ("max_model_len", "100000")),
    InitCase("attention_backend_unknown", {"attention_backend": "flash"}, ValueError, ("attention_backend", "'flash'")),
    InitCase("attention_backend_none", {"attention_backend": None}, TypeError, ("attention_backend", "None")),
    InitCase("triton_on_cpu_without_interpreter", {"attention_backend": "triton", "block_size": 16}, ValueError,
             ("attention_backend='triton'", "TRITON_INTERPRET", "'0'"), env={"TRITON_INTERPRET": "0"}),
    InitCase("triton_block_size_4", {"attention_backend": "triton", "block_size": 4}, ValueError,
             ("attention_backend='triton'", "block_size", "4")),
    InitCase("triton_block_size_24", {"attention_backend": "triton", "block_size": 24}, ValueError,
             ("attention_backend='triton'", "block_size", "24")),
    InitCase("reasoning_end_id_past_vocab", {"reasoning_config": ReasoningConfig((1,), (600,))}, ValueError,
             ("reasoning_end_token_ids", "600", "[0, 512)")),
    InitCase("reasoning_start_id_at_vocab_size", {"reasoning_config": ReasoningConfig((VOCAB,), (2,))}, ValueError,
             ("reasoning_start_token_ids", "512")),
    InitCase("reasoning_config_dict", {"reasoning_config": {"start": 1}}, TypeError, ("reasoning_config", "'start'")),
    InitCase("compilation_config_str", {"compilation_config": "FULL"}, TypeError, ("compilation_config", "'FULL'")),
    InitCase("compilation_config_unknown_key", {"compilation_config": {"mode": 1}}, ValueError,
             ("compilation_config", "'mode'")),
    InitCase("compilation_config_sizes_a_dict", {"compilation_config": {"cudagraph_capture_sizes": {1: 2, 4: 8}}},
             ValueError, ("cudagraph_capture_sizes", "{1: 2, 4: 8}")),
    InitCase("compilation_config_max_size_zero", {"compilation_config": {"max_cudagraph_capture_size": 0}},
             ValueError, ("max_cudagraph_capture_size", "0")),
    InitCase("enforce_eager_str", {"enforce_eager": "yes"}, TypeError, ("enforce_eager", "'yes'")),
    InitCase("logits_processors_a_str", {"logits_processors": "a.b:C"}, TypeError, ("logits_processors", "'a.b:C'")),
    InitCase("logits_processors_item_int", {"logits_processors": [5]}, TypeError, ("logits_processors[0]", "5")),
    InitCase("logits_processors_not_a_processor", {"logits_processors": [NotAProcessor]}, ValueError,
             ("logits processor 0", "NotAProcessor", "LogitsProcessor")),
    InitCase("logits_processors_malformed_name", {"logits_processors": ["no_colon"]}, ValueError,
             ("logits processor", "'no_colon'")),
    InitCase("logits_processors_missing_module", {"logits_processors": ["no_such_module_xyz:Proc"]}, RuntimeError,
             ("logits processor 0", "'no_such_module_xyz'")),
]  # fmt: skip


@pytest.mark.parametrize("case", INIT_CASES, ids=[c.id for c in INIT_CASES])
def test_bad_constructor_argument_is_refused_and_a_fresh_engine_works(case, folder, fresh_tokens, monkeypatch):
    with monkeypatch.context() as patch:
        for key, value in case.env.items():
            patch.setenv(key, value)
        _raises(case.exc, case.words, lambda: LLM(**{"model": folder, **ENGINE, **case.kwargs}))
    _assert_engine_as_new(LLM(folder, **ENGINE), fresh_tokens)


def test_max_num_batched_tokens_none_keeps_the_default(folder):
    llm = LLM(folder, max_num_batched_tokens=None, max_num_seqs=4, **ENGINE)
    assert llm.config.scheduler_config.max_num_batched_tokens == 8192


def test_cudagraph_mode_none_in_a_dict_is_the_documented_default(folder):
    llm = LLM(folder, compilation_config={"cudagraph_mode": None}, **ENGINE)
    assert llm.config.compilation_config.cudagraph_mode is None
    assert llm.engine.model_runner.cudagraph_mode.name == "NONE"  # the CPU's default


def test_a_huge_max_capture_size_is_capped_by_the_token_budget_at_once(folder, caplog):
    import time

    start = time.perf_counter()
    with caplog.at_level("WARNING"):
        llm = LLM(folder, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 10**9},
                  max_num_batched_tokens=64, **ENGINE)  # fmt: skip
    assert time.perf_counter() - start < 30, "building the capture sizes took too long"
    assert llm.engine.model_runner.dispatcher.capture_sizes[-1] <= 64
    warning = "\n".join(r.getMessage() for r in caplog.records if "max_cudagraph_capture_size" in r.getMessage())
    assert "1000000000" in warning and "64" in warning and len(warning) < 300, warning


@pytest.fixture
def oov_eos_folder(folder, tmp_path):
    copy = tmp_path / "oov_eos"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text('{"eos_token_id": [0, 600]}', encoding="utf-8")
    return str(copy)


def test_an_eos_id_outside_the_vocabulary_is_refused_at_start_up(oov_eos_folder):
    with pytest.raises(ValueError) as info:
        LLM(oov_eos_folder, **ENGINE)
    message = str(info.value)
    assert all(w in message for w in ("generation_config.json", "eos_token_id", "600", "[0, 512)")), message
    assert "stop_token_ids" not in message
