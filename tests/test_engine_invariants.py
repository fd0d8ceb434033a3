"""``LLMEngine.check_invariants()`` and ``ModelRunner.check_invariants()``: the scheduler and
the runner keep two copies of each request (its blocks, its outputs), as vLLM's scheduler
and worker do; after every step the copies must agree. The tests run a workload with
chunked prefill, prefix hits, preemption, a seeded request and an abort on the tiny Qwen3,
check at every step, and then corrupt one copy at a time to see each check fire."""

import pytest

from tinyvllm import LLM, SamplingParams

PREFIX = [(37 * i + 11) % 500 + 5 for i in range(12)]  # three blocks of 4
PROMPTS = [PREFIX + [300, 301, 302], PREFIX + [7, 8, 9, 10, 11], [401, 402, 403, 404, 405], PREFIX[:8] + [77]]


def _engine(tiny_model_dirs, **kw):
    llm = LLM(
        str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=32, block_size=4,
        max_num_batched_tokens=12, num_gpu_blocks_override=10, max_num_seqs=4, **kw,
    )  # fmt: skip
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.8 if i == 1 else 0.0, seed=7, max_tokens=10, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    return engine


def _step_until_decoding(engine):
    """Step until a request sits in the persistent batch with outputs, and return its id."""
    for _ in range(40):
        engine.step()
        engine.check_invariants()
        runner, running = engine.model_runner, {r.request_id for r in engine.scheduler.running}
        for req_id in runner.input_batch.req_ids:
            if req_id in running and runner.requests[req_id].output_token_ids:
                return req_id
    raise AssertionError("no request reached decode")


def test_engine_invariants_hold_at_every_step_of_a_busy_workload(tiny_model_dirs):
    engine = _engine(tiny_model_dirs)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        engine.check_invariants()
        if steps == 3:
            engine.abort_request("2")
            engine.check_invariants()  # between steps: the runner still holds "2" until the next step
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0, "the small pool did not force a preemption"
    assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0, "no prompt hit the prefix cache"
    engine.step()  # reports the last finished ids to the runner
    engine.check_invariants()
    assert not engine.model_runner.requests and not engine.model_runner.input_batch.req_id_to_index


def test_engine_invariants_catch_runner_blocks_that_differ_from_the_scheduler(tiny_model_dirs):
    engine = _engine(tiny_model_dirs)
    req_id = _step_until_decoding(engine)
    state = engine.model_runner.requests[req_id]
    state.block_ids[-1] += 1
    with pytest.raises(AssertionError, match=f"request '{req_id}'.*block"):
        engine.check_invariants()


def test_engine_invariants_catch_outputs_that_differ_from_the_scheduler(tiny_model_dirs):
    engine = _engine(tiny_model_dirs)
    req_id = _step_until_decoding(engine)
    engine.scheduler.requests[req_id].output_token_ids.append(3)
    with pytest.raises(AssertionError, match=f"request '{req_id}'.*output"):
        engine.check_invariants()


def test_runner_invariants_catch_a_block_table_row_that_differs_from_the_state(tiny_model_dirs):
    engine = _engine(tiny_model_dirs)
    req_id = _step_until_decoding(engine)
    runner = engine.model_runner
    row = runner.input_batch.req_id_to_index[req_id]
    runner.input_batch.block_table.append_row(row, [0])
    with pytest.raises(AssertionError, match=f"row {row}.*'{req_id}'.*block table"):
        runner.check_invariants()


def test_runner_invariants_catch_a_row_without_a_request_state(tiny_model_dirs):
    engine = _engine(tiny_model_dirs)
    req_id = _step_until_decoding(engine)
    del engine.model_runner.requests[req_id]
    with pytest.raises(AssertionError, match=f"'{req_id}'.*no state"):
        engine.model_runner.check_invariants()


def test_runner_invariants_catch_a_batch_row_that_reads_another_output_list(tiny_model_dirs):
    engine = _engine(tiny_model_dirs)
    req_id = _step_until_decoding(engine)
    state = engine.model_runner.requests[req_id]
    state.output_token_ids = list(state.output_token_ids)  # equal tokens, but no longer the batch's live list
    with pytest.raises(AssertionError, match=f"'{req_id}'.*live output list"):
        engine.model_runner.check_invariants()


def test_engine_invariants_catch_a_request_tracked_but_not_in_the_scheduler(tiny_model_dirs):
    engine = _engine(tiny_model_dirs)
    _step_until_decoding(engine)
    engine.scheduler.finish_requests(["3"], _finished_status())  # behind the engine's back
    with pytest.raises(AssertionError, match="'3'"):
        engine.check_invariants()


def _finished_status():
    from tinyvllm.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED
