"""Device start-up: load the weights, size and allocate the KV cache, build the runner.

Concept: everything ``LLM(...)`` does on the device once the arguments are checked and the
tokenizer is loaded: set the threads and the seed, load the weights, find the number of KV
blocks (an override; the CPU's byte budget; on a GPU, a profiled forward and the memory the
CUDA graphs will hold, NOTE 1), allocate the KV tensors, build the persistent batch and the
runner, capture the CUDA graphs, and report what it chose (``startup_report.py``).

Mirrors: ``vllm/v1/engine/core.py`` (``_initialize_kv_caches``) and
``vllm/v1/worker/gpu_worker.py`` (``determine_available_memory``, ``compile_or_warm_up_model``).
This module is the start-up code ``LLM.__init__`` held, moved unchanged behind one function,
``start_device``; the executor and worker seams (``vllm/v1/executor/``,
``vllm/v1/worker/gpu_worker.py``) take its place.

Invariants: ``start_device`` returns a runner whose KV cache holds exactly
``config.cache_config.num_gpu_blocks`` blocks, and that config; nothing else changes.

NOTE 1 (graph memory): graphs bake in the KV cache's address, so they are captured after
the cache exists; to size the cache first, a trial runner over a one-block cache captures
every graph, and the reserved memory it adds is taken from the KV budget (GPU only).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass

import torch

from tinyvllm.arith import cdiv
from tinyvllm.config import CacheConfig, CompilationConfig, EngineConfig, ReasoningConfig, SchedulerConfig
from tinyvllm.device_syncs import pin_memory_for
from tinyvllm.engine.startup_report import StartupReport
from tinyvllm.models.llama import load_model
from tinyvllm.sample.logits_processors import build_logitsprocs
from tinyvllm.sample.thinking_budget import maybe_create_thinking_budget_state_holder
from tinyvllm.worker.attention_metadata import build_attention_metadata
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode
from tinyvllm.worker.input_batch import InputBatch
from tinyvllm.worker.kv_cache import (
    CPU_KV_CACHE_BYTES,
    allocate_kv_caches,
    available_gpu_kv_bytes,
    available_memory_bytes,
    bytes_per_block,
    check_fits_one_request,
    check_kv_cache_fits,
    num_blocks_from_budget,
)
from tinyvllm.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class StartedDevice:
    """What start-up made: the runner (with its model and KV cache) and the sized config."""

    runner: ModelRunner
    config: EngineConfig  # cache_config.num_gpu_blocks set
    startup_report: StartupReport
    cudagraph_memory_bytes: int  # what the graphs take from the KV budget (GPU only; 0 elsewhere)


def start_device(config: EngineConfig, eos_token_id: int | None) -> StartedDevice:
    """Load, size, allocate, build and capture (module header); ``config`` comes from
    ``EngineArgs.create_engine_config`` with the reasoning config completed."""
    started = _DeviceStartup(config, eos_token_id)
    return StartedDevice(started.runner, started.config, started.startup_report, started.cudagraph_memory_bytes)


class _DeviceStartup:
    """``LLM.__init__``'s device block, unchanged, on the attributes it used."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        model_config, device_config = config.model_config, config.device_config
        self.device = torch.device(device_config.device)
        self.dtype = getattr(torch, model_config.dtype)
        self.speculative_config = config.speculative_config
        self.logits_processors = model_config.logits_processors
        self.eos_token_id = eos_token_id
        self.cudagraph_memory_bytes = 0  # what the graphs take from the KV budget (GPU only)
        scheduler_config, compilation, reasoning_config = (
            config.scheduler_config, config.compilation_config, config.reasoning_config
        )
        block_size, enable_prefix_caching = config.cache_config.block_size, config.cache_config.enable_prefix_caching
        model, spec, seed, attention_backend = (
            model_config.model, model_config.spec, model_config.seed, model_config.attention_backend
        )
        torch_threads, gpu_memory_utilization = device_config.torch_threads, device_config.gpu_memory_utilization
        num_gpu_blocks_override = device_config.num_gpu_blocks_override
        max_model_len, max_num_seqs = scheduler_config.max_model_len, scheduler_config.max_num_seqs
        per_block = bytes_per_block(spec.num_hidden_layers, block_size, spec.num_key_value_heads, spec.head_dim, self.dtype)
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)  # for the process; threads started later inherit it
        torch.manual_seed(seed)
        started = time.perf_counter()
        self.model = load_model(model, dtype=self.dtype, device=self.device, attention_backend=attention_backend)
        self.spec = spec
        loaded = time.perf_counter()
        # --8<-- [start:kv_start_up]
        if num_gpu_blocks_override is not None:
            num_blocks = num_gpu_blocks_override
        else:
            if self.device.type == "cuda":
                self._profile_forward(scheduler_config, block_size)
                budget = available_gpu_kv_bytes(gpu_memory_utilization, self.device)
                self.cudagraph_memory_bytes = self._measure_cudagraph_bytes(
                    scheduler_config, compilation, block_size, reasoning_config
                )
                budget -= self.cudagraph_memory_bytes
            else:
                budget = CPU_KV_CACHE_BYTES
            num_blocks = num_blocks_from_budget(budget, per_block, block_size, max_model_len, max_num_seqs)
            check_fits_one_request(num_blocks, block_size, max_model_len)
        check_kv_cache_fits(num_blocks, per_block, available_memory_bytes(self.device))
        cache_config = CacheConfig(
            block_size=block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        )
        self.config = dataclasses.replace(config, cache_config=cache_config)
        kv_caches = allocate_kv_caches(
            spec.num_hidden_layers, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim,
            self.dtype, self.device,
        )
        # --8<-- [end:kv_start_up]
        sized = time.perf_counter()
        runner = self._build_runner(kv_caches, block_size, scheduler_config, compilation, reasoning_config)
        runner.capture_model()  # warm-up and CUDA-graph capture (nothing to do in mode NONE)
        measured = self.device.type == "cuda" and num_gpu_blocks_override is None and runner.cudagraph_mode.name != "NONE"
        self.startup_report = self._startup_report(runner, per_block, measured, loaded - started, sized - loaded, sized)
        self.runner = runner

    def _startup_report(
        self, runner: ModelRunner, bytes_per_block: int, measured: bool, load_s: float, memory_s: float, sized: float
    ) -> StartupReport:
        """What start-up chose (``engine/startup_report.py``), once the runner has captured."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        name = f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else ""
        cache, scheduler = self.config.cache_config, self.config.scheduler_config
        return StartupReport(
            device=f"{self.device}{name}", dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.model.attention_backend, cudagraph_mode=runner.cudagraph_mode.name,
            capture_sizes=tuple(runner.dispatcher.capture_sizes) if runner.cudagraph_mode != CUDAGraphMode.NONE else (),
            block_size=cache.block_size, num_kv_blocks=cache.num_gpu_blocks,
            kv_cache_bytes=cache.num_gpu_blocks * bytes_per_block, cudagraph_memory_bytes=self.cudagraph_memory_bytes if measured else None,
            max_model_len=scheduler.max_model_len, max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            load_s=load_s, memory_s=memory_s, capture_s=time.perf_counter() - sized, torch_threads=torch.get_num_threads(),
        )  # fmt: skip

    def _build_runner(
        self,
        kv_caches: list[torch.Tensor],
        block_size: int,
        scheduler_config: SchedulerConfig,
        compilation: CompilationConfig,
        reasoning_config: ReasoningConfig | None,
    ) -> ModelRunner:
        """The persistent batch with its logits processors and block table, and the runner."""
        max_num_seqs = scheduler_config.max_num_seqs
        spec_config = self.speculative_config
        num_spec = spec_config.num_speculative_tokens if spec_config is not None else 0
        config = EngineConfig(scheduler_config, CacheConfig(block_size=block_size), reasoning_config, compilation, spec_config)
        pin = pin_memory_for(self.device)  # the processors' host buffers, pinned on CUDA
        logitsprocs = build_logitsprocs(config, self.device, pin, False, self.logits_processors)  # MinTokens alone with spec
        thinking = maybe_create_thinking_budget_state_holder(reasoning_config, max_num_seqs, num_spec, self.device, pin)
        blocks_per_req = cdiv(scheduler_config.max_model_len, block_size)
        input_batch = InputBatch(
            max_num_seqs, self.device, logitsprocs, thinking, max_num_blocks_per_req=blocks_per_req,
            vocab_size=self.spec.vocab_size,  # penalties and allowed_token_ids mask over it
        )  # fmt: skip
        return ModelRunner(
            self.model, kv_caches, block_size, input_batch, self.device, self.eos_token_id,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_model_len=scheduler_config.max_model_len, compilation_config=compilation,
            num_speculative_tokens=num_spec,
        )  # fmt: skip

    # --8<-- [start:graph_memory]
    def _measure_cudagraph_bytes(
        self,
        scheduler_config: SchedulerConfig,
        compilation: CompilationConfig,
        block_size: int,
        reasoning_config: ReasoningConfig | None,
    ) -> int:
        """GPU memory the CUDA graphs will hold, so the KV budget leaves room for it.

        Graphs bake in the KV cache's address, so they can only be captured after the cache
        exists; to size the cache first, a trial runner over a one-block cache captures every
        graph, the reserved memory it adds is measured, and everything is freed again.
        """
        spec = self.model.spec
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        caches = allocate_kv_caches(
            spec.num_hidden_layers, 1, block_size, spec.num_key_value_heads, spec.head_dim, self.dtype, self.device
        )
        trial = self._build_runner(caches, block_size, scheduler_config, compilation, reasoning_config)
        if trial.capture_model() == 0:
            used = 0
        else:
            torch.cuda.synchronize(self.device)
            used = torch.cuda.memory_reserved(self.device) - before
        trial.release_cudagraphs()  # the model's pieces must not keep the trial's graphs alive
        del trial, caches
        gc.collect()
        torch.cuda.empty_cache()
        return max(0, used)
    # --8<-- [end:graph_memory]

    # --8<-- [start:profile]
    @torch.inference_mode()
    def _profile_forward(self, scheduler_config: SchedulerConfig, block_size: int) -> None:
        """Run the worst-case batch once so the activation peak is known (GPU only)."""
        n = scheduler_config.max_num_batched_tokens
        per_req = min(n, scheduler_config.max_model_len)
        lens = [per_req] * (n // per_req) + ([n % per_req] if n % per_req else [])
        spec = self.model.spec
        blocks = cdiv(per_req, block_size)
        caches = allocate_kv_caches(
            spec.num_hidden_layers, blocks, block_size, spec.num_key_value_heads, spec.head_dim, self.dtype, self.device
        )
        metadata = build_attention_metadata(
            [0] * len(lens), lens, [list(range(blocks))] * len(lens), block_size, device=self.device
        )
        torch.cuda.reset_peak_memory_stats(self.device)
        input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, metadata.positions, caches, metadata)
        rows = min(scheduler_config.max_num_seqs, n)
        self.model.compute_logits(hidden[:rows])
        del caches, hidden
        torch.cuda.synchronize(self.device)
        # Hand the profile's blocks back to the device, so that ``total - free`` counts only
        # what stays allocated and the activation peak is counted once, by the allocator stats.
        torch.cuda.empty_cache()
    # --8<-- [end:profile]
