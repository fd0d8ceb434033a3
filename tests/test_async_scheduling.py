"""Async scheduling (``async_scheduling=True``, vLLM's flag): the engine schedules step N+1 while
step N runs, with placeholders for the tokens still on the device. Its outputs equal the
synchronous engine's token for token (greedy, seeded, every sampling feature), under chunked
prefill, preemption, prefix hits, aborts, emulated CUDA graphs and a failed step; the device
is waited for once a step, after the next step was scheduled and its forward launched."""

from __future__ import annotations

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.core.async_scheduler import AsyncScheduler
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.request import Request

from engine_compare import assert_same_tokens_and_logprobs
from test_device_syncs import ASKING_EVERYTHING, PROMPT, counted_steps, prompts_for

PROMPTS = [list(range(5 + i, 20 + 3 * i)) for i in range(5)] + [[7, 300, 12, 44, 7, 300]]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_llm(folder, async_scheduling: bool, **kw) -> LLM:
    kw = {"device": "cpu", "max_model_len": 96, "block_size": 4, **kw}
    return LLM(str(folder), async_scheduling=async_scheduling, **kw)


def run_checked(llm: LLM, prompts, params, tag: str = "") -> dict[str, list[int]]:
    """Every prompt through ``engine.step()``, the engine's invariants checked after each step."""
    engine = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"{tag}{i}", prompt, p)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        engine.check_invariants()
    return finished


def all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.scheduler.kv_cache_manager
    return kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks and kv.uncommitted_blocks == []


# -- the scheduler's placeholders ----------------------------------------------------------------


def test_a_step_is_scheduled_before_the_last_ones_token_is_back():
    """Two steps scheduled before the first is updated: the second computes the position of a
    token only the device knows (a placeholder), and the tokens arrive in order."""
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=32))
    request = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add_request(request)
    first = scheduler.schedule()  # the whole prompt: it samples, a placeholder
    assert first.num_scheduled_tokens == {"a": 6} and request.num_output_placeholders == 1
    second = scheduler.schedule()  # position 6 computed before its token is known
    assert second.num_scheduled_tokens == {"a": 1}
    assert (request.num_computed_tokens, request.num_tokens, request.num_output_placeholders) == (7, 6, 2)
    scheduler.check_invariants()
    out1 = scheduler.update_from_output(first, fake_execute_at(first, {"a": 42}))
    assert out1[0].new_token_ids == [42] and request.num_output_placeholders == 1
    # the third step would give the third token, the last one max_tokens allows: with two
    # still on the device (one placeholder + ...), no step is spent past it (async_scheduler NOTE 2)
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 1} and request.num_output_placeholders == 2
    assert scheduler.schedule().num_scheduled_tokens == {}  # its tokens in flight end it
    scheduler.update_from_output(second, fake_execute_at(second, {"a": 43}))
    final = scheduler.update_from_output(third, fake_execute_at(third, {"a": 44}))
    assert final[0].finish_reason == "length" and request.output_token_ids == [42, 43, 44]
    assert request.num_output_placeholders == 0 and not scheduler.requests
    scheduler.check_invariants()


def fake_execute_at(out, tokens: dict[str, int]):
    from tinyvllm.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[tokens[r]] for r in req_ids])


def test_a_block_is_cached_only_once_its_tokens_are_known_and_written():
    """A block filled by a placeholder is not in the prefix cache when the step is scheduled;
    it is cached when the token arrives (kv_cache_manager NOTE 6)."""
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=32))
    request = Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    scheduler.add_request(request)
    kv = scheduler.kv_cache_manager
    first = scheduler.schedule()  # 7 tokens: block 0 full and cached; block 1 holds 3
    assert kv.num_cached_block["a"] == 1
    second = scheduler.schedule()  # position 7 (the placeholder) fills block 1, unknown yet
    assert kv.num_cached_block["a"] == 1
    scheduler.update_from_output(first, fake_execute_at(first, {"a": 8}))
    # token 7 is known now, but its KV is written by the second step, still in flight
    assert kv.num_cached_block["a"] == 1
    scheduler.schedule()
    scheduler.update_from_output(second, fake_execute_at(second, {"a": 9}))
    assert kv.num_cached_block["a"] == 2  # the second step wrote position 7's KV: block 1 is cached
    scheduler.check_invariants()


def test_sync_scheduler_never_counts_placeholders(make_request):
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=32))
    scheduler.add_request(make_request("a", [1, 2, 3], sampling_params=SamplingParams(max_tokens=2)))
    scheduler.schedule()
    assert scheduler.requests["a"].num_output_placeholders == 0


# -- the engine: the same tokens as the synchronous one --------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_async_greedy_tokens_and_logprobs_equal_sync(tiny_model_dirs, family):
    folder = tiny_model_dirs[family]
    params = greedy(logprobs=2)
    expected = make_llm(folder, False).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm = make_llm(folder, True)
    assert llm.engine.async_scheduling and isinstance(llm.engine.scheduler, AsyncScheduler)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert_same_tokens_and_logprobs(expected, got, abs_tol=1e-5)
    assert all_blocks_free(llm) and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_batched_tokens": 7},  # chunked prefills beside decodes
        {"num_gpu_blocks_override": 14, "max_num_seqs": 4, "max_model_len": 48},  # preemption, a step in flight
        {"enable_prefix_caching": True},  # the second round hits the first round's blocks
    ],
    ids=["chunked", "preemption", "prefix_hits"],
)
def test_async_equals_sync_under_the_schedulers_corner_cases(tiny_model_dirs, kw):
    folder = tiny_model_dirs["qwen3"]
    expected = run_checked(make_llm(folder, False, **kw), PROMPTS, greedy(16))
    two_rounds_give(make_llm(folder, True, **kw), PROMPTS, greedy(16), expected, kw)


def two_rounds_give(llm: LLM, prompts, params, expected: dict[str, list[int]], kw: dict) -> None:
    """Two rounds of ``prompts`` (the second hitting the first's blocks, with caching) give
    ``expected``; the corner case ``kw`` sets up happened (preemptions, prefix hits); no block
    is left held."""
    for round_ in range(2):
        got = run_checked(llm, prompts, params, tag=f"{round_}-")
        assert [got[f"{round_}-{i}"] for i in range(len(prompts))] == [expected[str(i)] for i in range(len(prompts))]
    scheduler = llm.engine.scheduler
    if "num_gpu_blocks_override" in kw:
        assert scheduler.num_preemptions > 0
    if kw.get("enable_prefix_caching"):
        assert scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    assert all_blocks_free(llm)


def test_every_sampling_feature_gives_the_same_tokens(tiny_model_dirs):
    """Seeded sampling, penalties, bad words, min_tokens, logit bias, allowed ids, logprobs,
    prompt logprobs and the thinking budget read the outputs a step late under async
    scheduling: the runner reads the last step back before they see the batch."""
    folder = tiny_model_dirs["qwen3"]
    requests = prompts_for(ASKING_EVERYTHING)
    prompts, params = [p for p, _ in requests], [q for _, q in requests]
    kw = {"block_size": 16, "max_num_batched_tokens": 16}
    expected = make_llm(folder, False, **kw).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = make_llm(folder, True, **kw).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(expected, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs and a.prompt_logprobs == b.prompt_logprobs
    assert got[5].outputs[0].token_ids[2] == 2  # the thinking budget forced </think> (id 2)


def test_stop_tokens_and_n_gt_1_stop_one_step_late_and_drop_the_extra_token(tiny_model_dirs):
    """A request that stops in step N was scheduled in N+1 already: that token is computed and
    dropped (async_scheduler NOTE 1); parallel samples (n = 2) finish alike."""
    folder = tiny_model_dirs["qwen3"]
    sync = make_llm(folder, False)
    first = sync.generate([{"prompt_token_ids": PROMPT}], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(2, 8) if first[i] not in first[:i])  # its first appearance ends it
    stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first[k]])
    seeded = SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=6, ignore_eos=True)
    expected = sync.generate([{"prompt_token_ids": PROMPT}] * 2, [stop, seeded], use_tqdm=False)
    llm = make_llm(folder, True)
    got = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [stop, seeded], use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids == first[: k + 1]
    assert got[0].outputs[0].finish_reason == "stop"
    assert [c.token_ids for c in got[1].outputs] == [c.token_ids for c in expected[1].outputs]
    assert all_blocks_free(llm)


def test_an_abort_with_a_step_in_flight_frees_everything_and_the_rest_carry_on(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    expected = run_checked(make_llm(folder, False), PROMPTS[1:], greedy(16))
    llm = make_llm(folder, True)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(16))
    finished, aborted = {}, False
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        victim = engine.scheduler.requests.get("r0")
        if not aborted and victim is not None and victim.num_output_placeholders:
            assert engine.abort_request("r0")[0].outputs[0].finish_reason == "abort"  # a step computes it now
            aborted = True
        engine.check_invariants()
    assert aborted and "r0" not in finished
    assert [finished[f"r{i}"] for i in range(1, len(PROMPTS))] == [expected[str(i)] for i in range(len(PROMPTS) - 1)]
    assert all_blocks_free(llm)


@pytest.mark.parametrize("where", ["forward", "read_back"])
def test_a_failed_step_takes_the_steps_in_flight_down_and_the_engine_serves_on(tiny_model_dirs, monkeypatch, where):
    """A step that raises while another is in flight: both steps' requests are aborted, their
    blocks freed, the runner emptied; the next requests get the synchronous engine's tokens."""
    folder = tiny_model_dirs["qwen3"]
    expected = run_checked(make_llm(folder, False), PROMPTS[:2], greedy(8))
    calls = iter(range(1, 10**6))
    a_failed_step_leaves_it_serving(
        monkeypatch, make_llm(folder, True), where, lambda: next(calls) == 4, PROMPTS[2:], greedy(8), PROMPTS[:2], expected
    )


def a_failed_step_leaves_it_serving(monkeypatch, llm: LLM, where: str, fire, doomed, params, prompts, expected) -> None:
    """The runner's forward or read-back raises at the first call at which ``fire()`` is true,
    while ``doomed`` run: every request is aborted, every block freed, the runner emptied; then
    ``prompts`` get ``expected``."""
    engine, runner = llm.engine, llm.engine.model_runner
    target = "_forward" if where == "forward" else "_read_back"
    original = getattr(runner, target)

    def failing(*args, **kwargs):
        if fire():
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, target, failing)
    for i, prompt in enumerate(doomed):
        engine.add_request(f"doomed{i}", prompt, params)
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not engine.has_unfinished_requests() and all_blocks_free(llm) and not runner.requests
    engine.check_invariants()
    monkeypatch.setattr(runner, target, original)
    assert run_checked(llm, prompts, params) == expected and all_blocks_free(llm)


@pytest.mark.slow
def test_emulated_cuda_graphs_read_the_placeholder_from_the_device(tiny_model_dirs):
    """Under a FULL graph the placeholder's id is written into the graph's own input buffer
    (mixed steps run PIECEWISE, decodes of up to 4 requests replay FULL graphs)."""
    folder = tiny_model_dirs["qwen3"]
    kw = {"attention_backend": "triton", "block_size": 16, "max_num_batched_tokens": 16,
          "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4]}}  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    expected = make_llm(folder, False, **kw).generate(prompts, greedy(8), use_tqdm=False)
    llm = make_llm(folder, True, **kw)
    got = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    from tinyvllm.config import CUDAGraphMode

    assert llm.engine.model_runner.cudagraph_stats[CUDAGraphMode.FULL] > 0


# -- the one wait ----------------------------------------------------------------------------------


def steps_on_a_timeline(monkeypatch, folder, requests, **kw) -> tuple[list, dict, LLM, str]:
    """``counted_steps`` with every ``schedule()`` ("s"), sampler call ("p") and device wait
    ("w", while counting) marked in one timeline, in the order they happen; its steps, outputs
    and engine, and the timeline as a string."""
    from tinyvllm.device_syncs import DeviceSyncCounter

    timeline: list[str] = []

    class Recording(list):
        def append(self, sync) -> None:
            timeline.append("w")
            super().append(sync)

    class TimelineCounter(DeviceSyncCounter):
        def __init__(self) -> None:
            super().__init__()
            self.syncs = Recording()

        def take(self) -> list:
            syncs, self.syncs = self.syncs, Recording()
            return list(syncs)

    counter = TimelineCounter()
    original_init = LLM.__init__  # wrapped: marks the built engine's scheduler and sampler

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        scheduler, runner = self.engine.scheduler, self.engine.model_runner
        schedule, sampler = scheduler.schedule, runner.sampler

        def marked_schedule():
            timeline.append("s")
            return schedule()

        def marked_sampler(*a, **k):
            out = sampler(*a, **k)
            timeline.append("p")
            return out

        scheduler.schedule, runner.sampler = marked_schedule, marked_sampler

    monkeypatch.setattr(LLM, "__init__", init)
    steps, outputs, llm = counted_steps(folder, requests, counter=counter, **kw)
    return steps, outputs, llm, "".join(m for m in timeline if m != "w" or counter.counting)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_no_wait_between_sampling_a_step_and_scheduling_the_next(tiny_model_dirs, monkeypatch, async_scheduling):
    """Marks in one timeline: each sampler call and each ``schedule()``. Under async scheduling
    nothing waits for the device between a step's sampling and the next schedule: the step's
    one wait comes inside the next step, after its forward was launched. The synchronous
    engine waits right after sampling (the check fails there: the test can tell them apart)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    steps, outputs, _, between = steps_on_a_timeline(
        monkeypatch, tiny_model_dirs["qwen3"], [(PROMPT, params), (PROMPT[:5], params)], async_scheduling=async_scheduling
    )
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs.values())
    # one sampling ("p") per step, then the next schedule ("s"): what waits in between?
    gaps = [gap for gap in between.split("p")[1:] if "s" in gap]
    assert len(gaps) >= 5, between
    waits_before_next_schedule = [gap.index("s") and gap[: gap.index("s")].count("w") for gap in gaps]
    if async_scheduling:
        assert waits_before_next_schedule == [0] * len(gaps), between
        assert [len(syncs) for syncs in steps] == [0] + [1] * (len(steps) - 2) + [0], steps  # launch only; one wait; drained
    else:
        assert waits_before_next_schedule == [1] * len(gaps), between


def test_the_host_twin_is_rewritten_only_after_the_last_steps_copy_ran(tiny_model_dirs, monkeypatch):
    """input_buffers.py NOTE 2: a ``non_blocking`` copy reads its pinned host twin when the device
    reaches it. With async scheduling the host prepares step N+1 while step N may still be
    queued, so every write to the twin must come after a wait for the event that ``fill``
    records behind its copy. On the CPU the event is a stand-in that writes into the timeline;
    the engine's tokens stay the synchronous ones."""
    from tinyvllm.worker.input_buffers import InputBuffers

    timeline: list[str] = []

    class Event:  # what torch.cuda.Event does for the buffers, as marks
        def record(self) -> None:
            timeline.append("record")

        def synchronize(self) -> None:
            timeline.append("wait")

    write_host = InputBuffers._write_host

    def marked(*args):
        timeline.append("write")
        return write_host(*args)

    monkeypatch.setattr(InputBuffers, "_write_host", staticmethod(marked))
    folder = tiny_model_dirs["qwen3"]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = make_llm(folder, False).generate(prompts, greedy(8), use_tqdm=False)
    llm = make_llm(folder, True, max_num_seqs=3)  # requests join and leave the batch: rows move
    llm.engine.model_runner.buffers.copied = Event()
    timeline.clear()
    got = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    fills = llm.engine.model_runner.cudagraph_stats.total()
    assert timeline.count("record") == timeline.count("write") == fills > 8, timeline  # one event behind every copy
    queued = False  # a copy queued and not yet waited for
    for i, mark in enumerate(timeline):
        assert not (mark == "write" and queued), f"the twin written before the last step's copy ran: {timeline[: i + 1]}"
        queued = mark == "record" or (queued and mark != "wait")


# -- the flag ---------------------------------------------------------------------------------------


def test_an_async_scheduling_flag_that_is_not_a_bool_is_refused(tiny_model_dirs):
    """(With speculative decoding it works: ``test_async_spec_decode.py``.)"""
    with pytest.raises(TypeError, match="async_scheduling"):
        make_llm(tiny_model_dirs["qwen3"], "yes")


def test_the_cli_flag_reaches_the_engine_args():
    import argparse

    from tinyvllm.engine.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="m")
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling is False


# -- the GPU twin ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_async_steps_make_cuda_wait_nowhere_and_give_the_sync_tokens(tiny_model_dirs):
    """On a GPU CUDA's own sync debug mode reports no synchronizing call in any async step, logprobs
    and prompt logprobs included: the one wait is the read-back's event (async_output.py NOTE 1)."""
    import torch

    kw = dict(device=torch.device("cuda"), max_num_seqs=8, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    async_steps_wait_nowhere_and_give_the_sync_tokens(tiny_model_dirs["qwen3"], prompts_for(ASKING_EVERYTHING), **kw)


def async_steps_wait_nowhere_and_give_the_sync_tokens(folder, requests, **kw) -> LLM:
    """``requests`` through a synchronous and an async engine (``kw``: on CUDA): under CUDA's sync
    debug mode no async step makes a synchronizing call, and the tokens are equal; the async LLM."""
    _, expected, _ = counted_steps(folder, requests, **kw)
    cuda_waits: list[list[str]] = []
    _, outputs, llm = counted_steps(folder, requests, cuda_waits=cuda_waits, async_scheduling=True, **kw)
    assert cuda_waits and all(w == [] for w in cuda_waits), cuda_waits
    for rid, out in expected.items():
        assert outputs[rid].outputs[0].token_ids == out.outputs[0].token_ids, rid
    return llm


@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "grammar"])
def test_an_id_reused_while_its_aborted_step_is_in_flight_gets_only_its_own_tokens(tiny_model_dirs, constrained):
    """Abort ``r0`` while its step is in flight and add a new ``r0`` at once: the old step's
    token must not reach the new request (async_scheduler NOTE 5). With a grammar the engine
    sends the runner a copy of the step with its mask (``sched_output.py`` NOTE 4): the
    scheduler must still know the copy for the step it scheduled."""
    from tinyvllm.sampling_params import StructuredOutputsParams

    folder = tiny_model_dirs["qwen3"]
    expected = run_checked(make_llm(folder, False), [PROMPTS[2]], greedy(8))["0"]
    llm = make_llm(folder, True)
    engine = llm.engine
    first = greedy(8, structured_outputs=StructuredOutputsParams(regex="[a-z ]+")) if constrained else greedy(8)
    engine.add_request("r0", PROMPTS[0], first)
    engine.add_request("other", PROMPTS[1], greedy(8))
    while not engine.scheduler.requests["r0"].num_output_placeholders:
        engine.step()
    engine.abort_request("r0")
    engine.add_request("r0", PROMPTS[2], greedy(8))  # the same id, while the old one's step runs
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        engine.check_invariants()
    assert finished["r0"] == expected
    assert all_blocks_free(llm)
