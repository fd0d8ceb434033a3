"""Worker: the device's side of start-up and of every step, for one device.

Concept: the engine never touches the device itself; it asks an executor, which asks its
worker(s). A worker, in order: sets the process's threads and seed (``init_device``), loads
the weights (``load_model``), says how many bytes the KV cache may take
(``determine_available_memory``: on a GPU a worst-case forward is profiled and the CUDA
graphs' memory measured and taken off, NOTE 1; on the CPU a byte budget; an override
skips both), allocates the KV cache with the number of blocks the engine chose and builds
the persistent batch and the runner (``initialize_from_config``), captures the CUDA graphs
(``compile_or_warm_up_model``) and reports what it chose (``StartupReport``). Each step it
runs ``ModelRunner.execute_model``; after a failed step, the runner's recovery.

Mirrors: ``vllm/v1/worker/gpu_worker.py`` (``Worker``: ``init_device``, ``load_model``,
``determine_available_memory``, ``initialize_from_config``, ``compile_or_warm_up_model``,
``execute_model``) and ``vllm/v1/worker/gpu_model_runner.py`` (``profile_run``).

Invariants: the worker is the one place that writes the model's ``pieces`` (it installs the
PIECEWISE wrappers of a ``CUDAGraphSetup`` and takes them off again), and they are wrapped
exactly when the runner's mode has piecewise graphs (``check_invariants``); ``model_runner`` is
None until ``initialize_from_config``; ``startup_report`` is None until the graphs are
captured; ``cudagraph_memory_bytes`` is 0 unless a GPU trial capture measured it.

NOTE 1 (the graphs' memory): graphs bake in the KV cache's address, so they can only be
captured after the cache exists; to size the cache first, a trial runner over a one-block
cache captures every graph, the reserved memory it adds is measured, and everything is
freed again: the worker unwraps the model's pieces, so the trial's graphs do not stay alive.
NOTE 2 (the profile): the worst-case batch (``max_num_batched_tokens`` tokens in requests
of ``max_model_len``) runs once on a GPU so the activation peak is known; its blocks are
handed back (``empty_cache``), so ``total - free`` counts only what stays allocated and the
peak is counted once, by the allocator's statistics (``worker/kv_cache.py``). Both this
baseline and the graphs' (NOTE 1) start after ``collect_garbage``: memory that only the cycle
collector frees would otherwise count as used, or be freed by the ``gc.collect()`` and
``empty_cache()`` that ``torch.cuda.graph`` runs as a capture starts, and the trial's
``memory_reserved`` delta would come out short, even below 0 (vLLM's worker collects before
its memory snapshot too).
NOTE 3 (EOS): the tokenizer's EOS id reaches the persistent batch, which hands the logits
processors each request's params with it as a stop token (``input_batch.py``).
NOTE 4 (ranks): with ``tensor_parallel_size`` N > 1 an executor builds N workers, ranks
0 .. N-1, each in its own process; ``init_device`` joins them into one process group
(``distributed/parallel_state.py``) before the weights load, so each loads only its slice.
Every rank seeds alike and runs the same steps, so every rank samples the same ids.
NOTE 6 (async scheduling): ``execute_model_async`` launches a step and keeps its handle
(``worker/async_output.py``); ``take_async_output`` reads back the oldest, and
``take_async_outputs`` every one held (but the newest, if asked). The handles stay here, in
the worker's process, wherever it lives: the one-process executor makes two calls a step
(three when the sampling waits for a grammar mask: ``sample_tokens_async``); a worker
process answers a launch with the outputs ready (``executor/step_replies.py``).
"""

from __future__ import annotations

import gc
import time
from collections import deque

import torch

from tinyvllm.arith import cdiv
from tinyvllm.config import EngineConfig
from tinyvllm.core.sched_output import GrammarOutput, SchedulerOutput
from tinyvllm.device_syncs import pin_memory_for
from tinyvllm.distributed.parallel_state import (
    default_backend,
    destroy_distributed_environment,
    init_distributed_environment,
)
from tinyvllm.distributed.utils import kv_heads_per_rank
from tinyvllm.models import llama
from tinyvllm.models.classifier import load_classifier
from tinyvllm.outputs import DraftTokenIds, ModelRunnerOutput
from tinyvllm.sample.logits_processors import build_logitsprocs
from tinyvllm.sample.thinking_budget import maybe_create_thinking_budget_state_holder
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.worker.async_output import AsyncModelRunnerOutput
from tinyvllm.worker.attention_metadata import build_attention_metadata
from tinyvllm.worker.cuda_graph import CUDAGraphWrapper
from tinyvllm.worker.cudagraph_capture import capture_model, eager_pieces, init_cudagraphs, release_cudagraphs
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode
from tinyvllm.worker.input_batch import InputBatch
from tinyvllm.worker.kv_cache import CPU_KV_CACHE_BYTES, allocate_kv_caches, available_gpu_kv_bytes, bytes_per_block
from tinyvllm.worker.model_runner import ModelRunner
from tinyvllm.worker.pooler import make_pooler
from tinyvllm.worker.startup_report import StartupReport


def collect_garbage(device: torch.device) -> None:
    """Free what only the cycle collector can (a user's cyclic garbage holding tensors; an
    earlier engine's model did, while its ``pieces`` were its own bound methods) and hand the
    freed blocks back to the device (NOTE 2)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


class Worker:
    """Loads the model, sizes and allocates the KV cache, builds the runner (module header)."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_id: int | None = None,
        rank: int = 0,
        distributed_init_method: str = "env://",
    ) -> None:
        if config.model_config is None:
            raise ValueError("a Worker needs an EngineConfig with a model_config")
        self.config = config
        self.rank = rank  # NOTE 4: this worker's place in the tensor-parallel group
        self.distributed_init_method = distributed_init_method
        self.model_config, self.device_config = config.model_config, config.device_config
        self.device = torch.device(self.device_config.device)
        self.dtype: torch.dtype = getattr(torch, self.model_config.dtype)
        self.eos_token_id = eos_token_id  # NOTE 3
        self.model: torch.nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.cudagraph_memory_bytes = 0  # NOTE 1: what the graphs take from the KV budget (GPU only)
        self.startup_report: StartupReport | None = None
        self._async_outputs: deque[AsyncModelRunnerOutput] = deque()  # NOTE 6: launched, not yet taken
        self._load_s = 0.0
        self._loaded = self._sized = 0.0  # perf_counter() stamps for the report

    def init_device(self) -> None:
        """The process's intra-op threads (None: torch's as it is, ``cpu_threads.py``), then the seed."""
        if self.device_config.torch_threads is not None:
            torch.set_num_threads(self.device_config.torch_threads)  # threads started later inherit it
        world_size = self.config.parallel_config.world_size
        if world_size > 1:  # NOTE 4
            init_distributed_environment(
                world_size, self.rank, self.distributed_init_method, default_backend(self.device.type)
            )  # fmt: skip
        torch.manual_seed(self.model_config.seed)  # the same seed on every rank: the same draws

    def load_model(self) -> None:
        started = time.perf_counter()
        mc = self.model_config
        load = llama.load_model if mc.spec.labels is None else load_classifier  # models/classifier.py
        self.model = load(mc.model, dtype=self.dtype, device=self.device, attention_backend=mc.attention_backend,
                          hf_overrides=mc.hf_overrides)  # fmt: skip
        self._loaded = time.perf_counter()
        self._load_s = self._loaded - started

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank's cache holds (NOTE 4, ``distributed/utils.py`` NOTE 1)."""
        spec, parallel = self.model_config.spec, self.config.parallel_config
        return kv_heads_per_rank(spec.num_key_value_heads, parallel.tensor_parallel_size)

    def kv_bytes_per_block(self) -> int:
        spec = self.model_config.spec
        return bytes_per_block(
            spec.num_hidden_layers, self.config.cache_config.block_size, self.num_kv_heads, spec.head_dim, self.dtype
        )  # fmt: skip

    # --8<-- [start:available_memory]
    def determine_available_memory(self) -> int:
        """The bytes the KV cache may take: the override's blocks; on a GPU what
        ``gpu_memory_utilization`` leaves after the weights and the profile (NOTE 2), less what
        the CUDA graphs will hold (NOTE 1); on the CPU a fixed budget (``kv_cache.py`` NOTE 2)."""
        override = self.device_config.num_gpu_blocks_override
        if override is not None:
            return override * self.kv_bytes_per_block()
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        collect_garbage(self.device)  # NOTE 2: garbage is neither used memory nor the graphs'
        self.profile_run()
        budget = available_gpu_kv_bytes(self.device_config.gpu_memory_utilization, self.device)
        self.cudagraph_memory_bytes = self._measure_cudagraph_bytes()
        return budget - self.cudagraph_memory_bytes
    # --8<-- [end:available_memory]

    # --8<-- [start:profile]
    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the worst-case batch once so the activation peak is known (GPU only, NOTE 2)."""
        scheduler_config, block_size = self.config.scheduler_config, self.config.cache_config.block_size
        n = scheduler_config.max_num_batched_tokens
        per_req = min(n, scheduler_config.max_model_len)
        lens = [per_req] * (n // per_req) + ([n % per_req] if n % per_req else [])
        spec = self.model_config.spec
        blocks = cdiv(per_req, block_size)
        caches = allocate_kv_caches(
            spec.num_hidden_layers, blocks, block_size, self.num_kv_heads, spec.head_dim, self.dtype, self.device
        )
        metadata = build_attention_metadata(
            [0] * len(lens), lens, [list(range(blocks))] * len(lens), block_size, device=self.device
        )
        torch.cuda.reset_peak_memory_stats(self.device)
        input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, metadata.positions, caches, metadata)  # [n, hidden]
        rows = min(scheduler_config.max_num_seqs, n)
        self.model.compute_logits(hidden[:rows])
        del caches, hidden
        torch.cuda.synchronize(self.device)
        # Hand the profile's blocks back to the device, so that ``total - free`` counts only
        # what stays allocated and the activation peak is counted once, by the allocator stats.
        torch.cuda.empty_cache()
    # --8<-- [end:profile]

    # --8<-- [start:graph_memory]
    def _measure_cudagraph_bytes(self) -> int:
        """GPU memory the CUDA graphs will hold, so the KV budget leaves room for it (NOTE 1)."""
        spec = self.model_config.spec
        collect_garbage(self.device)  # else the capture's own collect may free it mid-measurement
        before = torch.cuda.memory_reserved(self.device)
        caches = allocate_kv_caches(
            spec.num_hidden_layers, 1, self.config.cache_config.block_size, self.num_kv_heads, spec.head_dim,
            self.dtype, self.device,
        )  # fmt: skip
        trial = self._build_runner(caches)
        if capture_model(trial) == 0:
            used = 0
        else:
            torch.cuda.synchronize(self.device)
            used = torch.cuda.memory_reserved(self.device) - before
        self._release_cudagraphs(trial)  # the model's pieces must not keep the trial's graphs alive
        del trial, caches
        gc.collect()
        torch.cuda.empty_cache()
        return max(0, used)
    # --8<-- [end:graph_memory]

    # --8<-- [start:initialize]
    def initialize_from_config(self, config: EngineConfig) -> None:
        """Allocate ``config.cache_config.num_gpu_blocks`` blocks per layer, then build the
        persistent batch and the runner over them."""
        self.config = config
        spec, cache = self.model_config.spec, config.cache_config
        kv_caches = allocate_kv_caches(
            spec.num_hidden_layers, cache.num_gpu_blocks, cache.block_size, self.num_kv_heads, spec.head_dim,
            self.dtype, self.device,
        )  # fmt: skip  L x [2, num_blocks, block_size, Hkv / tp, D]
        self._sized = time.perf_counter()
        self.model_runner = self._build_runner(kv_caches)

    def compile_or_warm_up_model(self) -> None:
        """Warm up and capture the CUDA graphs (nothing to do in mode NONE), then report."""
        capture_model(self.model_runner)
        self.startup_report = self._startup_report()
    # --8<-- [end:initialize]

    def _build_runner(self, kv_caches: list[torch.Tensor]) -> ModelRunner:
        """The persistent batch with its logits processors and block table, the graph set-up
        (its piece wrappers installed on the model here), and the runner."""
        config, device = self.config, self.device
        scheduler_config, block_size = config.scheduler_config, config.cache_config.block_size
        max_num_seqs = scheduler_config.max_num_seqs
        num_spec = config.speculative_config.num_speculative_tokens if config.speculative_config is not None else 0
        pin = pin_memory_for(device)  # the processors' host buffers, pinned on CUDA
        custom = self.model_config.logits_processors
        pooler_config = self.model_config.pooler_config  # None: a generating engine
        logitsprocs = build_logitsprocs(config, device, pin, pooler_config is not None, custom)  # MinTokens alone with spec
        thinking = maybe_create_thinking_budget_state_holder(config.reasoning_config, max_num_seqs, num_spec, device, pin)
        input_batch = InputBatch(
            max_num_seqs, device, logitsprocs, thinking, max_num_blocks_per_req=cdiv(scheduler_config.max_model_len, block_size),
            vocab_size=self.model_config.spec.vocab_size,  # penalties and allowed_token_ids mask over it
        )  # fmt: skip
        graphs = init_cudagraphs(
            self.model, device, config.compilation_config, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_model_len=scheduler_config.max_model_len, uniform_decode_query_len=1 + num_spec,
            pooling=pooler_config is not None,
        )  # fmt: skip
        self.model.pieces = graphs.pieces  # the one place the model's pieces are wrapped
        return ModelRunner(
            self.model, kv_caches, block_size, input_batch, device, self.eos_token_id,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_model_len=scheduler_config.max_model_len, cudagraphs=graphs, num_speculative_tokens=num_spec,
            pooler=None if pooler_config is None else make_pooler(self.model, pooler_config, self.model_config.pooling_model),
            proposer=_runner_proposer(config),
        )  # fmt: skip

    def _release_cudagraphs(self, runner: ModelRunner) -> None:
        release_cudagraphs(runner)
        self.model.pieces = eager_pieces(self.model)

    def release_cudagraphs(self) -> None:
        """Drop every captured graph of the runner and unwrap the model's pieces."""
        self._release_cudagraphs(self.model_runner)

    def _startup_report(self) -> StartupReport:
        """What start-up chose (``startup_report.py``), once the runner has captured."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        runner, cache, scheduler = self.model_runner, self.config.cache_config, self.config.scheduler_config
        name = f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else ""
        measured = (
            self.device.type == "cuda" and self.device_config.num_gpu_blocks_override is None
            and runner.cudagraph_mode.name != "NONE"
        )  # fmt: skip
        return StartupReport(
            device=f"{self.device}{name}", dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.model.attention_backend, cudagraph_mode=runner.cudagraph_mode.name,
            capture_sizes=tuple(runner.dispatcher.capture_sizes) if runner.cudagraph_mode != CUDAGraphMode.NONE else (),
            block_size=cache.block_size, num_kv_blocks=cache.num_gpu_blocks,
            kv_cache_bytes=cache.num_gpu_blocks * self.kv_bytes_per_block(),
            cudagraph_memory_bytes=self.cudagraph_memory_bytes if measured else None,
            max_model_len=scheduler.max_model_len, max_num_seqs=scheduler.max_num_seqs,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            load_s=self._load_s, memory_s=self._sized - self._loaded, capture_s=time.perf_counter() - self._sized,
            torch_threads=torch.get_num_threads(),
            tensor_parallel_size=self.config.parallel_config.tensor_parallel_size, rank=self.rank,
            num_kv_heads=self.num_kv_heads, total_num_kv_heads=self.model_config.spec.num_key_value_heads,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),  # tied: once
        )  # fmt: skip

    # -- every step --------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    # --8<-- [start:async_steps]
    def execute_model_async(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> None:
        """Launch a step and keep its handle (async scheduling, NOTE 6); nothing comes back yet.
        With ``defer_sampling`` only its forward: ``sample_tokens_async`` samples it."""
        handle = self.model_runner.execute_model_async(scheduler_output, defer_sampling)
        if handle is not None:
            self._async_outputs.append(handle)

    def sample_tokens_async(self, grammar_output: GrammarOutput | None) -> None:
        """Sample the step whose forward was launched, under its grammar mask, and keep its handle."""
        self._async_outputs.append(self.model_runner.sample_tokens(grammar_output))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts the forward waiting to be sampled runs (``model_runner.py`` NOTE 14)."""
        return self.model_runner.take_draft_token_ids()

    def take_async_output(self) -> ModelRunnerOutput:
        """The oldest launched step's output, read back (NOTE 6)."""
        return self._async_outputs.popleft().get_output()

    def take_async_outputs(self, keep_newest: bool = False) -> list[ModelRunnerOutput]:
        """Every launched step's output, oldest first, read back; with ``keep_newest`` the
        step launched last stays in flight (NOTE 6)."""
        keep = 1 if keep_newest and self._async_outputs else 0
        return [self._async_outputs.popleft().get_output() for _ in range(len(self._async_outputs) - keep)]
    # --8<-- [end:async_steps]

    def recover_from_failed_step(self, failed_req_ids: list[str]) -> None:
        self._async_outputs.clear()  # the steps in flight failed together (NOTE 6)
        self.model_runner.recover_from_failed_step(failed_req_ids)

    def check_invariants(self) -> None:
        """The model's pieces are wrapped exactly when the runner's mode has piecewise graphs
        (module header), then the runner checks itself. Call it between steps."""
        runner = self.model_runner
        wrapped = [isinstance(p, CUDAGraphWrapper) for p in self.model.pieces]
        expected = runner.cudagraph_mode.has_piecewise_cudagraphs()
        assert wrapped == [expected] * len(wrapped), (
            f"the model's pieces wrapped {wrapped}, but the runner's mode is {runner.cudagraph_mode.name}"
        )
        runner.check_invariants()

    def shutdown(self) -> None:
        """Drop the runner (its KV cache and graphs); the worker serves no step after this."""
        if self.model_runner is not None:
            self._release_cudagraphs(self.model_runner)
        self.model_runner = None
        if self.config.parallel_config.world_size > 1:
            destroy_distributed_environment()


def _runner_proposer(config: EngineConfig) -> NgramProposer | None:
    """Under async scheduling the runner proposes the drafts (``model_runner.py`` NOTE 14); else
    the engine does, or nobody."""
    spec = config.speculative_config
    if spec is None or not config.scheduler_config.async_scheduling:
        return None
    return NgramProposer(
        spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, config.scheduler_config.max_model_len
    )
