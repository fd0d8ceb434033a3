"""Tensor parallelism end to end on the CPU (gloo): an engine with ``tensor_parallel_size=2``
gives the tokens of a one-process engine, token for token, with logprobs within float32
rounding, for Qwen3, Qwen2 and Llama, through prefix caching (a shared prefix), chunked
prefill (a small token budget), preemption (few KV blocks) and n > 1; seeded sampling
repeats under N = 2; n-gram speculative decoding and every emulated ``cudagraph_mode`` too
(slow), and a pooling engine's vectors (slow); a regex-constrained request gets one rank's tokens (the grammar bitmask reaches both ranks);
``AsyncLLM`` streams the same tokens, with async scheduling. Each engine start spawns two worker processes,
so each test starts few engines and gives each several prompts and features at once."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from engine_compare import assert_same_tokens_and_logprobs
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.engine_args import EngineArgs
from tinyvllm.sampling_params import StructuredOutputsParams

LOGPROB_TOL = 1e-4  # float32 rounding: a split matmul sums in another order
SHARED = list(range(3, 35))  # a 32-token prefix, 8 blocks of 4: cached by the first request
PROMPTS = [
    {"prompt_token_ids": SHARED + [40, 41, 42]},
    {"prompt_token_ids": SHARED + [50, 51]},
    {"prompt_token_ids": [7, 8, 9, 10, 11]},
    {"prompt_token_ids": list(range(60, 90))},
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
CONSTRAINED = SamplingParams(max_tokens=10, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-c]{3}(-[0-9]{2})+"))
# 20 blocks of 4 tokens hold one 64-token request and little more: four requests preempt
ENGINE = dict(
    device="cpu", torch_threads=1, block_size=4, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
    num_gpu_blocks_override=20, enable_prefix_caching=True, attention_backend="torch",
)  # fmt: skip


def generate_both(folder: str, **kwargs):
    """The greedy and the n = 2 seeded runs of an N = 1 and an N = 2 engine, and the N = 2
    engine's preemptions and a second seeded run (reproducibility)."""
    seeded = SamplingParams(max_tokens=8, temperature=0.9, n=2, seed=5)
    runs = {}
    for size in (1, 2):
        llm = LLM(folder, tensor_parallel_size=size, **ENGINE, **kwargs)
        try:
            greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            sampled = llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
            again = llm.generate(PROMPTS[:2], seeded, use_tqdm=False)
            constrained = llm.generate(PROMPTS[2:], CONSTRAINED, use_tqdm=False)  # the step's bitmask reaches both ranks
            scheduler = llm.engine.scheduler
            runs[size] = (
                greedy, sampled, again, scheduler.num_preemptions, scheduler.spec_stats.num_accepted_tokens,
                scheduler.get_stats().prefix_cache_hit_rate, constrained,
            )  # fmt: skip
        finally:
            llm.engine.model_executor.shutdown()
    return runs


def token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_two_ranks_give_one_ranks_tokens(tiny_model_dirs, family):
    runs = generate_both(str(tiny_model_dirs[family]))
    (greedy_1, sampled_1, *_, constrained_1), (greedy_2, sampled_2, again_2, preemptions_2, _, hit_rate_2, constrained_2) = runs[1], runs[2]
    assert_same_tokens_and_logprobs(greedy_1, greedy_2, abs_tol=LOGPROB_TOL)
    assert all(len(out.outputs[0].token_ids) == 12 for out in greedy_2)
    assert preemptions_2 > 0  # the few blocks did preempt: recompute gave the same tokens
    assert hit_rate_2 > 0.2  # the shared prefix was read from the cache
    assert token_ids(sampled_2) == token_ids(again_2)  # seeded sampling repeats under N = 2
    assert token_ids(sampled_2) == token_ids(sampled_1)  # and matches one rank's
    assert all(len(out.outputs) == 2 for out in sampled_2)
    assert token_ids(constrained_2) == token_ids(constrained_1)  # structured outputs: the mask on both ranks
    assert all(re.fullmatch(r"[a-c]{0,3}|[a-c]{3}(-[0-9]{0,2})*", out.outputs[0].text) for out in constrained_2)


@pytest.mark.slow
def test_two_ranks_with_ngram_speculation_give_one_ranks_tokens(tiny_model_dirs):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runs = generate_both(str(tiny_model_dirs["qwen3"]), speculative_config=spec)
    assert_same_tokens_and_logprobs(runs[1][0], runs[2][0], abs_tol=LOGPROB_TOL)
    assert token_ids(runs[2][1]) == token_ids(runs[2][2])
    assert runs[2][4] > 0 and runs[2][4] == runs[1][4]  # drafts were accepted, the same ones


@pytest.mark.slow
def test_two_ranks_with_async_speculation_give_one_ranks_tokens(tiny_model_dirs):
    """Async scheduling with n-gram drafts on two ranks: each rank's runner reads the step before
    back and proposes the drafts itself (``model_runner.py`` NOTE 14), the same on both, so the
    tokens are a synchronous one-rank engine's, preemptions and prefix hits included. Under a
    grammar the engine takes rank 0's drafts before it makes the mask (``take_draft_token_ids``)."""
    folder = str(tiny_model_dirs["qwen3"])
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    one = LLM(folder, **ENGINE)
    expected = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected_constrained = one.generate(PROMPTS[2:], CONSTRAINED, use_tqdm=False)
    two = LLM(folder, tensor_parallel_size=2, async_scheduling=True, speculative_config=spec, **ENGINE)
    try:
        got = two.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_same_tokens_and_logprobs(expected, got, abs_tol=LOGPROB_TOL)
        assert token_ids(two.generate(PROMPTS[2:], CONSTRAINED, use_tqdm=False)) == token_ids(expected_constrained)
        scheduler = two.engine.scheduler
        assert scheduler.spec_stats.num_accepted_tokens > 0 and scheduler.num_preemptions > 0
        two.engine.check_invariants()
    finally:
        two.engine.model_executor.shutdown()


@pytest.mark.slow
def test_two_ranks_pool_one_ranks_vectors(tiny_model_dirs):
    """A pooling engine on two ranks (MEAN through chunked prefill and the shared prefix's
    cache hits skipped; rank 0's vectors come back through the executor) gives one rank's
    vectors, within float32 rounding."""
    vectors = {}
    for size in (1, 2):
        llm = LLM(str(tiny_model_dirs["qwen3"]), tensor_parallel_size=size, runner="pooling",
                  pooler_config={"pooling_type": "MEAN"}, **ENGINE)  # fmt: skip
        try:
            vectors[size] = [o.outputs.data for o in llm.encode(PROMPTS, use_tqdm=False)]
        finally:
            llm.engine.model_executor.shutdown()
    for one, two in zip(vectors[1], vectors[2]):
        assert one.shape == two.shape == (one.shape[0],) and torch.allclose(one, two, atol=LOGPROB_TOL)


GRAPHS_ENGINE = dict(
    device="cpu", torch_threads=1, block_size=16, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
    attention_backend="triton",
)  # fmt: skip
GRAPHS_PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def one_rank_eager_outputs(tiny_model_dirs):
    """The reference of the per-mode test below: one rank, eager. It does not depend on the
    mode, so it runs once for the four modes, not once per mode."""
    eager = LLM(str(tiny_model_dirs["qwen3"]), **GRAPHS_ENGINE, enforce_eager=True)
    return eager.generate(PROMPTS[1:], GRAPHS_PARAMS, use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_two_ranks_under_each_emulated_cudagraph_mode(tiny_model_dirs, one_rank_eager_outputs, mode):
    """Full graphs need a backend that allows them: Triton, under its interpreter on the CPU
    (``conftest.py`` sets ``TRITON_INTERPRET=1``; the worker processes inherit it)."""
    folder = str(tiny_model_dirs["qwen3"])
    engine, params = GRAPHS_ENGINE, GRAPHS_PARAMS
    graphs = LLM(
        folder, tensor_parallel_size=2, **engine,
        compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4]},
    )  # fmt: skip
    try:
        assert graphs.startup_report.cudagraph_mode == mode
        assert_same_tokens_and_logprobs(
            one_rank_eager_outputs, graphs.generate(PROMPTS[1:], params, use_tqdm=False),
            abs_tol=LOGPROB_TOL,
        )  # fmt: skip
    finally:
        graphs.engine.model_executor.shutdown()


def test_async_llm_on_two_ranks_streams_one_ranks_tokens(tiny_model_dirs):
    """With async scheduling too (``async_scheduling=True``): each worker process keeps its
    steps in flight, and the executor reads the oldest back (``executor/abstract.py`` NOTE 4);
    a constrained request's steps take the third call, ``sample_tokens``, on both ranks."""
    folder = str(tiny_model_dirs["llama"])
    params = SamplingParams(max_tokens=6, temperature=0)
    requests = [(PROMPTS[2], params), (PROMPTS[3], params), (PROMPTS[3], CONSTRAINED)]
    one = LLM(folder, **ENGINE)
    expected = [list(one.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids) for prompt, p in requests]
    engine = AsyncLLM.from_engine_args(EngineArgs(folder, tensor_parallel_size=2, async_scheduling=True, **ENGINE))
    assert engine.engine.async_scheduling

    async def stream(i: int, prompt: dict, p: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(prompt, p, f"r{i}"):
            tokens = list(out.outputs[0].token_ids)
        return tokens

    async def main() -> list[list[int]]:
        try:
            return list(await asyncio.gather(*(stream(i, prompt, p) for i, (prompt, p) in enumerate(requests))))
        finally:
            await engine.shutdown()

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.engine.model_executor.shutdown()


def test_an_async_step_on_two_ranks_is_one_message_to_each_rank_and_gives_one_ranks_tokens(tiny_model_dirs):
    """Async scheduling on two ranks (``executor/step_replies.py``): a step writes one message
    to each rank and is read back with one reply from each, the launch's reply carrying the
    step before's output (a step whose mask waits for a token in flight: two messages, its
    forward and its sampling; a step that only reads back the last one: one, the flush). The
    tokens are a synchronous one-rank engine's, a constrained request's too, and a request
    aborted while its step is in flight leaves the others' tokens as they were."""
    folder = str(tiny_model_dirs["qwen3"])
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    requests = {"a": (PROMPTS[2], greedy), "b": (PROMPTS[3], greedy), "c": (PROMPTS[2], CONSTRAINED), "d": (PROMPTS[0], greedy)}
    one = LLM(folder, **ENGINE)
    expected = {rid: list(one.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids) for rid, (prompt, p) in requests.items()}
    two = LLM(folder, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    engine, executor = two.engine, two.engine.model_executor
    samples = []  # sample_tokens calls: a step whose sampling waited for its grammar mask
    sample_tokens = executor.sample_tokens
    executor.sample_tokens = lambda grammar_output: samples.append(1) or sample_tokens(grammar_output)
    finished, costs = {}, []  # per step: (messages to each rank, replies from each rank, samplings)

    def step() -> None:
        sent, read, sampled = list(executor.messages_sent), list(executor.replies_read), len(samples)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        costs.append((
            [n - m for n, m in zip(executor.messages_sent, sent)], [n - m for n, m in zip(executor.replies_read, read)],
            len(samples) - sampled,
        ))  # fmt: skip

    try:
        for rid in "ab":
            engine.add_request(rid, requests[rid][0]["prompt_token_ids"], greedy)
        for _ in range(8):
            step()
        assert engine.scheduler.requests["b"].num_output_placeholders  # its step is in flight
        finished |= {out.request_id: out for out in engine.abort_request("b")}
        while engine.has_unfinished_requests():
            step()
        decoding = costs[4:8]  # both prompts prefilled (16-token chunks), both requests decoding
        assert [(sent, read) for sent, read, _ in decoding] == [([1, 1], [1, 1])] * 4, costs
        for rid in "cd":
            engine.add_request(rid, requests[rid][0]["prompt_token_ids"], requests[rid][1])
        while engine.has_unfinished_requests():
            step()
        engine.check_invariants()
        assert sum(samples) > 0  # the constrained request's steps took the deferred path
        assert all(sent == [1 + sampled] * 2 for sent, _, sampled in costs), costs  # the flush at the end: one too
        assert finished["b"].outputs[0].finish_reason == "abort"
        assert {rid: list(out.outputs[0].token_ids) for rid, out in finished.items() if rid != "b"} == {
            rid: expected[rid] for rid in "acd"
        }
    finally:
        executor.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_ranks_sharing_one_gpu_over_gloo_give_one_ranks_tokens(tiny_model_dirs, monkeypatch):
    """NCCL wants a GPU per rank; a check machine has one, so two ranks share it over gloo
    (host copies, no CUDA graphs), as issue 38 asks. The KV cache is fixed (an override), so
    neither rank sizes it from memory the other holds."""
    monkeypatch.setenv("TINYVLLM_DISTRIBUTED_BACKEND", "gloo")  # the worker processes inherit it
    folder = str(tiny_model_dirs["qwen3"])
    engine = dict(device="cuda", block_size=16, max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=32,
                  enforce_eager=True, attention_backend="triton")  # fmt: skip
    one = LLM(folder, **engine)
    two = LLM(folder, tensor_parallel_size=2, **engine)
    try:
        assert len(two.engine.startup_reports) == 2
        assert all(r.device.startswith("cuda") for r in two.engine.startup_reports)  # both on the one GPU
        assert_same_tokens_and_logprobs(
            one.generate(PROMPTS, GREEDY, use_tqdm=False), two.generate(PROMPTS, GREEDY, use_tqdm=False),
            abs_tol=LOGPROB_TOL,
        )  # fmt: skip
    finally:
        two.engine.model_executor.shutdown()
