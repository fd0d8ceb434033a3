"""``LLM`` options beyond sampling: ``cache_salt`` in a prompt dict, the reasoning config
read from the tokenizer (and the thinking budget it enables), and custom logits
processors passed as classes or as ``"module:QualName"`` strings."""

from __future__ import annotations

import importlib

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ReasoningConfig
from tinyvllm.core.prefix_hash import hash_request_tokens
from tinyvllm.engine.input_processor import reasoning_config_from_tokenizer
from tinyvllm.request import Request

ENGINE = dict(device="cpu", max_model_len=64, block_size=4)
IDS = [(11 * i + 7) % 500 + 5 for i in range(13)]  # 3 full blocks of 4 and one token
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


# -- cache_salt ---------------------------------------------------------------------------


def _cached(llm: LLM, prompt: dict) -> int:
    [out] = llm.generate(prompt, GREEDY, use_tqdm=False)
    return out.num_cached_tokens


def test_cache_salt_isolates_prompts_and_the_same_salt_shares(folder):
    llm = LLM(folder, **ENGINE)
    assert _cached(llm, {"prompt_token_ids": IDS, "cache_salt": "alice"}) == 0
    assert _cached(llm, {"prompt_token_ids": IDS, "cache_salt": "bob"}) == 0  # another salt: no block shared
    assert _cached(llm, {"prompt_token_ids": IDS}) == 0  # no salt is not any salt
    assert _cached(llm, {"prompt_token_ids": IDS, "cache_salt": "alice"}) == 12  # the same salt: every full block
    assert _cached(llm, {"prompt_token_ids": IDS}) == 12
    text = "def add(a, b):\n    return a + b\n" * 2
    assert _cached(llm, {"prompt": text, "cache_salt": "carol"}) == 0  # text prompts take a salt too
    assert _cached(llm, {"prompt": text, "cache_salt": "dave"}) == 0
    assert _cached(llm, {"prompt": text, "cache_salt": "carol"}) > 0


def test_cache_salt_at_block_level(folder):
    """Every block hash of a salted request differs from the other salt's, and the blocks
    the pool caches for the two salts are disjoint."""
    llm = LLM(folder, **ENGINE)
    llm.generate([{"prompt_token_ids": IDS, "cache_salt": s} for s in ("a", "b")], GREEDY, use_tqdm=False)
    kv = llm.engine.scheduler.kv_cache_manager
    hashes = {s: hash_request_tokens(kv.hash_fn, 4, Request(s, IDS, GREEDY, cache_salt=s)) for s in ("a", "b")}
    assert len(hashes["a"]) == len(hashes["b"]) == 3
    assert not set(hashes["a"]) & set(hashes["b"])
    blocks = {s: [kv.block_pool.get_cached_block(h) for h in hashes[s]] for s in hashes}
    assert all(b is not None for bs in blocks.values() for b in bs)
    assert not {b.block_id for b in blocks["a"]} & {b.block_id for b in blocks["b"]}
    same = hash_request_tokens(kv.hash_fn, 4, Request("a2", IDS, GREEDY, cache_salt="a"))
    assert same == hashes["a"]


def test_cache_salt_through_the_engine(folder):
    llm = LLM(folder, **ENGINE)
    llm.engine.add_request("x", IDS, GREEDY, cache_salt="s1")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.add_request("y", IDS, GREEDY, cache_salt="s2")
    llm.engine.add_request("z", IDS, GREEDY, cache_salt="s1")
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.engine.step()})
    assert outs["y"].num_cached_tokens == 0 and outs["z"].num_cached_tokens == 12
    assert outs["y"].outputs[0].token_ids == outs["z"].outputs[0].token_ids  # the salt changes no token


# -- the reasoning config ---------------------------------------------------------------------


class _StubTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


@pytest.mark.parametrize(
    "vocab, expected",
    [
        ({"<think>": 7, "</think>": 8, "a": 0}, ReasoningConfig((7,), (8,))),
        ({"<think>": 7, "a": 0}, None),  # no end token
        ({"</think>": 8}, None),  # no start token
        ({"<think>": 7, "</think>": 600}, None),  # a tokenizer token the model cannot produce
        ({}, None),
    ],
)
def test_reasoning_config_from_tokenizer(vocab, expected):
    assert reasoning_config_from_tokenizer(_StubTokenizer(vocab), 512) == expected


def test_llm_builds_the_reasoning_config_from_the_tokenizer(folder):
    llm = LLM(folder, **ENGINE)
    tok = llm.get_tokenizer()
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    assert tok.encode("<think></think>", add_special_tokens=False) == [start, end]  # single tokens
    assert llm.config.reasoning_config == ReasoningConfig((start,), (end,))
    assert llm.engine.reasoning_config == llm.config.reasoning_config
    given = ReasoningConfig((3,), (4, 5))
    assert LLM(folder, reasoning_config=given, **ENGINE).config.reasoning_config == given  # a given one wins


@pytest.mark.seed("001:13")
def test_thinking_budget_forces_the_end_token_with_the_tokenizer_config(folder):
    llm = LLM(folder, **ENGINE)
    (start,), (end,) = llm.config.reasoning_config.reasoning_start_token_ids, llm.config.reasoning_config.reasoning_end_token_ids
    prompt = {"prompt_token_ids": [5, 6, start]}  # the prompt opens a think section
    free, budgeted = llm.generate(
        [prompt, prompt],
        [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, thinking_token_budget=2)],
        use_tqdm=False,
    )  # fmt: skip
    free, budgeted = free.outputs[0].token_ids, budgeted.outputs[0].token_ids
    assert end not in free[:3], "the model closes the section by itself: the test would prove nothing"
    assert budgeted[:2] == free[:2] and budgeted[2] == end


# -- custom logits processors -------------------------------------------------------------------

PROCS_MODULE = "force_token_procs"  # tests/force_token_procs.py: Outer.ForceToken


@pytest.fixture(scope="module")
def procs_module():
    return importlib.import_module(PROCS_MODULE)


@pytest.mark.seed("001:11")
@pytest.mark.parametrize("how", ["class", "fqcn"])
def test_logits_processors_take_effect(folder, procs_module, how):
    spec = procs_module.Outer.ForceToken if how == "class" else f"{PROCS_MODULE}:Outer.ForceToken"
    llm = LLM(folder, logits_processors=[spec], **ENGINE)
    assert llm.logits_processors == (spec,)
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, extra_args={"force_token": 42})
    sampled = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1, extra_args={"force_token": 43})
    prompts = [{"prompt_token_ids": IDS}] * 3
    outs = llm.generate(prompts, [forced, GREEDY, sampled], use_tqdm=False)
    plain = LLM(folder, **ENGINE).generate(prompts[1], GREEDY, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == [42] * 4
    assert outs[1].outputs[0].token_ids == plain.outputs[0].token_ids  # a request without extra_args is untouched
    assert outs[2].outputs[0].token_ids == [43] * 4


def test_logits_processor_validate_params_refuses_before_anything_runs(folder, procs_module):
    llm = LLM(folder, logits_processors=[f"{PROCS_MODULE}:Outer.ForceToken"], **ENGINE)
    bad = SamplingParams(max_tokens=2, extra_args={"force_token": -1})
    with pytest.raises(ValueError, match=r"extra_args\['force_token'\] must be a token id >= 0, got -1"):
        llm.generate([{"prompt_token_ids": IDS}] * 2, [GREEDY, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


def test_max_tokens_none_generates_up_to_the_context(folder):
    llm = LLM(folder, device="cpu", max_model_len=40, block_size=4)
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": [5] * 10}, params, use_tqdm=False)
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (30, "length")
