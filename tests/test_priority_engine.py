"""Priority scheduling through the engine: ``LLM(scheduling_policy="priority")``,
``generate(..., priority=[...])``, ``LLMEngine.add_request(priority=)``, ``AsyncLLM.generate``,
``--scheduling-policy`` and the OpenAI server's ``priority`` field, on a tiny random Qwen3."""

import argparse
import asyncio

import pytest

from serve_fixtures import require_serve_extra, running_server, slow_steps
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.engine_args import EngineArgs

PROMPTS = [[(11 * i + j) % 300 + 5 for j in range(6 + 5 * i)] for i in range(6)]


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_llm(tiny_model_dirs, **kw) -> LLM:
    return LLM(str(tiny_model_dirs["qwen3"]), **{"device": "cpu", "max_model_len": 48, "block_size": 4, **kw})


def test_generate_serves_lower_priority_values_first(tiny_model_dirs):
    """One request runs at a time: the first tokens come in priority order, not prompt order;
    outputs still come back in prompt order."""
    llm = make_llm(tiny_model_dirs, scheduling_policy="priority", max_num_seqs=1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    outs = llm.generate(prompts, greedy(3), priority=[7, -2, 3, 0], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS[:4]
    first_token = sorted(range(4), key=lambda i: outs[i].metrics.first_token_time)
    assert first_token == [1, 3, 2, 0]


def test_priority_under_kv_pressure_gives_the_tokens_of_a_roomy_engine(tiny_model_dirs, monkeypatch):
    """Low-priority requests start first, one a step, urgent ones arrive next, and the pool is
    small: the victims are low-priority requests already scheduled in the step, whose tokens
    and freshly cached blocks are taken back (scheduler NOTE 7). Greedy tokens equal a roomy
    FCFS engine's, sync and async, and every block comes back."""
    expected = make_llm(tiny_model_dirs).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(16), use_tqdm=False)
    for async_scheduling in (False, True):
        llm = make_llm(tiny_model_dirs, scheduling_policy="priority", num_gpu_blocks_override=16, max_num_seqs=6,
                       enable_prefix_caching=True, async_scheduling=async_scheduling)  # fmt: skip
        engine = llm.engine
        kv = engine.scheduler.kv_cache_manager
        dropped = []
        uncache = kv.uncache_unscheduled
        monkeypatch.setattr(kv, "uncache_unscheduled", lambda request: dropped.append(request.request_id) or uncache(request))
        finished, step = {}, 0
        while step < 4 or engine.has_unfinished_requests():
            if step < 3:  # one a step, so the first admitted, the first victim, runs first in every step
                engine.add_request(str(step), PROMPTS[step], greedy(16), priority=7 - step)
            if step == 3:
                for i in (3, 4, 5):
                    engine.add_request(str(i), PROMPTS[i], greedy(16), priority=i - 4)
            finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
            engine.check_invariants()
            step += 1
        assert [finished[str(i)] for i in range(6)] == [o.outputs[0].token_ids for o in expected], async_scheduling
        assert engine.scheduler.num_preemptions > 0 and dropped, "the victims were scheduled earlier in their step"
        assert set(dropped) <= {"0", "1", "2"}  # only low-priority requests were victims
        assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks and kv.uncommitted_blocks == []


def test_bad_priorities_are_refused_before_anything_is_queued(tiny_model_dirs):
    fcfs = make_llm(tiny_model_dirs)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match=r"prompt 1: priority=4 needs scheduling_policy='priority' \(the engine's is 'fcfs'\)"):
        fcfs.generate(prompts, greedy(), priority=[0, 4], use_tqdm=False)
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        fcfs.engine.add_request("x", PROMPTS[0], greedy(), priority=-1)
    assert not fcfs.engine.has_unfinished_requests()
    assert fcfs.generate(prompts, greedy(2), priority=[0, 0], use_tqdm=False)[1].outputs[0].token_ids  # 0 passes
    llm = make_llm(tiny_model_dirs, scheduling_policy="priority")
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate(prompts, greedy(), priority=[1], use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompt 0: priority must be an int, got 1\.5"):
        llm.generate(prompts, greedy(), priority=[1.5, 0], use_tqdm=False)
    with pytest.raises(TypeError, match="priority must be a list of ints"):
        llm.generate(prompts, greedy(), priority=3, use_tqdm=False)
    with pytest.raises(TypeError, match="priority must be an int, got True"):
        llm.engine.add_request("y", PROMPTS[0], greedy(), priority=True)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy must be one of \\('fcfs', 'priority'\\), got 'sjf'"):
        make_llm(tiny_model_dirs, scheduling_policy="sjf")


def test_the_command_line_flag_reaches_the_scheduler_config():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = _with_model(parser.parse_args(["--scheduling-policy", "priority"]))
    assert EngineArgs.from_cli_args(args).scheduling_policy == "priority"
    assert EngineArgs.from_cli_args(_with_model(parser.parse_args([]))).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])


def _with_model(args):
    args.model = "unused"
    return args


def test_async_llm_takes_each_requests_priority(tiny_model_dirs, monkeypatch):
    """`first` holds the one running slot for 20 steps of 10 ms or more; `urgent` (-1) and `later`
    (3) arrive meanwhile, `later` first: `urgent` runs before it."""
    llm = make_llm(tiny_model_dirs, scheduling_policy="priority", max_num_seqs=1)
    slow_steps(monkeypatch, llm, 0.01)
    async_llm = AsyncLLM(llm.engine)
    order = []

    async def run(rid, prompt, max_tokens, priority):
        async for out in async_llm.generate({"prompt_token_ids": prompt}, greedy(max_tokens), rid, priority=priority):
            if out.finished:
                order.append(rid)

    async def main():
        first = asyncio.create_task(run("first", PROMPTS[0], 20, 0))
        while not llm.engine.scheduler.running:
            await asyncio.sleep(0.005)
        later = asyncio.create_task(run("later", PROMPTS[1], 2, 3))
        await asyncio.sleep(0.05)
        urgent = asyncio.create_task(run("urgent", PROMPTS[2], 2, -1))
        try:
            await asyncio.gather(first, later, urgent)
        finally:
            await async_llm.shutdown()

    asyncio.run(main())
    assert order == ["first", "urgent", "later"]


def test_the_server_honours_priority_and_refuses_it_under_fcfs(tiny_model_dirs):
    require_serve_extra()
    import openai

    folder = str(tiny_model_dirs["qwen3"])
    offline = LLM(folder, device="cpu", max_model_len=96)
    want = offline.generate("def f", greedy(5), use_tqdm=False)[0].outputs[0].text
    for policy in ("priority", "fcfs"):
        llm = LLM(folder, device="cpu", max_model_len=96, scheduling_policy=policy)
        with running_server(llm, "tiny") as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            body = dict(model="tiny", prompt="def f", max_tokens=5, temperature=0, extra_body={"ignore_eos": True, "priority": 2})
            if policy == "priority":
                assert client.completions.create(**body).choices[0].text == want
                continue
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(**body)
            error = info.value.response.json()["error"]
            assert error["param"] == "priority" and "needs scheduling_policy='priority'" in error["message"], error
            assert client.completions.create(**{**body, "extra_body": {"ignore_eos": True}}).choices[0].text == want
