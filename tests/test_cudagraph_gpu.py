"""CUDA graphs on a GPU (``gpu`` marker; skipped without CUDA): the twins of
``test_cudagraph_generate.py`` with real ``torch.cuda.CUDAGraph``s.

Criterion: greedy tokens under every mode equal NONE's (float32), and the logits of every
step equal eager ones within a stated tolerance. Why a tolerance at all: a graph replays the
same kernels as eager execution, but on the padded batch; cuBLAS may pick another GEMM
algorithm for 8 rows than for 5, so real rows can differ in the last bits. float32:
``atol = rtol = 1e-4`` on the logits; bfloat16: 2% of each row's logit range.
"""

import functools
import gc

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

M = CUDAGraphMode
MODES = ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
PROMPTS = [[(31 * i + 7) % 500 + 3 for i in range(n)] for n in (5, 17, 40, 63, 100)]
PROMPTS.append(PROMPTS[3][:30] + [11, 12, 13])
NEW_TOKENS = 12


def run_recording_logits(folder, mode, dtype, **kw):
    llm = LLM(str(folder), dtype=dtype, device="cuda", max_model_len=256, attention_backend="triton",
              gpu_memory_utilization=0.3, max_num_seqs=8, max_num_batched_tokens=64,
              compilation_config={"cudagraph_mode": mode, "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]},
              **kw)  # fmt: skip
    logits_per_step = []
    runner = llm.engine.model_runner
    sampler = runner.sampler  # what it gets: a FULL graph's logits come out of the graph (cudagraph_capture.py NOTE 4)

    def recording(logits, metadata):
        logits_per_step.append(logits.detach().float().cpu())  # [R, V]
        return sampler(logits, metadata)

    runner.sampler = recording
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], logits_per_step


@functools.cache
def eager_run(folder, dtype: str) -> tuple[list, list]:
    """NONE's tokens and logits, once per model and dtype (each mode's test compares with them):
    the GPU check's test budget pays for one eager engine per family, not one per mode."""
    llm, tokens, logits = run_recording_logits(folder, "NONE", dtype)
    del llm  # its KV cache goes before the next engine sizes its own
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logits


@pytest.mark.seed("000:motivation", "000:capture")
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_cudagraph_float32_tokens_and_logits_equal_eager(tiny_model_dirs, family, mode):
    folder = tiny_model_dirs[family]
    eager_tokens, eager_logits = eager_run(folder, "float32")
    llm, tokens, logits = run_recording_logits(folder, mode, "float32")
    assert tokens == eager_tokens
    assert len(logits) == len(eager_logits)
    for step, (a, b) in enumerate(zip(logits, eager_logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")
    runner = llm.engine.model_runner
    assert runner.cudagraph_mode == M[mode] and not runner.emulate_cudagraphs
    assert runner.cudagraph_stats[M.FULL if M[mode].has_full_cudagraphs() else M.PIECEWISE] > 0
    wrappers = ([runner.full_graph] if runner.full_graph else []) + [p for p in runner.model.pieces if hasattr(p, "entries")]
    assert wrappers and all(isinstance(e.graph, torch.cuda.CUDAGraph) for w in wrappers for e in w.entries.values())


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_gpu_cudagraph_bfloat16_logits_close_to_eager(tiny_model_dirs, family):
    folder = tiny_model_dirs[family]
    _, eager_logits = eager_run(folder, "bfloat16")
    _, _, logits = run_recording_logits(folder, "FULL_AND_PIECEWISE", "bfloat16")
    # Compare the first step (identical inputs: the prompts); later steps may follow other tokens.
    a, b = logits[0], eager_logits[0]
    spread = (b.max(dim=-1).values - b.min(dim=-1).values)[:, None]  # [R, 1]
    assert ((a - b).abs() <= 0.02 * spread).all(), f"max diff {(a - b).abs().max():.4f}"


def test_gpu_cudagraph_replay_refuses_fresh_tensors(tiny_model_dirs, monkeypatch):
    from tinyvllm.worker.input_buffers import InputBuffers

    llm = LLM(str(tiny_model_dirs["qwen3"]), dtype="float32", device="cuda", max_model_len=64,
              attention_backend="triton", gpu_memory_utilization=0.3, max_num_seqs=4,
              compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]})  # fmt: skip
    fill = InputBuffers.fill
    monkeypatch.setattr(InputBuffers, "fill", lambda self, *a, **k: (lambda ids, md, fed: (ids.clone(), md, fed))(*fill(self, *a, **k)))
    with pytest.raises(RuntimeError, match="argument input_ids changed since capture"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)


@pytest.mark.seed("000:capture")
def test_gpu_cudagraph_memory_is_counted_in_the_kv_budget(tiny_model_dirs):
    folder = str(tiny_model_dirs["qwen3"])
    common = dict(dtype="float32", device="cuda", max_model_len=256, attention_backend="triton",
                  gpu_memory_utilization=0.3, max_num_seqs=64)  # fmt: skip
    eager = LLM(folder, enforce_eager=True, **common)
    eager_blocks = eager.engine.scheduler.kv_cache_manager.num_gpu_blocks
    assert eager.cudagraph_memory_bytes == 0
    del eager
    torch.cuda.empty_cache()
    graphs = LLM(folder, **common)  # default on CUDA: FULL_AND_PIECEWISE
    assert graphs.engine.model_runner.cudagraph_mode == M.FULL_AND_PIECEWISE
    assert graphs.cudagraph_memory_bytes > 0, "graph memory was not measured"
    assert graphs.engine.scheduler.kv_cache_manager.num_gpu_blocks <= eager_blocks


@pytest.mark.seed("000:capture")
@torch.inference_mode()
def test_gpu_cudagraph_capture_sizes_share_the_pool_and_replays_stay_right():
    """``cuda_graph.py`` NOTE 5 on a real GPU, on a chain shaped like the model's pieces (each
    piece allocates the buffer an eager op between pieces writes): captured at 32 sizes, the
    pool holds about what the largest size needs, not every piece's outputs of every size;
    and replaying the sizes in a shuffled order afterwards still gives eager's results."""
    from tinyvllm.worker.cuda_graph import CUDAGraphWrapper, set_forward_context
    from tinyvllm.worker.cudagraph_dispatcher import BatchDescriptor

    torch.manual_seed(0)
    width, sizes = 1024, list(range(64, 2049, 64))  # 32 sizes, 33,792 tokens in all
    weights = [torch.randn(width, width, device="cuda") / width**0.5 for _ in range(3)]
    pool = torch.cuda.graph_pool_handle()

    def first(inp):
        h = inp @ weights[0]  # [S, width]
        return h, torch.empty_like(h)

    def middle(i, h, out):
        h = h + torch.tanh(out @ weights[i])
        return h, torch.empty_like(h)

    def last(h, out):
        return h + out

    runnables = [first, lambda h, out: middle(1, h, out), lambda h, out: middle(2, h, out), last]
    pieces = [CUDAGraphWrapper(r, M.PIECEWISE, pool=pool) for r in runnables]
    owned_bytes_per_token = (2 + 2 + 2 + 1) * width * 4  # every piece's outputs, float32

    def forward(inp):
        h, out = pieces[0](inp)
        for piece in pieces[1:-1]:
            torch.mul(h, 0.5, out=out)  # eager between pieces, like attention writing its output
            h, out = piece(h, out)
        torch.mul(h, 0.5, out=out)
        return pieces[-1](h, out)

    inputs = torch.randn(sizes[-1], width, device="cuda")  # the static input buffer
    for size in sizes:
        forward(inputs[:size])  # warm-up: eager (no context), as the runner does
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for size in reversed(sizes):  # largest first, as the runner captures
        with set_forward_context(M.PIECEWISE, BatchDescriptor(size)):
            forward(inputs[:size])
    torch.cuda.synchronize()
    pool_bytes = torch.cuda.memory_reserved() - before
    owned_bytes = owned_bytes_per_token * sum(sizes)  # about 968 MB had the entries owned them
    assert pool_bytes < owned_bytes / 4, f"the graphs hold {pool_bytes / 2**20:.0f} MiB"

    shuffled = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(1)).tolist()
    for size in (sizes[i] for i in shuffled):
        inputs.copy_(torch.randn_like(inputs))
        expected = forward(inputs[:size]).clone()  # eager
        with set_forward_context(M.PIECEWISE, BatchDescriptor(size)):
            replayed = forward(inputs[:size])
        torch.testing.assert_close(replayed, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_a_full_decode_step_sends_its_inputs_up_in_one_copy(tiny_model_dirs, async_scheduling):
    """The twin of ``test_a_full_decode_step_dispatches_few_ops_besides_its_graph``, counted by
    the profiler: a greedy decode step that replays a FULL graph launches the graph once, copies
    its inputs up once (``input_buffers.py`` NOTE 3) and launches no LM head (``cudagraph_capture.py``
    NOTE 4): besides the graph, only the sampler's few kernels and the feed of the last ids."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    llm = LLM(str(tiny_model_dirs["qwen3"]), dtype="float32", device="cuda", max_model_len=256,
              attention_backend="triton", gpu_memory_utilization=0.3, max_num_seqs=4,
              async_scheduling=async_scheduling,
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8]})  # fmt: skip
    engine, runner = llm.engine, llm.engine.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):  # past the prefill and the first decode step (it feeds nothing yet)
        engine.step()
    steps = 5
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
            assert runner.last_dispatch.runtime_mode == M.FULL and runner.last_dispatch.num_reqs == 4
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events())
    assert names["cudaGraphLaunch"] == steps, names
    assert sum(n for name, n in names.items() if name.startswith("Memcpy HtoD")) == steps, names
    launches = sum(n for name, n in names.items() if "LaunchKernel" in name)
    assert launches <= 8 * steps, names
