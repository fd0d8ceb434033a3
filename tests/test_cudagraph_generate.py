"""CUDA graphs in the engine, against eager execution (seed 000), on the CPU.

Emulated graphs (``CUDAGraphWrapper(emulate=True)``) check on every replay what a real graph
silently assumes (same buffers, same shapes, same Python values, no host reads), so these
tests exercise the whole path in CI: dispatch, padding of tokens and requests, persistent
buffers, capture at start-up, replay. For the tiny Qwen3, Qwen2 and Llama models, greedy
output under each of the five modes equals NONE's on a workload that mixes prefill chunks
and decodes, preempts, and shares prefixes. The reference backend shows the NEVER
downgrade; the Triton backend (under the interpreter) really runs FULL and PIECEWISE steps.
The ``gpu`` twins with real graphs are in ``test_cudagraph_gpu.py``."""

import functools
import logging

import pytest
import torch
from test_generate import NEW_TOKENS, PROMPTS  # the central test's workload: shared prefixes, a 1-token prompt

from tinyvllm import LLM, SamplingParams
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode

M = CUDAGraphMode
MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
# Budget 16 forces chunked prefill; 5 blocks of 16 for 4 running requests force a preemption.
ENGINE = dict(device="cpu", max_model_len=64, block_size=16, max_num_batched_tokens=16, max_num_seqs=4,
              num_gpu_blocks_override=5)  # fmt: skip
SIZES = [1, 2, 4, 8, 16]


def run(folder, backend, mode, **extra):
    llm = LLM(str(folder), attention_backend=backend,
              compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": SIZES}, **ENGINE, **extra)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@functools.cache
def eager_tokens(folder, backend):
    llm, tokens = run(folder, backend, "NONE")
    assert llm.engine.scheduler.num_preemptions > 0, "the workload must preempt"
    assert llm.engine.model_runner.cudagraph_stats == {M.NONE: sum(llm.engine.model_runner.cudagraph_stats.values())}
    return tokens


def check_clean(llm):
    scheduler = llm.engine.scheduler
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_gpu_blocks
    llm.engine.check_invariants()  # the scheduler, the runner (its graph wrappers too), their copies


@pytest.mark.seed("000:cgsupport", "000:usage")
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("mode", MODES)
def test_cudagraph_reference_backend_equals_eager_and_downgrades(tiny_model_dirs, family, mode):
    """The reference backend reads lengths on the host: AttentionCGSupport.NEVER, so every
    FULL-containing mode runs as PIECEWISE, and the tokens are NONE's."""
    folder = tiny_model_dirs[family]
    llm, tokens = run(folder, "reference", mode)
    assert tokens == eager_tokens(folder, "reference")
    runner = llm.engine.model_runner
    expected = M.NONE if mode == "NONE" else M.PIECEWISE
    assert runner.cudagraph_mode == expected
    stats = runner.cudagraph_stats
    assert M.FULL not in stats
    if expected == M.PIECEWISE:
        assert stats[M.PIECEWISE] > 0, f"no PIECEWISE step ran: {dict(stats)}"
    check_clean(llm)


EXPECTED_TRITON_STEPS = {  # which runtime modes must really happen on this workload
    "NONE": {M.NONE},
    "PIECEWISE": {M.PIECEWISE},
    "FULL": {M.FULL},
    "FULL_DECODE_ONLY": {M.FULL, M.NONE},
    "FULL_AND_PIECEWISE": {M.FULL, M.PIECEWISE},
}


@pytest.mark.seed("000:nested", "000:capture")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
def test_cudagraph_triton_backend_equals_eager_with_real_full_and_piecewise_steps(tiny_model_dirs, mode):
    folder = tiny_model_dirs["qwen3"]
    llm, tokens = run(folder, "triton", mode)
    assert tokens == eager_tokens(folder, "triton")
    runner = llm.engine.model_runner
    assert runner.cudagraph_mode == M[mode]  # Triton is ALWAYS: no downgrade
    stats = {m for m, n in runner.cudagraph_stats.items() if n}
    assert EXPECTED_TRITON_STEPS[mode] <= stats, f"{mode}: steps ran as {dict(runner.cudagraph_stats)}"
    if runner.full_graph is not None:
        assert runner.full_graph.entries, "no FULL graph was captured"
        assert all(e.num_replays >= 0 for e in runner.full_graph.entries.values())
    check_clean(llm)


@pytest.mark.seed("000:nested")
@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.slow
def test_cudagraph_triton_full_and_piecewise_other_families(tiny_model_dirs, family):
    folder = tiny_model_dirs[family]
    llm, tokens = run(folder, "triton", "FULL_AND_PIECEWISE")
    assert tokens == eager_tokens(folder, "triton")
    assert llm.engine.model_runner.cudagraph_stats[M.FULL] > 0


def test_cudagraph_triton_matches_reference_backend(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    assert eager_tokens(folder, "triton") == eager_tokens(folder, "reference")


@pytest.mark.seed("000:capture")
@pytest.mark.slow
def test_cudagraph_seeded_sampling_is_the_same_under_graphs(tiny_model_dirs):
    folder = str(tiny_model_dirs["qwen3"])
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=11, ignore_eos=True)
    results = []
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        llm = LLM(folder, attention_backend="triton",
                  compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": SIZES}, **ENGINE)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
    assert results[0] == results[1]


@pytest.mark.seed("000:capture")
def test_cudagraph_capture_writes_nothing_to_the_kv_cache(tiny_model_dirs):
    """Capture runs dummy batches whose KV writes all go to PAD_SLOT_ID."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), attention_backend="triton",
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 4]}, **ENGINE)  # fmt: skip
    runner = llm.engine.model_runner
    assert all(bool((kv == 0).all()) for kv in runner.kv_caches)
    dispatcher_keys = {d for keys in runner.dispatcher.cudagraph_keys.values() for d in keys}
    assert set(runner.full_graph.entries) == runner.dispatcher.cudagraph_keys[M.FULL]
    for piece in runner.model.pieces:
        assert set(piece.entries) == runner.dispatcher.cudagraph_keys[M.PIECEWISE]
    assert len(dispatcher_keys) == 2 + 2  # PIECEWISE (1), (4); FULL uniform (1, 1), (4, 4)
    assert runner.cudagraph_stats == {}  # dummy runs are not steps


@pytest.mark.seed("000:capture")
def test_cudagraph_replay_catches_a_runner_that_builds_fresh_tensors(tiny_model_dirs, monkeypatch):
    """The bug that is silent on a GPU: handing the graph new tensors instead of writing the
    persistent buffers. The emulated FULL graph names the argument."""
    from tinyvllm.worker.input_buffers import InputBuffers

    llm = LLM(str(tiny_model_dirs["qwen3"]), attention_backend="triton",
              compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]}, **ENGINE)  # fmt: skip
    fill = InputBuffers.fill

    def fresh(self, *args, **kwargs):
        input_ids, metadata, fed = fill(self, *args, **kwargs)
        return input_ids.clone(), metadata, fed

    monkeypatch.setattr(InputBuffers, "fill", fresh)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(RuntimeError, match="FULL graph for .*argument input_ids changed since capture"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)


@pytest.mark.seed("000:cgsupport")
def test_cudagraph_reference_backend_cannot_be_captured_whole(tiny_model_dirs, monkeypatch):
    """Why the reference backend declares NEVER: forced into a FULL graph, its host reads
    fail at capture, as they would on a GPU."""
    from tinyvllm.attention.cudagraph_support import AttentionCGSupport
    from tinyvllm.models import llama

    backend = llama.ATTENTION_BACKENDS["reference"]
    monkeypatch.setitem(llama.ATTENTION_BACKENDS, "reference", type(backend)(
        backend.write_kv_cache, backend.paged_attention, AttentionCGSupport.ALWAYS))  # fmt: skip
    with pytest.raises(RuntimeError, match="reads a tensor's value on the host"):
        LLM(str(tiny_model_dirs["qwen3"]), attention_backend="reference",
            compilation_config={"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [2]}, **ENGINE)  # fmt: skip


@pytest.mark.seed("000:usage")
def test_cudagraph_api_defaults_and_enforce_eager(tiny_model_dirs, caplog):
    folder = str(tiny_model_dirs["qwen3"])
    llm = LLM(folder, **ENGINE)
    assert llm.engine.model_runner.cudagraph_mode == M.NONE  # the CPU default
    assert llm.engine.model_runner.full_graph is None
    llm = LLM(folder, compilation_config={"cudagraph_mode": "PIECEWISE"}, enforce_eager=True, **ENGINE)
    assert llm.engine.model_runner.cudagraph_mode == M.NONE
    with caplog.at_level(logging.WARNING):
        llm = LLM(folder, compilation_config={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 32]},
                  **ENGINE)  # fmt: skip
    assert "CUDA graphs are emulated" in caplog.text
    assert "1 cudagraph capture sizes exceed max_num_batched_tokens (or max_num_seqs * max_model_len) = 16" in caplog.text
    assert "are dropped: [32]" in caplog.text
    assert llm.engine.model_runner.dispatcher.capture_sizes == [1]


@pytest.mark.seed("000:usage")
@pytest.mark.parametrize(
    "config, message",
    [
        ({"cudagraph_mod": "FULL"}, r"unknown keys \['cudagraph_mod'\]"),
        ({"cudagraph_mode": "full"}, "cudagraph_mode must be one of .*got 'full'"),
        ({"cudagraph_mode": 2}, "cudagraph_mode must be one of"),
        ({"cudagraph_capture_sizes": [0, 4]}, "every cudagraph_capture_sizes entry must be an int >= 1, got 0"),
        ({"cudagraph_capture_sizes": []}, "must not be empty"),
        ({"cudagraph_capture_sizes": "1,2"}, "must be a list of ints"),
        ({"max_cudagraph_capture_size": -1}, "max_cudagraph_capture_size must be an int >= 1"),
    ],
)
def test_cudagraph_bad_compilation_config_is_a_value_error(tiny_model_dirs, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dirs["qwen3"]), compilation_config=config, **ENGINE)


def test_cudagraph_compilation_config_and_enforce_eager_of_the_wrong_type_are_type_errors(tiny_model_dirs):
    with pytest.raises(TypeError, match="compilation_config must be a dict, a CompilationConfig or None, got 'FULL'"):
        LLM(str(tiny_model_dirs["qwen3"]), compilation_config="FULL", **ENGINE)
    with pytest.raises(TypeError, match="enforce_eager must be a bool, got 'yes'"):
        LLM(str(tiny_model_dirs["qwen3"]), enforce_eager="yes", **ENGINE)


@pytest.mark.seed("000:dispatcher")
def test_cudagraph_padding_rows_do_not_change_real_rows(tiny_model_dirs):
    """A batch run padded (as under a graph) and unpadded gives the same hidden states for
    the real rows: padding rows belong to no request."""
    from tinyvllm.worker.attention_metadata import build_attention_metadata
    from tinyvllm.worker.kv_cache import allocate_kv_caches

    llm = LLM(str(tiny_model_dirs["qwen3"]), attention_backend="triton", **ENGINE)
    model, spec = llm.model, llm.spec
    ids = [5, 6, 7, 8, 9]
    results = []
    for pad_tokens, pad_reqs in ((0, None), (3, 4)):
        caches = allocate_kv_caches(spec.num_hidden_layers, 2, 16, spec.num_key_value_heads, spec.head_dim,
                                    torch.float32, "cpu")  # fmt: skip
        md = build_attention_metadata([0, 0], [3, 2], [[0], [1]], 16, num_padded_tokens=5 + pad_tokens,
                                      num_padded_reqs=pad_reqs)  # fmt: skip
        with torch.inference_mode():
            hidden = model(torch.tensor(ids + [0] * pad_tokens), md.positions, caches, md)
        results.append((hidden[:5], caches))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)  # GEMM blocking may differ
    written = torch.zeros(2, 16, dtype=torch.bool)  # [B, S]: request 0 at block 0 slots 0-2, request 1 at block 1 slots 0-1
    written[0, :3] = written[1, :2] = True
    for unpadded, padded in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(unpadded, padded, rtol=1e-5, atol=1e-5)
        assert not padded[:, ~written].any(), "padding rows wrote to the KV cache"


@pytest.mark.seed("000:usage")
def test_cudagraph_capture_sizes_are_limited_by_what_a_step_can_hold():
    from tinyvllm.config import CompilationConfig
    from tinyvllm.worker.cudagraph_capture import resolve_capture_sizes

    default = CompilationConfig()
    assert resolve_capture_sizes(default, max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=64) == [1, 2, 4, 8]
    sizes = resolve_capture_sizes(default, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and len(sizes) == 51  # vLLM's default list
    config = CompilationConfig(cudagraph_capture_sizes=(1, 64, 300))
    assert resolve_capture_sizes(config, max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=64) == [1, 64]
    assert resolve_capture_sizes(config, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64) == [1]
    capped = CompilationConfig(max_cudagraph_capture_size=16)
    assert resolve_capture_sizes(capped, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=64) == [1, 2, 4, 8, 16]


def test_cudagraph_release_unwraps_the_pieces(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), compilation_config={"cudagraph_mode": "PIECEWISE",
              "cudagraph_capture_sizes": [2]}, **ENGINE)  # fmt: skip
    runner = llm.engine.model_runner
    assert all(hasattr(p, "entries") for p in llm.model.pieces)
    llm.engine.model_executor.driver_worker.release_cudagraphs()  # the worker owns the wrapping
    assert not any(hasattr(p, "entries") for p in llm.model.pieces) and runner.full_graph is None
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
    assert set(runner.cudagraph_stats) == {M.NONE}


@pytest.mark.slow
def test_a_full_modes_mixed_graph_plans_decode_like_its_uniform_graph(tiny_model_dirs, monkeypatch):
    """``FULL`` mode has no uniform decode keys: a decode replays the mixed key of its size. A
    mixed key of at most ``max_num_seqs`` tokens is captured on one token per request
    (``cudagraph_capture.py`` NOTE 2), so its attention plan (grid, tiles, split) is the one
    ``FULL_AND_PIECEWISE`` captures for the uniform key of that size; past ``max_num_seqs``
    the mixed key holds longer requests and plans like a prefill."""
    from tinyvllm.attention import triton_attention
    from tinyvllm.worker import cudagraph_capture

    plans, capturing = {}, []
    real_plan, real_dummy = triton_attention.plan_step, cudagraph_capture.dummy_run

    def plan_step(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        if capturing:
            plans.setdefault(capturing[-1], (plan.grid, plan.constexprs))
        return plan

    def dummy_run(runner, mode, desc):
        capturing.append((mode, desc))
        try:
            real_dummy(runner, mode, desc)
        finally:
            capturing.pop()

    monkeypatch.setattr(triton_attention, "plan_step", plan_step)
    monkeypatch.setattr(cudagraph_capture, "dummy_run", dummy_run)
    by_mode = {}
    for mode, max_num_seqs in (("FULL", 8), ("FULL_AND_PIECEWISE", 8), ("FULL", 2)):
        plans.clear()
        LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=64, attention_backend="triton",
            max_num_seqs=max_num_seqs, compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8]})  # fmt: skip
        by_mode[mode, max_num_seqs] = {desc: plan for (runtime, desc), plan in plans.items() if runtime == M.FULL}
    full, uniform = by_mode["FULL", 8], by_mode["FULL_AND_PIECEWISE", 8]
    assert sorted(d.num_tokens for d in full) == sorted(d.num_tokens for d in uniform) == [1, 2, 4, 8]
    for desc, plan in full.items():
        assert not desc.uniform and desc.num_reqs == desc.num_tokens
        [twin] = [p for d, p in uniform.items() if d.uniform and d.num_tokens == desc.num_tokens]
        assert plan == twin, desc  # the same grid and constexprs: one decode plan
    few_seqs = {d.num_tokens: p for d, p in by_mode["FULL", 2].items()}  # keys (4, 2) and (8, 2): prompt rows
    assert few_seqs[8] != full[next(d for d in full if d.num_tokens == 8)]
    assert few_seqs[8][1]["STEP_KV"] is True and few_seqs[8][0][2] == 1  # the step's rows, no split: a prefill plan
