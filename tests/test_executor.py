"""The executor -> worker -> runner seam (``executor/``, ``worker/worker.py``): the engine
reaches the device only through ``Executor``, every call of which is written on
``collective_rpc``; the worker sizes the KV cache (the CPU's byte budget, or the override's
bytes), allocates the blocks the engine chose, builds the runner and wraps the model's pieces."""

from __future__ import annotations

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.config import CacheConfig, CompilationConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from tinyvllm.executor.abstract import initialize_kv_caches
from tinyvllm.executor.uniproc_executor import UniProcExecutor
from tinyvllm.models.loader import load_model_spec
from tinyvllm.worker.cuda_graph import CUDAGraphWrapper
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode
from tinyvllm.worker.kv_cache import CPU_KV_CACHE_BYTES
from tinyvllm.worker.worker import Worker

BLOCK_SIZE = 4


def engine_config(folder, override=None, mode=CUDAGraphMode.NONE) -> EngineConfig:
    spec = load_model_spec(folder)
    return EngineConfig(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=BLOCK_SIZE),
        compilation_config=CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=(1, 2, 4)),
        model_config=ModelConfig(model=str(folder), spec=spec, dtype="float32", attention_backend="torch"),
        device_config=DeviceConfig(device="cpu", num_gpu_blocks_override=override),
    )


@pytest.fixture(scope="module")
def qwen3(tiny_model_dirs):
    return tiny_model_dirs["qwen3"]


def test_collective_rpc_runs_on_the_one_worker_and_returns_a_list(qwen3):
    executor = UniProcExecutor(engine_config(qwen3, override=20), eos_token_id=7)
    assert isinstance(executor.driver_worker, Worker) and executor.driver_worker.model is not None  # loaded
    assert executor.collective_rpc(lambda worker: (worker.device.type, worker.eos_token_id)) == [("cpu", 7)]
    per_block = executor.driver_worker.kv_bytes_per_block()
    spec = load_model_spec(qwen3)  # 2 (K and V) x layers x block x kv heads x head dim x 4 bytes
    assert per_block == 2 * spec.num_hidden_layers * BLOCK_SIZE * spec.num_key_value_heads * spec.head_dim * 4
    assert executor.collective_rpc("kv_bytes_per_block") == [per_block]
    assert executor.collective_rpc(lambda worker, a, b=0: a + b, args=(2,), kwargs={"b": 3}) == [5]


def test_available_memory_is_the_cpu_budget_or_the_overrides_bytes(qwen3):
    executor = UniProcExecutor(engine_config(qwen3))
    assert executor.determine_available_memory() == [CPU_KV_CACHE_BYTES]
    overridden = UniProcExecutor(engine_config(qwen3, override=20))
    assert overridden.determine_available_memory() == [20 * overridden.driver_worker.kv_bytes_per_block()]
    assert overridden.driver_worker.cudagraph_memory_bytes == 0  # nothing measured off a GPU


def test_initialize_kv_caches_fills_the_blocks_and_builds_a_runner_over_them(qwen3):
    config = engine_config(qwen3, override=20)
    executor = UniProcExecutor(config)
    worker = executor.driver_worker
    assert worker.model_runner is None and worker.startup_report is None  # until the cache exists
    sized = initialize_kv_caches(executor, config)
    assert config.cache_config.num_gpu_blocks is None and sized.cache_config.num_gpu_blocks == 20
    runner = worker.model_runner
    assert [tuple(t.shape[:3]) for t in runner.kv_caches] == [(2, 20, BLOCK_SIZE)] * len(runner.kv_caches)
    assert worker.startup_report.num_kv_blocks == 20 and worker.startup_report.cudagraph_mode == "NONE"


def test_without_an_override_the_cpu_budget_is_capped_at_what_max_num_seqs_can_use(qwen3):
    config = engine_config(qwen3)
    sized = initialize_kv_caches(UniProcExecutor(config), config)
    assert sized.cache_config.num_gpu_blocks == 4 * 64 // BLOCK_SIZE  # 4 requests of 64 tokens (kv_cache.py NOTE 1)


def test_the_worker_wraps_the_models_pieces_and_unwraps_them_on_release(qwen3):
    config = engine_config(qwen3, override=20, mode=CUDAGraphMode.PIECEWISE)
    executor = UniProcExecutor(config)
    initialize_kv_caches(executor, config)
    worker = executor.driver_worker
    assert worker.model_runner.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert all(isinstance(p, CUDAGraphWrapper) and p.entries for p in worker.model.pieces)  # captured
    worker.check_invariants()
    worker.release_cudagraphs()
    assert not any(isinstance(p, CUDAGraphWrapper) for p in worker.model.pieces)
    assert worker.model_runner.cudagraph_mode == CUDAGraphMode.NONE and worker.model_runner.full_graph is None
    worker.check_invariants()


def test_worker_check_invariants_names_pieces_that_do_not_match_the_mode(qwen3):
    config = engine_config(qwen3, override=20, mode=CUDAGraphMode.PIECEWISE)
    executor = UniProcExecutor(config)
    initialize_kv_caches(executor, config)
    worker = executor.driver_worker
    worker.model.pieces = [p.runnable for p in worker.model.pieces]  # unwrapped behind the runner's back
    with pytest.raises(AssertionError, match="the model's pieces wrapped .* the runner's mode is PIECEWISE"):
        executor.check_invariants()


def test_check_health_raises_after_shutdown_and_so_does_every_call(qwen3):
    config = engine_config(qwen3, override=20)
    executor = UniProcExecutor(config)
    initialize_kv_caches(executor, config)
    executor.check_health()  # healthy: no error
    executor.shutdown()
    assert executor.driver_worker.model_runner is None  # the runner and its KV cache are dropped
    with pytest.raises(RuntimeError, match="the executor is shut down"):
        executor.check_health()
    with pytest.raises(RuntimeError, match="the executor is shut down"):
        executor.collective_rpc("check_invariants")
    executor.shutdown()  # a second call does nothing


def test_the_engine_steps_through_its_executor(qwen3):
    llm = LLM(str(qwen3), device="cpu", max_model_len=64, block_size=BLOCK_SIZE, num_gpu_blocks_override=20)
    executor = llm.engine.model_executor
    assert isinstance(executor, UniProcExecutor)
    assert llm.engine.model_runner is executor.driver_worker.model_runner  # the test-only accessor
    assert str(llm.config.model_config.model) == str(qwen3) and llm.config.device_config.device == "cpu"
    calls = []
    execute = executor.execute_model
    executor.execute_model = lambda out: calls.append(out) or execute(out)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3 and len(calls) == 3  # one prefill step, two decode steps
    llm.engine.check_invariants()


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_del_llm_frees_the_model_at_once_without_a_collection(qwen3, mode):
    """The model keeps its forward's pieces (``models/llama.py`` NOTE 5), and the worker wraps
    them in graph wrappers: were a piece a bound method of the model, model and pieces would
    form a cycle, and ``del llm`` would free the weights (GPU memory) only at the next
    collection. With the collector off, dropping the last reference frees the model at once,
    under eager pieces and under (emulated) piecewise graphs alike."""
    import gc
    import weakref

    llm = LLM(str(qwen3), device="cpu", torch_threads=1, compilation_config={"cudagraph_mode": mode}, max_model_len=64)
    llm.generate(["hi"], SamplingParams(max_tokens=3), use_tqdm=False)
    model = weakref.ref(llm.engine.model_runner.model)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert model() is None, gc.get_referrers(model())
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_del_llm_gives_every_byte_back_without_a_collection(qwen3):
    """The twin on a GPU, with real CUDA graphs (FULL_AND_PIECEWISE, the default): with the
    collector off, ``del llm`` gives back every byte the engine allocated (weights, KV cache,
    the graphs' pools). A first engine, built and collected, takes what the process keeps for
    good (cuBLAS workspaces) before the baseline."""
    import gc

    def run() -> LLM:
        llm = LLM(str(qwen3), device="cuda", max_model_len=256, gpu_memory_utilization=0.3, max_num_seqs=8)
        llm.generate(["hi", "there"], SamplingParams(max_tokens=4), use_tqdm=False)
        return llm

    first = run()
    del first
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    llm = run()
    assert torch.cuda.memory_allocated() > baseline
    gc.disable()
    try:
        del llm
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - baseline
    finally:
        gc.enable()
    assert left == 0, f"{left} bytes still allocated after del llm, before any collection"


class _Handle:
    """A launched step's handle, as the worker keeps it: ``get_output()`` reads it back."""

    def __init__(self, step: int) -> None:
        self.step = step

    def get_output(self) -> int:
        return self.step


class _Worker:
    """The worker's async half with ``Worker.take_async_outputs`` itself; a launched step's
    output is its launch number."""

    take_async_outputs = Worker.take_async_outputs

    def __init__(self) -> None:
        from collections import deque

        self._async_outputs, self.launched, self.deferred = deque(), 0, False

    def execute_model_async(self, scheduler_output, defer_sampling: bool = False) -> None:
        if defer_sampling:
            self.deferred = True
        else:
            self.sample_tokens_async(None)

    def sample_tokens_async(self, grammar_output) -> None:
        self.deferred = False
        self._async_outputs.append(_Handle(self.launched))
        self.launched += 1


def test_the_step_replies_book_knows_which_reply_brings_each_step():
    """``executor/step_replies.py``, without processes: the worker side's replies against the
    executor's book, for the engine's patterns (a first launch, steady launches, a deferred
    forward and its sampling, a drain's flush, a failed step)."""
    from tinyvllm.executor.step_replies import StepReplies, flush_steps, launch_step, sample_step

    worker, book = _Worker(), StepReplies()
    calls = {
        "launch": lambda: launch_step(worker, None, False), "forward": lambda: launch_step(worker, None, True),
        "sample": lambda: sample_step(worker, None), "flush": lambda: flush_steps(worker),
    }  # fmt: skip
    brought = []
    for message in ["launch", "launch", "launch", "forward", "sample", "launch", "flush", "launch"]:
        brings, step = book.send(message)
        assert (step is None) == (message in ("forward", "flush"))
        reply = calls[message]()
        assert reply == list(brings), (message, reply, brings)  # the reply carries exactly what the book said
        book.received(brings, reply)
        brought += reply
    assert brought == [0, 1, 2, 3, 4] and book.held_from == 5 and book.needs_flush(5) and not book.needs_flush(4)
    assert [book.outputs.pop(s) for s in range(5)] == [0, 1, 2, 3, 4]  # in launch order
    brings, _ = book.send("launch")  # step 6; the reply that brings step 5 is read after a failure:
    book.drop()
    book.received(brings, launch_step(worker, None, False))
    assert book.outputs == {} and book.dropped_below == 7 and book.needs_flush(7)
    with pytest.raises(RuntimeError, match="carried 2 outputs, not the 1 of steps range.7, 8."):
        book.received(range(7, 8), [7, 8])
    with pytest.raises(ValueError, match="not 'take'"):
        book.send("take")
