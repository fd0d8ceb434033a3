"""Speculative decoding on a GPU (``gpu`` marker; skipped without CUDA): the twin of
``test_spec_decode.py``'s whole-workload test with real ``torch.cuda.CUDAGraph`` capture and
the compiled Triton kernels. Nothing of speculative decoding has run on a GPU before.

Criterion: float32, greedy: every request that is not aborted gets exactly the tokens of
an engine without speculation and without graphs, through chunked prefill, preemption,
prefix hits and an abort with drafts in flight; the engine's copies of each request agree
after every step (``LLMEngine.check_invariants``); a verification step of 1 + k tokens
per request replays a FULL graph under FULL_DECODE_ONLY and FULL_AND_PIECEWISE, and so does
a step in which no request has drafts (the FULL graph of 1 token per request).
"""

from __future__ import annotations

import pytest
import torch

from spec_workload import LOOP, PROMPTS, SPEC, run_rounds_with_an_abort
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import CUDAGraphMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

COMMON = dict(device="cuda", dtype="float32", attention_backend="triton", block_size=16, max_num_seqs=4,
              max_num_batched_tokens=12, num_gpu_blocks_override=6, max_model_len=96, enable_prefix_caching=True)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), enforce_eager=True, **COMMON)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_gpu_spec_decode_whole_workload_equals_greedy_without(tiny_model_dirs, expected, mode):
    config = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 12, 16]}
    llm = LLM(str(tiny_model_dirs["qwen3"]), speculative_config=SPEC, compilation_config=config, **COMMON)
    engine, runner = llm.engine, llm.engine.model_runner
    assert runner.cudagraph_mode == CUDAGraphMode[mode] and not runner.emulate_cudagraphs
    dispatches = []
    run_rounds_with_an_abort(engine, GREEDY, expected, on_step=lambda e: dispatches.append(e.model_runner.last_dispatch))
    scheduler = engine.scheduler
    assert scheduler.spec_stats.num_accepted_tokens > 0, "no draft was ever kept"
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    # a step without drafts (one token per request, at most 4: a capture size) replays the
    # FULL graph of 1 token per request (cudagraph_dispatcher.py NOTE 4)
    draftless = [d for d in dispatches if d is not None and d.num_tokens == d.num_reqs]
    assert draftless, "the workload had no step without drafts"
    assert all((d.runtime_mode, d.batch_descriptor.uniform_query_len) == (CUDAGraphMode.FULL, 1) for d in draftless), draftless


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_gpu_spec_decode_verification_steps_replay_full_graphs(tiny_model_dirs, mode):
    """One request whose text loops: after its prefill every step verifies 3 drafts, a
    uniform batch of 1 + 3 tokens, which must replay the FULL graph of that key; then the
    same request sampled with a seed, twice: the same tokens, and a logprob for each."""
    folder = str(tiny_model_dirs["qwen3"])
    common = {**COMMON, "max_num_batched_tokens": 64}  # one request: the 6 blocks of COMMON hold it
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(folder, enforce_eager=True, **common).generate({"prompt_token_ids": LOOP}, params, use_tqdm=False)
    config = {"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    llm = LLM(folder, speculative_config=SPEC, compilation_config=config, **common)
    spec = llm.generate({"prompt_token_ids": LOOP}, params, use_tqdm=False)
    assert spec[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    runner = llm.engine.model_runner
    replayed = {key: e.num_replays for key, e in runner.full_graph.entries.items() if e.num_replays > 0}
    assert any(key.uniform and key.num_tokens == key.num_reqs * 4 for key in replayed), (
        f"no FULL graph of uniform 1 + 3 token queries was replayed: {replayed}"
    )
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    # What only a GPU can break in the sampler: seeded random verification on the device (each
    # row draws its token there, from a CUDA generator seeded with its draw key) and the kept
    # drafts' logprobs; and the seeded stream with drafts is the stream without them.
    # At temperature 0.2 the text still loops often enough for drafts (10 on the CPU, 6 kept).
    drafts_before = stats.num_drafts
    sampled = SamplingParams(temperature=0.2, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)
    first, again = (llm.generate({"prompt_token_ids": LOOP}, sampled, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert first.token_ids == again.token_ids and len(first.logprobs) == len(first.token_ids) == 24
    without = LLM(folder, enforce_eager=True, **common)  # no drafts, no graphs: the same draws
    assert without.generate({"prompt_token_ids": LOOP}, sampled, use_tqdm=False)[0].outputs[0].token_ids == first.token_ids
    assert stats.num_drafts > drafts_before, "no draft was verified while sampling"
