"""Hypothesis over the real engine (tiny Qwen3, CPU): faults at random steps, and seeded
sampling that depends on nothing but the request.

1. Fault injection: a random workload of prompts that share prefixes runs while the
   forward, the sampler or a logits processor raises at a random step. After each fault the
   engine passes ``check_invariants()``, leaks no block, and every request it serves next,
   including ones sharing the failed requests' prefixes, gets the fresh-engine output.
2. Seeded sampling: a seeded request's tokens do not depend on the other requests in the
   batch, on the pool size (preemption), on the token budget (chunking, skipped decodes) or
   on prefix-cache hits.
"""

import functools
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_engine_failures import Fault, assert_clean, inject  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
STEMS = [[(11 * i + 3) % 300 + 10 for i in range(12)], [(7 * i + 1) % 300 + 10 for i in range(8)]]


@functools.cache
def model_folder() -> str:
    import tempfile

    return str(build_tiny_model(Path(tempfile.mkdtemp()) / "qwen3", "qwen3"))


@functools.cache
def fresh_engine() -> LLM:
    return LLM(model_folder(), device="cpu", max_model_len=64, block_size=4, enable_prefix_caching=False)


@functools.cache
def fresh(prompt: tuple[int, ...], params: SamplingParams = GREEDY) -> list[int]:
    """The tokens a fresh engine gives ``prompt`` alone."""
    return fresh_engine().generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False)[0].outputs[0].token_ids


prompts = st.builds(
    lambda stem, cut, tail: tuple(STEMS[stem][:cut] + tail),
    st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(5, 400), min_size=1, max_size=6),
)  # fmt: skip


@settings(max_examples=15)
@given(
    rounds=st.lists(
        st.tuples(
            st.lists(prompts, min_size=1, max_size=4),  # one generate call
            st.sampled_from(["forward", "sampler", "apply", "update_state", None]),  # where it fails
            st.integers(1, 6),  # at which call of that place
        ),
        min_size=1, max_size=3,
    ),
    budget=st.sampled_from([8, 16, 64]),
    blocks=st.sampled_from([8, 40]),
)  # fmt: skip
def test_engine_survives_faults_at_random_steps(rounds, budget, blocks):
    llm = LLM(model_folder(), device="cpu", max_model_len=32, block_size=4, max_num_batched_tokens=budget,
              num_gpu_blocks_override=blocks, max_num_seqs=4)  # fmt: skip
    faults = {where: Fault(at=10**9) for where in ("forward", "sampler", "apply", "update_state")}
    for where, fault in faults.items():
        inject(llm, where, fault)
    for batch, where, at in rounds:
        if where is not None:
            faults[where].at, faults[where].calls = at, 0
        try:
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in batch], GREEDY, use_tqdm=False)
        except Exception as exc:
            assert "injected fault" in str(exc), f"not the injected fault: {exc!r}"
            assert_clean(llm)
        else:
            assert [o.outputs[0].token_ids for o in outs] == [fresh(p) for p in batch]
            assert_clean(llm)
        for fault in faults.values():
            fault.at = 10**9
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in rounds[0][0]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [fresh(p) for p in rounds[0][0]]


@settings(max_examples=20)
@given(
    target=prompts,
    seed=st.integers(0, 2**63 - 1),
    others=st.lists(st.tuples(prompts, st.booleans()), min_size=1, max_size=3),  # (prompt, seeded?)
    budget=st.sampled_from([5, 12, 64]),
    blocks=st.sampled_from([8, 9, 40]),  # 8 or 9 blocks of 4: preemption is likely
    caching=st.booleans(),
    warm_cache=st.booleans(),
)
def test_seeded_tokens_depend_only_on_the_request(target, seed, others, budget, blocks, caching, warm_cache):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=6, seed=seed, ignore_eos=True)
    alone = fresh(target, params)
    llm = LLM(model_folder(), device="cpu", max_model_len=32, block_size=4, max_num_batched_tokens=budget,
              num_gpu_blocks_override=blocks, max_num_seqs=4, enable_prefix_caching=caching)  # fmt: skip
    if warm_cache:  # the target's prefix is in the cache: a hit at admission
        llm.generate({"prompt_token_ids": list(target) + [7]}, GREEDY, use_tqdm=False)
    batch = [{"prompt_token_ids": list(p)} for p, _ in others] + [{"prompt_token_ids": list(target)}]
    other_params = [
        SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, seed=i if seeded else None)
        for i, (_, seeded) in enumerate(others)
    ]
    outs = llm.generate(batch, other_params + [params], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone, (
        f"preemptions {llm.engine.scheduler.num_preemptions}, cached {outs[-1].num_cached_tokens}"
    )


@pytest.mark.parametrize("blocks", [8])
def test_seeded_tokens_survive_a_forced_preemption(blocks):
    """The example behind the property: a pool this small must preempt, and the seeded
    request's stream continues where it left off instead of restarting."""
    target = tuple(STEMS[0] + [5])
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    llm = LLM(model_folder(), device="cpu", max_model_len=32, block_size=4, num_gpu_blocks_override=blocks,
              max_num_seqs=3)  # fmt: skip
    batch = [{"prompt_token_ids": list(STEMS[1]) + [9] * 8}, {"prompt_token_ids": list(target)}]
    outs = llm.generate(batch, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), params],
                        use_tqdm=False)  # fmt: skip
    assert llm.engine.scheduler.num_preemptions > 0
    assert outs[1].outputs[0].token_ids == fresh(target, params)


LOOPING = [[5, 6, 7, 8] * 3, [20, 21, 22] * 3]  # prompts the n-gram proposer drafts from at once
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


@functools.cache
def fresh_spec_engine() -> LLM:
    return LLM(model_folder(), device="cpu", max_model_len=40, block_size=4, speculative_config=SPEC)


@settings(max_examples=12)
@given(
    target=st.tuples(st.sampled_from(LOOPING), st.integers(0, 4)).map(lambda t: tuple(t[0][: len(t[0]) - t[1]])),
    seed=st.integers(-(2**63), 2**63 - 1),
    others=st.lists(st.tuples(st.sampled_from(LOOPING + STEMS), st.booleans()), min_size=1, max_size=3),
    budget=st.sampled_from([2, 5, 10, 64]),
    speculative=st.booleans(),
)
def test_seeded_tokens_are_the_same_alone_in_any_batch_and_with_or_without_drafts(target, seed, others, budget, speculative):
    """Issue: a seeded request's tokens are the same alone and in any batch, under any token
    budget (chunked prompts, drafts trimmed to what the budget leaves), with and without
    speculation's drafts on it and on the other requests (``sample/draw_keys.py``)."""
    params = SamplingParams(temperature=0.5, max_tokens=8, seed=seed, ignore_eos=True)
    alone = fresh_spec_engine().generate({"prompt_token_ids": list(target)}, params, use_tqdm=False)[0]
    llm = LLM(model_folder(), device="cpu", max_model_len=40, block_size=4, max_num_batched_tokens=budget,
              max_num_seqs=4, speculative_config=SPEC if speculative else None)  # fmt: skip
    batch = [{"prompt_token_ids": list(p)} for p, _ in others] + [{"prompt_token_ids": list(target)}]
    other_params = [
        SamplingParams(temperature=0.3, max_tokens=6, ignore_eos=True, seed=i if seeded else None)
        for i, (_, seeded) in enumerate(others)
    ]
    outs = llm.generate(batch, other_params + [params], use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
