"""A request that leaves itself no token to sample (issue 36 item 4): refused up front when
that can be known from its parameters, else ended with ``finish_reason="error"`` in the
step where its row has no token; never a token it banned (the all ``-inf`` row used to
sample index 0, or 1 under speculation).

In the tiny test model's tokenizer ``"x"`` is token 90 and ``"xx"`` is ``[90, 90]``; EOS is 0."""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams

X = 90  # "x"
SPEC = {"num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def make_llm(folder, **kw) -> LLM:
    return LLM(str(folder), device="cpu", max_model_len=64, block_size=4, **kw)


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


def test_the_fixture_tokenizer_spells_x_as_assumed(folder):
    tokenizer = make_llm(folder).tokenizer
    assert tokenizer.encode("x", add_special_tokens=False) == [X]
    assert tokenizer.encode("xx", add_special_tokens=False) == [X, X]
    assert tokenizer.eos_token_id == 0


@pytest.mark.parametrize(
    "params, named",
    [
        (dict(allowed_token_ids=[0], min_tokens=2), "min_tokens"),  # only EOS, which min_tokens masks
        (dict(allowed_token_ids=[7, 8], stop_token_ids=[7, 8], min_tokens=1), "stop_token_ids"),
        (dict(allowed_token_ids=[X], bad_words=["x"]), "bad_words"),  # the only allowed id is banned outright
    ],
    ids=["eos-under-min-tokens", "stop-ids-under-min-tokens", "one-token-bad-word"],
)
def test_a_request_that_allows_no_token_is_refused_before_anything_runs(folder, params, named):
    llm = make_llm(folder)
    with pytest.raises(ValueError, match=rf"allowed_token_ids.*{named}|{named}.*allowed_token_ids"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4, **params), use_tqdm=False)
    kv = llm.engine.scheduler.kv_cache_manager
    assert not llm.engine.has_unfinished_requests() and kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


def test_a_denormal_repetition_penalty_is_refused():
    """1e-45 divides every positive logit into inf, then softmax makes NaN: token 0 every step."""
    with pytest.raises(ValueError, match=r"repetition_penalty.*1e-45"):
        SamplingParams(temperature=1.0, repetition_penalty=1e-45)
    assert SamplingParams(repetition_penalty=1e-3).repetition_penalty == 1e-3


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculation"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "random"])
def test_a_row_left_with_no_token_ends_the_request_with_an_error_not_a_banned_token(folder, speculative, temperature):
    """Allowed ``[x]`` with the bad word ``"xx"``: the first token is x, after which x is
    banned too: the second step has no token. The request ends there, with its one token
    and ``finish_reason="error"``; the request beside it is untouched."""
    llm = make_llm(folder, speculative_config=SPEC if speculative else None)
    if speculative:
        llm.engine.proposer.min_batch_tokens = 0
    stuck = SamplingParams(temperature=temperature, max_tokens=6, allowed_token_ids=[X], bad_words=["xx"], seed=3)
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [X, X, 5, X, X]}, {"prompt_token_ids": [5, 6, 7, 5, 6, 7]}]
    alone = make_llm(folder).generate(prompts[1], free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(prompts, [stuck, free], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [X]
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == alone and outs[1].outputs[0].finish_reason == "length"
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks
    llm.engine.check_invariants()
