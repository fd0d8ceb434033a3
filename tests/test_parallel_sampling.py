"""``SamplingParams.n``: n completions of one prompt (``engine/parallel_sampling.py``): one
prefill shared through the prefix cache, children seeded from the parent's seed, outputs
ordered by index, one parent id for aborts, failures and ``AsyncLLM``."""

from __future__ import annotations

import asyncio

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.sampling_params import RequestOutputKind

PROMPT = [(13 * i + 7) % 400 + 20 for i in range(22)]  # 5 full blocks of 4, and 2 tokens


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


def make_llm(folder, **kw) -> LLM:
    return LLM(folder, device="cpu", max_model_len=64, block_size=4, **kw)


def sampled(n: int = 1, seed: int | None = 9, max_tokens: int = 6, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=20, max_tokens=max_tokens, ignore_eos=True, n=n, seed=seed, **kw)


def test_n_completions_are_the_seeded_children_in_index_order(folder):
    llm = make_llm(folder)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, sampled(n=3), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    alone = [llm.generate({"prompt_token_ids": PROMPT}, sampled(seed=9 + i), use_tqdm=False)[0] for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert [c.text for c in out.outputs] == [a.outputs[0].text for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # three draws, not one copied


def test_the_prompt_is_computed_once_and_shared_through_the_prefix_cache(folder):
    llm = make_llm(folder, max_num_seqs=8)
    stats = llm.engine.scheduler.kv_cache_manager
    computed = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        computed.append(sum(out.num_scheduled_tokens.values()))
        return out

    llm.engine.scheduler.schedule = recording
    [out] = llm.generate({"prompt_token_ids": PROMPT}, sampled(n=4), use_tqdm=False)
    # one prefill of 22 tokens; the three siblings hit its 5 full blocks and compute 2 each
    assert computed[0] == 22 + 3 * 2
    assert stats.prefix_cache_stats.hits == 3 * 20
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 6 for c in out.outputs)


def test_without_prefix_caching_each_child_computes_its_prompt(folder):
    llm = make_llm(folder, enable_prefix_caching=False)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, sampled(n=2), use_tqdm=False)
    assert len(out.outputs) == 2


def test_delta_and_cumulative_streams_of_n_children_join_to_the_final_outputs(folder):
    llm = make_llm(folder)
    [final] = llm.generate({"prompt_token_ids": PROMPT}, sampled(n=3), use_tqdm=False)
    engine = llm.engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request(kind.name, PROMPT, sampled(n=3, output_kind=kind))
    delta_text = {i: "" for i in range(3)}
    delta_ids = {i: [] for i in range(3)}
    cumulative, ends = None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ends[out.request_id] = out.finished
            if out.request_id == "DELTA":
                for c in out.outputs:
                    delta_text[c.index] += c.text
                    delta_ids[c.index] += c.token_ids
            else:
                cumulative = out
    assert ends == {"DELTA": True, "CUMULATIVE": True}
    assert [delta_text[i] for i in range(3)] == [c.text for c in final.outputs]
    assert [delta_ids[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert [c.token_ids for c in cumulative.outputs] == [c.token_ids for c in final.outputs]


def test_abort_of_the_parent_ends_every_child_and_frees_their_blocks(folder):
    llm = make_llm(folder)
    engine = llm.engine
    engine.add_request("p", PROMPT, sampled(n=3, max_tokens=30))
    engine.step()
    engine.step()
    assert engine.unfinished_request_ids() == {"p"}
    outs = engine.abort_request("p")
    assert [o.request_id for o in outs] == ["p"] and outs[0].finished
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 2 for c in outs[0].outputs)
    kv = engine.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests() and kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks
    engine.add_request("p", PROMPT, sampled(n=2))  # the id is free again
    assert engine.unfinished_request_ids() == {"p"}


def test_a_child_id_in_use_refuses_the_whole_request(folder):
    llm = make_llm(folder)
    engine = llm.engine
    engine.add_request("1_q", PROMPT, sampled())
    with pytest.raises(ValueError, match="'1_q'"):
        engine.add_request("q", PROMPT, sampled(n=3))
    assert engine.unfinished_request_ids() == {"1_q"}
    with pytest.raises(ValueError, match="in use|duplicate"):
        engine.add_request("1_q", PROMPT, sampled(n=2))
    assert engine.unfinished_request_ids() == {"1_q"}


@pytest.mark.parametrize("seed", [2**63 - 1, 2**63 - 2, -(2**63)])
def test_every_accepted_seed_works_with_n_children(folder, seed):
    """Child i's seed is the parent's + i (vLLM), wrapped into int64, so a seed near the top
    works: 2**63 - 1 + 1 is -2**63 (it was refused with a message about a child seed)."""
    llm = make_llm(folder)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, sampled(n=3, seed=seed), use_tqdm=False)
    wrapped = [(seed + i + 2**63) % 2**64 - 2**63 for i in range(3)]
    alone = [llm.generate({"prompt_token_ids": PROMPT}, sampled(seed=s), use_tqdm=False)[0] for s in wrapped]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]


def test_a_failed_step_ends_the_parent_with_all_its_children(folder):
    from test_engine_failures import Boom, Fault, inject

    llm = make_llm(folder, max_num_seqs=2)  # two children run, the third waits
    engine = llm.engine
    engine.add_request("p", PROMPT, sampled(n=3, max_tokens=20))
    engine.add_request("other", PROMPT[:9], sampled())
    engine.step()
    inject(llm, "sampler", Fault(at=1))
    with pytest.raises(Boom):
        engine.step()
    assert "p" not in engine.unfinished_request_ids()
    assert not any(rid.endswith("_p") for rid in engine.scheduler.requests)
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks


def test_async_llm_streams_n_completions_under_one_id(folder):
    async def main():
        llm = make_llm(folder)
        engine = AsyncLLM(llm.engine)
        outs = [o async for o in engine.generate({"prompt_token_ids": PROMPT},
                                                 sampled(n=2, output_kind=RequestOutputKind.DELTA), "par")]  # fmt: skip
        await engine.shutdown()
        return outs, llm

    outs, llm = asyncio.run(main())
    assert outs[-1].finished and all(o.request_id == "par" for o in outs)
    tokens = {0: [], 1: []}
    for o in outs:
        for c in o.outputs:
            tokens[c.index] += c.token_ids
    [final] = llm.generate({"prompt_token_ids": PROMPT}, sampled(n=2), use_tqdm=False)
    assert [tokens[0], tokens[1]] == [c.token_ids for c in final.outputs]
