"""``AsyncLLM``: concurrent ``generate`` calls give the offline engine's outputs, a consumer
that stops early aborts its request and frees its blocks, and the waiting bound holds."""

from __future__ import annotations

import asyncio

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM, EngineDeadError, TooManyWaitingRequestsError
from tinyvllm.sampling_params import RequestOutputKind

ENGINE = dict(device="cpu", max_model_len=96, block_size=4)
PROMPTS = [f"def f{i}(x):\n    return x" + " + 1" * i for i in range(6)]


def greedy(max_tokens=8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def folder(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


@pytest.fixture(scope="module")
def expected(folder):
    llm = LLM(folder, **ENGINE)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


def used_blocks(llm: LLM) -> int:
    return sum(b.ref_cnt > 0 for b in llm.engine.scheduler.kv_cache_manager.block_pool.blocks)


async def collect(engine: AsyncLLM, prompt, params, request_id) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_an_async_llm_built_from_engine_args_matches_the_offline_engine_and_imports_no_llm(folder, expected):
    """``AsyncLLM`` stands on the engine and its processors (``LLMEngine.from_engine_args``), not on ``LLM``."""
    import ast
    from pathlib import Path

    from tinyvllm.engine import async_llm
    from tinyvllm.engine.engine_args import EngineArgs

    imported = {node.module for node in ast.walk(ast.parse(Path(async_llm.__file__).read_text())) if isinstance(node, ast.ImportFrom)}
    assert "tinyvllm.engine.llm" not in imported and "tinyvllm" not in imported

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(folder, **ENGINE), max_waiting_requests=8)
        results = await asyncio.gather(*[collect(engine, p, greedy(), f"r{i}") for i, p in enumerate(PROMPTS)])
        await engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    assert [outs[-1].outputs[0].text for outs in results] == expected
    assert engine.max_waiting_requests == 8 and engine.max_model_len == 96


def test_concurrent_generates_match_the_offline_engine(folder, expected):
    async def main():
        engine = AsyncLLM(LLM(folder, **ENGINE).engine)
        kinds = [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE] * 2
        runs = [collect(engine, p, greedy(output_kind=k), f"r{i}") for i, (p, k) in enumerate(zip(PROMPTS, kinds))]
        results = await asyncio.gather(*runs)
        await engine.shutdown()
        return kinds, results

    kinds, results = asyncio.run(main())
    for kind, outs, text in zip(kinds, results, expected):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        if kind == RequestOutputKind.DELTA:
            assert "".join(o.outputs[0].text for o in outs) == text
        else:
            assert outs[-1].outputs[0].text == text
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1


def test_consumer_that_stops_early_aborts_and_frees_blocks(folder):
    async def main():
        llm = LLM(folder, **ENGINE)
        engine = AsyncLLM(llm.engine)
        stream = engine.generate(PROMPTS[0], greedy(max_tokens=40, output_kind=RequestOutputKind.DELTA), "early")
        first = await stream.__anext__()
        held_while_running = used_blocks(llm)
        await stream.aclose()  # what a closed HTTP stream does
        for _ in range(100):  # the abort runs in the engine thread, between two steps
            if engine.stats.num_running_reqs == 0 and used_blocks(llm) == 0:
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return first, held_while_running, engine.stats, used_blocks(llm)

    first, held_while_running, stats, held_after = asyncio.run(main())
    assert not first.finished and held_while_running > 0
    assert (stats.num_running_reqs, stats.num_waiting_reqs, held_after) == (0, 0, 0)
    assert stats.kv_cache_usage == 0.0


def test_cancelled_task_aborts_its_request(folder):
    async def main():
        llm = LLM(folder, **ENGINE)
        engine = AsyncLLM(llm.engine)
        task = asyncio.create_task(collect(engine, PROMPTS[1], greedy(max_tokens=60), "cancel-me"))
        while engine.stats.num_running_reqs == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if used_blocks(llm) == 0:
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return used_blocks(llm), llm.engine.has_unfinished_requests()

    assert asyncio.run(main()) == (0, False)


def test_explicit_abort_ends_the_stream(folder):
    async def main():
        llm = LLM(folder, **ENGINE)
        engine = AsyncLLM(llm.engine)
        stream = engine.generate(PROMPTS[2], greedy(max_tokens=60, output_kind=RequestOutputKind.DELTA), "a1")
        await stream.__anext__()
        await engine.abort("a1")
        blocks = used_blocks(llm)
        await stream.aclose()
        await engine.shutdown()
        return blocks

    assert asyncio.run(main()) == 0


def test_waiting_bound_refuses_with_a_dedicated_error(folder):
    async def main():
        llm = LLM(folder, max_num_seqs=1, **ENGINE)  # one running; the rest wait
        engine = AsyncLLM(llm.engine, max_waiting_requests=2)
        params = greedy(max_tokens=30, output_kind=RequestOutputKind.DELTA)
        streams = [engine.generate(PROMPTS[i], params, f"w{i}") for i in range(3)]
        await streams[0].__anext__()  # the first request runs (a generator adds its request when first iterated)
        pending = [asyncio.create_task(s.__anext__()) for s in streams[1:]]
        while engine.stats.num_waiting_reqs < 2:
            await asyncio.sleep(0.005)
        with pytest.raises(TooManyWaitingRequestsError, match="2 requests are waiting"):
            await collect(engine, PROMPTS[3], params, "w3")
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        for _ in range(200):
            if used_blocks(llm) == 0 and not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return used_blocks(llm), llm.engine.has_unfinished_requests()

    assert asyncio.run(main()) == (0, False)


def test_bad_request_raises_from_generate_and_queues_nothing(folder):
    async def main():
        llm = LLM(folder, **ENGINE)
        engine = AsyncLLM(llm.engine)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, PROMPTS[0], greedy(logit_bias={10_000: 1.0}), "bad")
        with pytest.raises(ValueError, match="more than max_model_len"):
            await collect(engine, "x " * 200, greedy(), "long")
        ok = await collect(engine, PROMPTS[0], greedy(), "good")  # the engine serves on
        await engine.shutdown()
        return ok, llm.engine.has_unfinished_requests()

    ok, unfinished = asyncio.run(main())
    assert ok[-1].finished and not unfinished


def test_duplicate_request_id_is_refused(folder):
    async def main():
        engine = AsyncLLM(LLM(folder, **ENGINE).engine)
        stream = engine.generate(PROMPTS[0], greedy(max_tokens=30, output_kind=RequestOutputKind.DELTA), "dup")
        await stream.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, PROMPTS[1], greedy(), "dup")
        await stream.aclose()
        await engine.shutdown()

    asyncio.run(main())


def test_call_in_engine_thread_runs_between_steps_and_refuses_the_engine_thread_itself(folder):
    """A caller outside the event loop (a trace, a notebook) runs a function in the engine's
    thread and gets its value or its exception; from the engine's thread it would wait for
    itself, so it is refused there, naming the function."""
    import threading

    async_llm = AsyncLLM(LLM(folder, **ENGINE).engine)
    try:
        name = async_llm.call_in_engine_thread(lambda: threading.current_thread().name)
        assert name.startswith("tinyvllm-engine") and name != threading.current_thread().name
        assert async_llm.call_in_engine_thread(len, async_llm.engine.unfinished_request_ids()) == 0
        with pytest.raises(ZeroDivisionError):
            async_llm.call_in_engine_thread(lambda: 1 / 0)
        with pytest.raises(RuntimeError, match=r"call_in_engine_thread\(<built-in function len>\) from the engine's own thread"):
            async_llm.call_in_engine_thread(lambda: async_llm.call_in_engine_thread(len, ()))
    finally:
        asyncio.run(async_llm.shutdown())


# -- issue 23: every consumer ends, ids can be used again, a new event loop works --------

TIMEOUT = 60  # seconds: a consumer left waiting is a failure, not a stuck test run


def test_abort_ends_the_consumer_with_a_final_abort_output(folder):
    async def main():
        llm = LLM(folder, **ENGINE)
        engine = AsyncLLM(llm.engine)
        stream = engine.generate(PROMPTS[2], greedy(max_tokens=60, output_kind=RequestOutputKind.DELTA), "a1")
        first = await stream.__anext__()
        await engine.abort("a1")
        rest = await asyncio.wait_for(_drain(stream), TIMEOUT)
        await engine.shutdown()
        return first, rest, used_blocks(llm)

    first, rest, blocks = asyncio.run(main())
    assert not first.finished and blocks == 0
    assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert all(not o.finished for o in rest[:-1])


async def _drain(stream) -> list:
    return [out async for out in stream]


def test_shutdown_ends_live_consumers_with_engine_dead_error(folder):
    async def main():
        llm = LLM(folder, **ENGINE)
        engine = AsyncLLM(llm.engine)
        stream = engine.generate(PROMPTS[0], greedy(max_tokens=60, output_kind=RequestOutputKind.DELTA), "s1")
        await stream.__anext__()
        waiting = asyncio.create_task(_drain(stream))
        await asyncio.sleep(0)
        await asyncio.wait_for(engine.shutdown(), TIMEOUT)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(waiting, TIMEOUT)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(engine, PROMPTS[1], greedy(), "s2"), TIMEOUT)
        with pytest.raises(EngineDeadError):
            await engine.abort("s1")
        return llm

    llm = asyncio.run(main())
    # the engine is left clean: the shut-down front aborted what it had queued
    assert not llm.engine.has_unfinished_requests() and used_blocks(llm) == 0
    assert llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].finished  # the LLM serves on


def test_shutdown_stops_the_engine_only_when_from_engine_args_built_it(folder):
    """The test above: an engine handed in serves on. One that ``from_engine_args`` built is the
    front's own, so ``shutdown`` shuts its executor down too (with tensor parallelism, its
    worker processes end there)."""
    from tinyvllm.engine.engine_args import EngineArgs

    owned = AsyncLLM.from_engine_args(EngineArgs(model=folder, **ENGINE))

    async def main():
        outputs = await asyncio.wait_for(collect(owned, PROMPTS[0], greedy(), "o1"), TIMEOUT)
        await asyncio.wait_for(owned.shutdown(), TIMEOUT)
        return outputs

    assert asyncio.run(main())
    assert owned.engine.model_executor.is_closed
    with pytest.raises(RuntimeError, match="shut down"):
        owned.engine.step()


def test_a_cancelled_consumer_after_shutdown_raises_nothing_new(folder):
    async def main():
        engine = AsyncLLM(LLM(folder, **ENGINE).engine)
        task = asyncio.create_task(collect(engine, PROMPTS[1], greedy(max_tokens=60), "c1"))
        while engine.stats.num_running_reqs == 0:
            await asyncio.sleep(0.005)
        await engine.shutdown()
        task.cancel()
        return (await asyncio.gather(task, return_exceptions=True))[0]

    result = asyncio.run(main())
    assert isinstance(result, (EngineDeadError, asyncio.CancelledError)), repr(result)


def test_the_same_async_llm_serves_a_second_event_loop(folder, expected):
    llm = LLM(folder, **ENGINE)
    engine = AsyncLLM(llm.engine)
    first = asyncio.run(asyncio.wait_for(collect(engine, PROMPTS[0], greedy(), "loop1"), TIMEOUT))
    second = asyncio.run(asyncio.wait_for(collect(engine, PROMPTS[1], greedy(), "loop2"), TIMEOUT))
    asyncio.run(engine.shutdown())
    assert (first[-1].outputs[0].text, second[-1].outputs[0].text) == (expected[0], expected[1])


def test_a_request_left_by_a_dead_loop_is_aborted_when_a_new_loop_starts(folder, expected):
    llm = LLM(folder, **ENGINE)
    engine = AsyncLLM(llm.engine)
    loop = asyncio.new_event_loop()
    stream = engine.generate(PROMPTS[0], greedy(max_tokens=60, output_kind=RequestOutputKind.DELTA), "orphan")
    loop.run_until_complete(stream.__anext__())
    loop.close()  # closed without finishing the stream: nobody will ever read "orphan"
    out = asyncio.run(asyncio.wait_for(collect(engine, PROMPTS[1], greedy(), "next"), TIMEOUT))
    asyncio.run(engine.shutdown())
    assert out[-1].outputs[0].text == expected[1]
    assert not llm.engine.has_unfinished_requests() and used_blocks(llm) == 0


def test_an_id_used_again_right_after_its_consumer_closed_gets_only_its_own_outputs(folder, expected):
    async def main():
        llm = LLM(folder, **ENGINE)
        engine = AsyncLLM(llm.engine)
        results = []
        for round_ in range(5):  # the old request's step is often in flight when the id comes back
            stream = engine.generate(
                PROMPTS[2], greedy(max_tokens=60, output_kind=RequestOutputKind.DELTA), "same"
            )
            await stream.__anext__()
            await stream.__anext__()
            await stream.aclose()
            outs = await asyncio.wait_for(
                collect(engine, PROMPTS[3], greedy(output_kind=RequestOutputKind.DELTA), "same"), TIMEOUT
            )
            results.append("".join(o.outputs[0].text for o in outs))
        await engine.shutdown()
        return results, used_blocks(llm)

    results, blocks = asyncio.run(main())
    assert results == [expected[3]] * 5 and blocks == 0


def test_a_failed_step_whose_undo_raises_ends_every_consumer_of_the_step(folder, expected):
    from test_engine_failures import Boom, StubbornProcessor

    async def main():
        llm = LLM(folder, **ENGINE)
        llm.engine.model_runner.input_batch.logitsprocs.non_argmax_invariant.insert(0, StubbornProcessor(first=3))
        engine = AsyncLLM(llm.engine)
        runs = [collect(engine, PROMPTS[i], greedy(max_tokens=20), f"f{i}") for i in range(2)]
        results = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), TIMEOUT)
        after = await asyncio.wait_for(collect(engine, PROMPTS[4], greedy(), "after"), TIMEOUT)
        await engine.shutdown()
        return results, after, llm

    results, after, llm = asyncio.run(main())
    assert all(isinstance(r, Boom) and "injected fault #3" in str(r) for r in results), results
    assert after[-1].outputs[0].text == expected[4]
    assert not llm.engine.has_unfinished_requests() and used_blocks(llm) == 0


def test_encode_yields_the_offline_embedding_and_a_consumer_that_leaves_aborts(folder):
    """``AsyncLLM.encode`` (vLLM's name): one finished ``PoolingRequestOutput`` equal to
    ``LLM.encode``'s; params of the wrong kind are refused before anything is queued; closing
    the iterator before its output aborts the request."""
    from tinyvllm.outputs import PoolingRequestOutput
    from tinyvllm.pooling_params import PoolingParams

    offline = LLM(folder, runner="pooling", **ENGINE)
    want = [o.outputs.data for o in offline.encode(PROMPTS[:3], use_tqdm=False)]

    async def main():
        async_llm = AsyncLLM(LLM(folder, runner="pooling", **ENGINE).engine)

        async def one(i):
            return [out async for out in async_llm.encode(PROMPTS[i], PoolingParams(), f"e{i}")]

        results = await asyncio.gather(*(one(i) for i in range(3)))
        with pytest.raises(TypeError, match="pooling_params must be PoolingParams"):
            await anext(async_llm.encode(PROMPTS[0], greedy(), "bad"))
        stream = async_llm.encode(PROMPTS[0], PoolingParams(), "left")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the request is being added
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        await async_llm.run_in_engine_thread(lambda: None)  # after the abort
        left = async_llm.engine.has_unfinished_requests()
        await async_llm.shutdown()
        return results, left

    results, left = asyncio.run(main())
    for outs, data in zip(results, want):
        assert len(outs) == 1 and isinstance(outs[0], PoolingRequestOutput) and outs[0].finished
        assert (outs[0].outputs.data - data).abs().max() < 1e-5
    assert not left


def test_encode_on_a_generating_engine_is_a_value_error(folder):
    from tinyvllm.pooling_params import PoolingParams

    async def main():
        async_llm = AsyncLLM(LLM(folder, **ENGINE).engine)
        with pytest.raises(ValueError, match="PoolingParams need a pooling engine"):
            await anext(async_llm.encode(PROMPTS[0], PoolingParams(), "g"))
        left = async_llm.engine.has_unfinished_requests()
        await async_llm.shutdown()
        return left

    assert asyncio.run(main()) is False
