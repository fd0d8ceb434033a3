"""Async scheduling with speculative decoding (``async_scheduling=True`` and an n-gram
``speculative_config``, as vLLM runs them together): the scheduler cannot know step N's drafts
or how many of them the target keeps when it schedules step N+1, so it schedules
*placeholder* drafts (``DRAFT_PLACEHOLDER``) and counts optimistically; the runner reads step N
back, proposes the real drafts itself and verifies them; the rejected ones are taken back on
both sides. The outputs equal the synchronous engine's token for token (greedy, seeded, the
sampling features drafts can honour), under chunked prefill, preemption, prefix hits, aborts
and a failed step; nothing waits between sampling step N and scheduling step N+1."""

from __future__ import annotations

import re

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.async_scheduler import AsyncScheduler
from tinyvllm.core.sched_output import DRAFT_PLACEHOLDER
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.request import Request

from engine_compare import assert_same_tokens_and_logprobs
from spec_workload import LOOP, PROMPTS, SPEC, run_rounds_with_an_abort
from test_async_scheduling import (
    a_failed_step_leaves_it_serving,
    all_blocks_free,
    run_checked,
    steps_on_a_timeline,
    two_rounds_give,
)

K = SPEC["num_speculative_tokens"]


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_llm(folder, async_scheduling: bool = True, spec: dict | None = SPEC, **kw) -> LLM:
    kw = {"device": "cpu", "max_model_len": 96, "block_size": 4, **kw}
    llm = LLM(str(folder), async_scheduling=async_scheduling, speculative_config=spec, **kw)
    for proposer in (llm.engine.proposer, getattr(llm.engine.model_runner, "proposer", None)):
        if proposer is not None:  # these batches are small: search them in numpy all the same
            proposer.min_batch_tokens = 0
    return llm


def runner_output(out, tokens: dict[str, list[int]], drafts: dict[str, tuple[int, ...]] | None = None):
    """What a runner would return for step ``out``: ``tokens`` per request (kept drafts, then
    the target's own), and the drafts it proposed in place of the placeholders."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        ids, {r: i for i, r in enumerate(ids)}, [tokens.get(r, []) for r in ids], draft_token_ids=drafts or {}
    )


# -- the scheduler: placeholder drafts, counted optimistically, taken back ---------------------------


def test_placeholder_drafts_are_scheduled_before_the_real_ones_exist():
    """After a request's first token is scheduled, its next step verifies k placeholder drafts;
    when a step's output says how many the target kept, the rest are taken back from both
    ``num_computed_tokens`` and the placeholders, and the blocks cached are those of known tokens."""
    scheduler = AsyncScheduler(
        SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=32, enable_prefix_caching=True),
        num_spec_tokens=K,
    )  # fmt: skip
    request = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prompt: no drafts (nothing sampled yet), one token to come
    assert first.num_scheduled_tokens == {"a": 6} and first.scheduled_spec_decode_tokens == {}
    assert request.num_output_placeholders == 1 and request.spec_token_ids == [DRAFT_PLACEHOLDER] * K
    second = scheduler.schedule()  # the token in flight and k drafts the runner will propose
    assert second.num_scheduled_tokens == {"a": 1 + K}
    assert second.scheduled_spec_decode_tokens == {"a": (DRAFT_PLACEHOLDER,) * K}
    assert (request.num_computed_tokens, request.num_output_placeholders) == (6 + 1 + K, 1 + 1 + K)
    scheduler.check_invariants()
    scheduler.update_from_output(first, runner_output(first, {"a": [40]}))
    assert request.output_token_ids == [40] and request.num_output_placeholders == 1 + K
    # the runner proposed 2 drafts (not 3) and the target kept 1 of them, then its own token
    scheduler.update_from_output(second, runner_output(second, {"a": [41, 42]}, {"a": (41, 77)}))
    assert request.output_token_ids == [40, 41, 42] and request.num_output_placeholders == 0
    assert request.num_computed_tokens == request.num_tokens - 1 == 8  # 3 rejected: 2 placeholders + 1 draft
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 2, 1)  # the real drafts
    assert scheduler.kv_cache_manager.num_cached_block["a"] == 2  # tokens 0..7 known and written
    scheduler.check_invariants()


def test_placeholder_drafts_never_reach_past_max_model_len():
    """Counted as if every draft in flight were kept, a request never gets a slot past
    ``max_model_len``: its placeholder drafts shrink near the end, as the synchronous proposer's do."""
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=12), CacheConfig(block_size=4, num_gpu_blocks=8),
                               num_spec_tokens=K)  # fmt: skip
    request = Request("a", list(range(1, 9)), SamplingParams(max_tokens=30, ignore_eos=True))
    scheduler.add_request(request)
    steps = [scheduler.schedule()]  # 8 prompt tokens; one in flight: 9 optimistic
    steps.append(scheduler.schedule())  # drafts to fill 12: 12 - 9 = 3
    assert steps[-1].scheduled_spec_decode_tokens == {"a": (DRAFT_PLACEHOLDER,) * 3}
    assert request.num_tokens + request.num_output_placeholders == 13 and request.spec_token_ids == []
    assert scheduler.schedule().num_scheduled_tokens == {}  # as if all kept: nothing fits
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3  # 12 slots, no more
    scheduler.check_invariants()


def test_a_request_is_held_back_only_when_its_drafts_in_flight_surely_end_it():
    """Near ``max_tokens`` a request with drafts in flight is scheduled again unless its tokens in
    flight end it even if every draft is rejected (vLLM's check): counting the drafts as kept
    would leave it a step behind whenever they are not."""
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_gpu_blocks=32),
                               num_spec_tokens=K)  # fmt: skip
    request = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()  # the prompt; then 1 + 3 placeholder drafts
    scheduler.update_from_output(first, runner_output(first, {"a": [40]}))
    assert (request.num_output_tokens, request.num_output_placeholders) == (1, 1 + K)  # 1 to 4 tokens in flight
    third = scheduler.schedule()  # at least 2 tokens by then, not surely 4: it runs on
    assert third.num_scheduled_tokens == {"a": 1 + K}
    # step 2 kept every draft: 4 tokens, the request ends; step 3's tokens are dropped
    out = scheduler.update_from_output(second, runner_output(second, {"a": [41, 42, 43, 44]}, {"a": (41, 42, 43)}))
    assert out[0].finish_reason == "length" and request.output_token_ids == [40, 41, 42, 43]
    assert scheduler.update_from_output(third, runner_output(third, {"a": [50]}, {"a": ()})) == []
    assert not scheduler.requests
    scheduler.check_invariants()


# -- the engine: the synchronous engine's tokens --------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_async_speculation_gives_the_synchronous_tokens_logprobs_and_acceptance(tiny_model_dirs, family):
    folder = tiny_model_dirs[family]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = greedy(20, logprobs=2)
    sync = make_llm(folder, False)
    expected = sync.generate(prompts, params, use_tqdm=False)
    plain = make_llm(folder, False, None).generate(prompts, params, use_tqdm=False)
    llm = make_llm(folder)
    assert llm.engine.proposer is None and llm.engine.model_runner.proposer is not None  # the runner proposes
    got = llm.generate(prompts, params, use_tqdm=False)
    assert_same_tokens_and_logprobs(expected, got, abs_tol=1e-5)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    mine, theirs = llm.engine.scheduler.spec_stats, sync.engine.scheduler.spec_stats
    assert mine.num_accepted_tokens > 0 and mine == theirs  # the same drafts, verified alike
    assert all_blocks_free(llm)
    llm.engine.check_invariants()


@pytest.mark.parametrize(
    "kw",
    [
        {"max_num_batched_tokens": 7},  # chunked prefills, placeholder drafts cut to the budget
        {"num_gpu_blocks_override": 26, "max_num_seqs": 4},  # preemption with drafts in flight
        {"enable_prefix_caching": True},  # the second round hits the first round's blocks
    ],
    ids=["chunked", "preemption", "prefix_hits"],
)
def test_async_speculation_equals_sync_under_the_schedulers_corner_cases(tiny_model_dirs, kw):
    folder = tiny_model_dirs["qwen3"]
    expected = run_checked(make_llm(folder, False, None, **kw), PROMPTS, greedy(24))
    llm = make_llm(folder, **kw)
    two_rounds_give(llm, PROMPTS, greedy(24), expected, kw)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_priorities_preempt_requests_with_drafts_in_flight_and_the_tokens_stay(tiny_model_dirs):
    """``scheduling_policy="priority"`` on a pool too small for all: a late, urgent request
    preempts running ones, some with placeholder drafts in flight (one perhaps scheduled earlier
    in the same step); every request still gets the synchronous engine's tokens."""

    def run(llm: LLM) -> dict[str, list[int]]:
        engine, finished = llm.engine, {}
        for i, prompt in enumerate(PROMPTS * 2):
            engine.add_request(str(i), prompt, greedy(24), priority=(7 * i) % 3)
        for step in range(10**4):
            if not engine.has_unfinished_requests():
                return finished
            finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
            engine.check_invariants()
            if step == 5:
                engine.add_request("late", PROMPTS[1], greedy(24), priority=-1)
        raise AssertionError("the requests never finished")

    kw = {"num_gpu_blocks_override": 26, "max_num_seqs": 4, "scheduling_policy": "priority"}
    expected = run(make_llm(tiny_model_dirs["qwen3"], False, None, **kw))
    llm = make_llm(tiny_model_dirs["qwen3"], **kw)
    assert run(llm) == expected
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.spec_stats.num_accepted_tokens > 0 and all_blocks_free(llm)


def test_seeded_streams_and_the_sampling_features_drafts_honour_give_the_same_tokens(tiny_model_dirs):
    """Each draw is keyed by position (``sample/draw_keys.py``), so a seeded stream is the same
    whatever drafts a step verifies; penalties, bad words, min_tokens, allowed ids, logprobs,
    prompt logprobs and the thinking budget read the tokens of the step read back first. (An
    unseeded random request draws from the one generator in batch order: the same tokens only
    when every step is the same, which placeholder drafts change.)"""
    import dataclasses

    from test_device_syncs import ASKING_EVERYTHING, prompts_for

    folder = tiny_model_dirs["qwen3"]
    requests = [(p, q if q.seed is not None or q.temperature == 0 else dataclasses.replace(q, seed=11))
                for p, q in prompts_for(ASKING_EVERYTHING) if q.min_p == 0]  # fmt: skip  (min_p: refused with drafts)
    requests += [(LOOP, SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, n=2))]
    prompts, params = [{"prompt_token_ids": p} for p, _ in requests], [q for _, q in requests]
    kw = {"block_size": 16, "max_num_batched_tokens": 16}
    expected = make_llm(folder, False, **kw).generate(prompts, params, use_tqdm=False)
    llm = make_llm(folder, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(expected, got, strict=True):  # logprobs: the same tokens, values up to rounding
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert same_logprobs(a.outputs[0].logprobs, b.outputs[0].logprobs)
        assert same_logprobs(a.prompt_logprobs, b.prompt_logprobs)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def same_logprobs(mine, theirs, tol: float = 1e-5) -> bool:
    """The same positions, the same token ids at each, logprobs and ranks within rounding (a
    step's batch, so the shapes of its matmuls, differs between the two engines)."""
    if mine is None or theirs is None:
        return mine is theirs
    return len(mine) == len(theirs) and all(
        (a is None and b is None) or (a.keys() == b.keys() and all(
            abs(a[t].logprob - b[t].logprob) <= tol and a[t].rank == b[t].rank for t in a))
        for a, b in zip(mine, theirs)
    )  # fmt: skip


def test_a_stop_token_ends_the_request_one_step_late_and_the_step_after_is_dropped(tiny_model_dirs):
    """The request stops on a token its verification kept; the step scheduled after it (with
    placeholder drafts) is computed and thrown away; its neighbour carries on."""
    folder = tiny_model_dirs["qwen3"]
    prompt = PROMPTS[3]
    first = make_llm(folder, False, None).generate([{"prompt_token_ids": prompt}], greedy(20), use_tqdm=False)
    tokens = first[0].outputs[0].token_ids
    k = next(i for i in range(4, 20) if tokens[i] not in tokens[:i])  # its first appearance ends it
    stop = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[k]])
    llm = make_llm(folder)
    got = run_checked(llm, [prompt, LOOP[:9]], [stop, greedy(20)])
    assert got["0"] == tokens[: k + 1]
    assert got["1"] == run_checked(make_llm(folder, False, None), [LOOP[:9]], greedy(20))["0"]
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0 and all_blocks_free(llm)


def test_an_abort_with_placeholder_drafts_in_flight_frees_everything(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    expected = [o.outputs[0].token_ids for o in make_llm(folder, False, None).generate(
        [{"prompt_token_ids": p} for p in PROMPTS[1:]], greedy(20), use_tqdm=False)]  # fmt: skip
    llm = make_llm(folder, enable_prefix_caching=True)
    run_rounds_with_an_abort(llm.engine, greedy(20), expected)
    assert all_blocks_free(llm)


@pytest.mark.parametrize("where", ["forward", "read_back"])
def test_a_failed_step_with_drafts_in_flight_leaves_the_engine_serving(tiny_model_dirs, monkeypatch, where):
    folder = tiny_model_dirs["qwen3"]
    expected = run_checked(make_llm(folder, False, None), PROMPTS[:2], greedy(12))
    llm = make_llm(folder)
    fired = []

    def fire() -> bool:  # the first call once drafts were verified and kept, once
        if not fired and llm.engine.scheduler.spec_stats.num_accepted_tokens > 0:
            fired.append(True)
            return True
        return False

    a_failed_step_leaves_it_serving(monkeypatch, llm, where, fire, PROMPTS, greedy(12), PROMPTS[:2], expected)


@pytest.mark.slow
def test_emulated_cuda_graphs_give_the_synchronous_tokens(tiny_model_dirs):
    """Decode steps of k + 1 tokens per request replay FULL graphs, steps without drafts the
    graphs of one token, mixed steps PIECEWISE, as in the synchronous engine."""
    from tinyvllm.config import CUDAGraphMode

    folder = tiny_model_dirs["qwen3"]
    kw = {"attention_backend": "triton", "block_size": 16, "max_num_batched_tokens": 16,
          "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]}}  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    expected = make_llm(folder, False, **kw).generate(prompts, greedy(12), use_tqdm=False)
    llm = make_llm(folder, **kw)
    got = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert llm.engine.model_runner.cudagraph_stats[CUDAGraphMode.FULL] > 0


# -- the waits, and what is refused ---------------------------------------------------------------------


@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "grammar"])
def test_nothing_waits_between_sampling_a_step_and_scheduling_the_next(tiny_model_dirs, monkeypatch, constrained):
    """Marks in one timeline: each sampler call, each ``schedule()`` and each device wait. The
    verification's ids come up when the next step is launched (its inputs need the count kept),
    never between a step's sampling and the next ``schedule()``; under a grammar too, whose
    mask waits for the runner's drafts (``take_draft_token_ids``), not for the device."""
    from tinyvllm.sampling_params import StructuredOutputsParams

    grammar = StructuredOutputsParams(regex="[a-c]{3}(-[0-9]{2})+") if constrained else None
    steps, outputs, llm, marks = steps_on_a_timeline(
        monkeypatch, tiny_model_dirs["qwen3"], [(LOOP, greedy(12)), (PROMPTS[1], greedy(12, structured_outputs=grammar))],
        async_scheduling=True, speculative_config=SPEC,
    )  # fmt: skip
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs.values())
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    gaps = [gap for gap in marks.split("p")[1:] if "s" in gap]
    assert len(gaps) >= 4, marks
    assert all("w" not in gap[: gap.index("s")] for gap in gaps), marks
    assert max(len(syncs) for syncs in steps) == 1, steps  # one wait a step at most


def test_served_with_both_flags_a_stream_and_a_grammar_have_the_synchronous_text(tiny_model_dirs):
    """``tinyvllm serve --async-scheduling --speculative-config ...``'s engine behind the real
    ``openai`` client: a streamed completion (the deltas of several tokens a step) and a
    completion under a grammar (``test_async_spec_structured_outputs.py``) have the
    synchronous engine's text."""
    from tinyvllm.sampling_params import StructuredOutputsParams
    from serve_fixtures import require_serve_extra, running_server

    require_serve_extra()
    import openai

    folder = tiny_model_dirs["qwen3"]
    plain = make_llm(folder, False, None)
    sync = plain.generate([{"prompt_token_ids": LOOP}], greedy(20), use_tqdm=False)[0]
    regex = "[a-c]{3}(-[0-9]{2})+"
    constrained = greedy(8, structured_outputs=StructuredOutputsParams(regex=regex))
    sync_constrained = plain.generate([{"prompt_token_ids": LOOP}], constrained, use_tqdm=False)[0].outputs[0].text
    llm = make_llm(folder)
    with running_server(llm, "tiny") as (url, _app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model="tiny", prompt=LOOP, max_tokens=20, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        deltas = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert "".join(deltas) == sync.outputs[0].text
        reply = client.completions.create(model="tiny", prompt=LOOP, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "structured_outputs": {"regex": regex}})  # fmt: skip
        assert reply.choices[0].text == sync_constrained
        assert re.fullmatch(r"[a-c]{0,3}|[a-c]{3}(-[0-9]{0,2})*", sync_constrained), sync_constrained
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0 and all_blocks_free(llm)


def test_the_engine_arguments_take_both(tiny_model_dirs):
    from tinyvllm.engine.engine_args import EngineArgs

    config = EngineArgs(str(tiny_model_dirs["qwen3"]), device="cpu", async_scheduling=True,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2}).create_engine_config()  # fmt: skip
    assert config.scheduler_config.async_scheduling and config.speculative_config.num_speculative_tokens == 2


# -- the GPU twin ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_async_speculation_gives_the_sync_tokens_and_cuda_waits_nowhere(tiny_model_dirs):
    """On a GPU: the tokens of the synchronous speculative engine, and CUDA's own sync debug mode
    reports no synchronizing call in any async step; the waits are the read-backs' events
    (``worker/async_output.py`` NOTE 1), which it does not count."""
    import dataclasses

    import torch

    from test_async_scheduling import async_steps_wait_nowhere_and_give_the_sync_tokens
    from test_device_syncs import ASKING_EVERYTHING, prompts_for

    requests = [(p, q if q.seed is not None or q.temperature == 0 else dataclasses.replace(q, seed=11))
                for p, q in prompts_for(ASKING_EVERYTHING) if q.min_p == 0] + [(LOOP, greedy(24))]  # fmt: skip
    kw = dict(device=torch.device("cuda"), max_num_seqs=8, speculative_config=SPEC,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})  # fmt: skip
    llm = async_steps_wait_nowhere_and_give_the_sync_tokens(tiny_model_dirs["qwen3"], requests, **kw)
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_async_speculation_under_a_grammar_gives_the_sync_tokens_and_cuda_waits_nowhere(tiny_model_dirs):
    """On a GPU, a constrained request beside plain ones: its mask waits for the runner's drafts
    (``take_draft_token_ids``), not for the device, and the tokens are the synchronous engine's.
    xgrammar comes to the GPU machine as carried wheels (``bench/fetch_gpu_wheels.sh``)."""
    pytest.importorskip("xgrammar")
    import torch

    from test_async_scheduling import async_steps_wait_nowhere_and_give_the_sync_tokens
    from tinyvllm.sampling_params import StructuredOutputsParams

    grammar = StructuredOutputsParams(regex="[a-c]{3}(-[0-9]{2})+")
    requests = [(LOOP, greedy(24)), (PROMPTS[1], greedy(16, structured_outputs=grammar)), (PROMPTS[3], greedy(16))]
    kw = dict(device=torch.device("cuda"), max_num_seqs=8, speculative_config=SPEC,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})  # fmt: skip
    llm = async_steps_wait_nowhere_and_give_the_sync_tokens(tiny_model_dirs["qwen3"], requests, **kw)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0

