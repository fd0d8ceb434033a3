"""A request id's life in the engine: refused while it is live, free again once its request
has finished or been aborted, and then exactly a fresh request.

The rule is vLLM's: its output processor refuses an id that is still running
(``ValueError``), and nothing stops a client from using an id again later. What makes reuse
safe is that every part of the engine forgets a finished id: the scheduler at once, the
runner's request states *and its persistent batch* when the next step reports the id as
finished, before that step's new requests arrive (``worker/model_runner.py``
``_update_states``).
"""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT_A = [(11 * i + 3) % 300 + 10 for i in range(9)]
PROMPT_B = [(7 * i + 1) % 300 + 10 for i in range(14)]


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


def make_llm(folder: str, **kw) -> LLM:
    return LLM(folder, device="cpu", max_model_len=64, block_size=4, enable_prefix_caching=False, **kw)


@pytest.fixture(scope="module")
def fresh(folder):
    """The greedy tokens a fresh engine gives a prompt alone."""
    llm = make_llm(folder)
    cache: dict[tuple, list[int]] = {}

    def answer(prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            cache[key] = list(out.outputs[0].token_ids)
        return cache[key]

    return answer


def run_to_end(engine, request_id: str) -> list[int]:
    """Step until ``request_id`` finishes; its token ids."""
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return list(out.outputs[0].token_ids)
        assert engine.has_unfinished_requests(), f"{request_id!r} never finished"


def test_an_id_used_again_after_its_request_finished_is_a_fresh_request(folder, fresh):
    engine = make_llm(folder).engine
    engine.add_request("x", PROMPT_A, GREEDY)
    assert run_to_end(engine, "x") == fresh(PROMPT_A)
    # No step has run since "x" finished: the runner still holds its row when "x" comes back.
    engine.add_request("x", PROMPT_B, GREEDY)
    assert run_to_end(engine, "x") == fresh(PROMPT_B)
    runner = engine.model_runner
    engine.step()  # tells the runner that the second "x" finished
    assert runner.input_batch.num_reqs == 0 and runner.requests == {}


def test_an_id_used_again_after_an_abort_is_a_fresh_request(folder, fresh):
    engine = make_llm(folder).engine
    sampled = SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=3, ignore_eos=True)
    engine.add_request("x", PROMPT_A, sampled)
    engine.step()
    engine.step()  # "x" runs, holds a row, blocks and a seeded generator
    engine.abort_request("x")
    engine.add_request("x", PROMPT_B, GREEDY)
    assert run_to_end(engine, "x") == fresh(PROMPT_B)


def test_an_id_used_again_runs_on_its_own_row_params_and_block_table(folder):
    engine = make_llm(folder).engine
    engine.add_request("x", PROMPT_A, GREEDY)
    run_to_end(engine, "x")
    params_b = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=3, seed=11, ignore_eos=True)
    engine.add_request("x", PROMPT_B, params_b)
    engine.step()
    runner = engine.model_runner
    row = runner.input_batch.req_id_to_index["x"]
    assert runner.input_batch.params[row] is params_b
    assert runner.input_batch.block_table.row(row) == runner.requests["x"].block_ids
    assert runner.requests["x"].block_ids == engine.scheduler.kv_cache_manager.get_block_ids("x")
    runner.input_batch.check_invariants()


def test_a_live_id_is_refused_and_nothing_changes(folder, fresh):
    engine = make_llm(folder).engine
    engine.add_request("x", PROMPT_A, GREEDY)
    engine.step()
    free = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    with pytest.raises(ValueError, match="'x'"):
        engine.add_request("x", PROMPT_B, GREEDY)
    assert engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    assert run_to_end(engine, "x") == fresh(PROMPT_A)


def test_abort_returns_each_live_requests_final_output(folder):
    engine = make_llm(folder).engine
    engine.add_request("a", PROMPT_A, GREEDY)
    engine.add_request("b", PROMPT_B, GREEDY)
    engine.step()
    engine.step()
    outs = engine.abort_request(["a", "unknown"])
    assert [o.request_id for o in outs] == ["a"]
    (out,) = outs
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 2  # the prefill's token and one decode's
    assert engine.unfinished_request_ids() == {"b"}
    assert engine.abort_request("a") == []  # already gone: nothing to report
