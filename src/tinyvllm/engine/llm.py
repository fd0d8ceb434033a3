"""LLM: the offline entry point, ``LLM(model=...).generate(prompts, sampling_params)``.

Concept: build every part of the engine from a Hugging Face folder, check everything a
user can get wrong before anything runs, then drive ``LLMEngine.step()`` until every
prompt is finished, with a progress bar. Names and defaults follow vLLM's ``LLM`` so
scripts port both ways.

Start-up, in order: the folder's config (architecture, shapes) -> device and dtype ->
limits (``max_model_len``, the token budget) and the compilation config -> the tokenizer
and EOS ids -> the model weights -> the number of KV blocks (profiled on a GPU, less what
the CUDA graphs will hold; an override or a byte budget on the CPU) -> the KV tensors ->
the persistent batch with the logits processors and block table -> the runner, which
warms up and captures its CUDA graphs -> the scheduler and the engine.

Mirrors: ``vllm/entrypoints/llm.py`` (``LLM.generate``), ``vllm/v1/engine/core.py``
(``_initialize_kv_caches``), ``vllm/v1/worker/gpu_worker.py`` (``determine_available_memory``).

NOTE 1 (EOS): the request's EOS is the tokenizer's; further EOS ids listed in
``generation_config.json`` (Qwen3 lists two) become stop tokens unless ``ignore_eos``.
NOTE 2 (defaults): ``max_model_len`` defaults to the model's ``max_position_embeddings``;
``max_num_batched_tokens`` to ``max(8192, max_num_seqs)``.
NOTE 3 (CUDA graphs): ``compilation_config`` is vLLM's dict (``cudagraph_mode``,
``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``) or a ``CompilationConfig``;
``enforce_eager=True`` means mode NONE. The default mode is FULL_AND_PIECEWISE on CUDA and
NONE on the CPU, where any other mode runs emulated graphs (seed 000, vLLM's "CUDA Graphs").
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Sequence

import torch

from tinyvllm.config import CacheConfig, CompilationConfig, EngineConfig, ReasoningConfig, SchedulerConfig
from tinyvllm.core.kv_cache_manager import cdiv
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.models.llama import load_model
from tinyvllm.models.loader import load_eos_token_ids, load_model_spec, load_tokenizer, resolve_dtype
from tinyvllm.outputs import RequestOutput
from tinyvllm.sample.logits_processors import build_logitsprocs
from tinyvllm.sample.thinking_budget import maybe_create_thinking_budget_state_holder
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.attention_metadata import build_attention_metadata
from tinyvllm.worker.input_batch import InputBatch
from tinyvllm.worker.kv_cache import (
    CPU_KV_CACHE_BYTES,
    allocate_kv_caches,
    available_gpu_kv_bytes,
    bytes_per_block,
    check_fits_one_request,
    num_blocks_from_budget,
)
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode
from tinyvllm.worker.model_runner import ModelRunner

ATTENTION_BACKENDS = ("auto", "triton", "reference")
PromptType = str | dict


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA device is available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device(device)


def _compilation_config(config: dict | CompilationConfig | None, enforce_eager: bool) -> CompilationConfig:
    """vLLM's ``compilation_config`` (a dict or a ``CompilationConfig``); ``enforce_eager`` means NONE."""
    if not isinstance(enforce_eager, bool):
        raise ValueError(f"enforce_eager must be a bool, got {enforce_eager!r}")
    if config is None:
        config = CompilationConfig()
    elif not isinstance(config, CompilationConfig):
        config = CompilationConfig.from_dict(config)
    if enforce_eager:
        config = dataclasses.replace(config, cudagraph_mode=CUDAGraphMode.NONE)
    return config


class LLM:
    """Generate text from a local Hugging Face folder (Qwen3, Qwen2, Llama families)."""

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        attention_backend: str = "auto",
        seed: int = 0,
        reasoning_config: ReasoningConfig | None = None,
        compilation_config: dict | CompilationConfig | None = None,
        enforce_eager: bool = False,
    ) -> None:
        spec = load_model_spec(model)
        self.device = _resolve_device(device)
        self.dtype = resolve_dtype(dtype, spec, self.device.type)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        if attention_backend == "auto":
            attention_backend = "triton" if self.device.type == "cuda" else "reference"
        compilation = _compilation_config(compilation_config, enforce_eager)
        self.cudagraph_memory_bytes = 0  # what the graphs take from the KV budget (GPU only)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        max_model_len = spec.max_position_embeddings if max_model_len is None else max_model_len
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{spec.max_position_embeddings}"
            )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens or max(8192, max_num_seqs),
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        if num_gpu_blocks_override is not None:
            check_fits_one_request(num_gpu_blocks_override, block_size, max_model_len)
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks_override)  # validates early

        self.tokenizer = load_tokenizer(model)
        eos_ids = load_eos_token_ids(model, self.tokenizer)
        tok_eos = self.tokenizer.eos_token_id
        self.eos_token_id = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        self.extra_stop_token_ids = tuple(e for e in eos_ids if e != self.eos_token_id)  # NOTE 1

        torch.manual_seed(seed)
        self.model = load_model(model, dtype=self.dtype, device=self.device, attention_backend=attention_backend)
        self.spec = spec
        # --8<-- [start:kv_start_up]
        per_block = bytes_per_block(spec.num_hidden_layers, block_size, spec.num_key_value_heads, spec.head_dim, self.dtype)
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
        cache_config = CacheConfig(
            block_size=block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        )
        self.config = EngineConfig(scheduler_config, cache_config, reasoning_config, compilation)
        kv_caches = allocate_kv_caches(
            spec.num_hidden_layers, num_blocks, block_size, spec.num_key_value_heads, spec.head_dim,
            self.dtype, self.device,
        )
        # --8<-- [end:kv_start_up]
        runner = self._build_runner(kv_caches, block_size, scheduler_config, compilation, reasoning_config)
        runner.capture_model()  # warm-up and CUDA-graph capture (nothing to do in mode NONE)
        scheduler = Scheduler(scheduler_config, cache_config, log_stats=True)
        self.engine = LLMEngine(scheduler, runner, self.tokenizer, self.eos_token_id)
        self._ids = itertools.count()

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
        config = EngineConfig(scheduler_config, CacheConfig(block_size=block_size), reasoning_config, compilation)
        logitsprocs = build_logitsprocs(config, self.device, False, False)
        thinking = maybe_create_thinking_budget_state_holder(reasoning_config, max_num_seqs, 0, self.device, False)
        blocks_per_req = cdiv(scheduler_config.max_model_len, block_size)
        input_batch = InputBatch(max_num_seqs, self.device, logitsprocs, thinking, max_num_blocks_per_req=blocks_per_req)
        return ModelRunner(
            self.model, kv_caches, block_size, input_batch, self.device, self.eos_token_id,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            max_model_len=scheduler_config.max_model_len, compilation_config=compilation,
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

    def get_tokenizer(self):
        return self.tokenizer

    # -- generation -------------------------------------------------------------------------

    def _prompt_token_ids(self, index: int, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids  # with BOS where the tokenizer adds one
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(f"prompt {index} must be a str or a dict with 'prompt_token_ids', got {prompt!r}")

    # --8<-- [start:eos_stops]
    def _with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        extra = [t for t in self.extra_stop_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))
    # --8<-- [end:eos_stops]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in prompt order."""
        # --8<-- [start:validation]
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        max_len = self.config.scheduler_config.max_model_len
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # every check before anything runs
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be SamplingParams, got {p!r}")
            text, ids = self._prompt_token_ids(i, prompt)
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) > max_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens, more than max_model_len {max_len}")
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt {i} has token id {bad!r}, outside the vocabulary [0, {self.spec.vocab_size})")
            requests.append((f"{next(self._ids)}", text, ids, self._with_eos_stops(p)))
        added = []
        try:
            for req_id, text, ids, p in requests:
                self.engine.add_request(req_id, ids, p, prompt=text)
                added.append(req_id)
        except ValueError:
            self.engine.abort_request(added)  # nothing half-started is left behind
            raise
        # --8<-- [end:validation]
        return self._run(added, use_tqdm)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(req_ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        finished[out.request_id] = out
                        bar.update(1)
            except BaseException:  # the failed step is undone by the engine; drop the rest of this call
                self.engine.abort_request([r for r in req_ids if r not in finished])
                raise
        return [finished[r] for r in req_ids]
