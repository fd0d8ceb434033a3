"""LLM: the offline entry point, ``LLM(model=...).generate(prompts, sampling_params)``.

Concept: build every part of the engine from a Hugging Face folder, check everything a user
can get wrong before anything runs, then drive ``LLMEngine.step()`` until every prompt is
finished, with a progress bar. Names and defaults follow vLLM's ``LLM``, so scripts port.

Start-up, in order: the arguments, the device and the compilation config (NOTE 6) -> the
model folder (a hub id resolved, NOTE 9) -> its config -> dtype and attention backend ->
limits (``max_model_len``, the token budget) -> tokenizer, EOS ids, reasoning config
(NOTE 4) -> the executor, whose worker loads the weights, says what the KV cache may take
(``worker/worker.py``), allocates the blocks chosen from that, builds the batch and the
runner and captures its graphs -> the scheduler and the engine (it calls the executor only).

Mirrors: ``vllm/entrypoints/llm.py`` (``LLM.generate``).

NOTE 1 (EOS): the request's EOS is the tokenizer's; further EOS ids in
``generation_config.json`` (Qwen3 lists two) become stop tokens unless ``ignore_eos``.
NOTE 2 (defaults): ``max_model_len`` is the model's ``max_position_embeddings``;
``max_num_batched_tokens`` is ``max(8192, max_num_seqs)``.
NOTE 3 (CUDA graphs): ``compilation_config`` is vLLM's dict or a ``CompilationConfig``;
``enforce_eager=True`` means NONE. The default is FULL_AND_PIECEWISE on CUDA, NONE on the
CPU, where any other mode runs emulated graphs (seed 000, vLLM's "CUDA Graphs").
NOTE 4 (reasoning): with no ``reasoning_config``, one is built when the tokenizer has
``<think>`` and ``</think>`` as single tokens in the model's vocabulary (Qwen3's has); else
there is none, and a request with a ``thinking_token_budget`` is refused rather than run
without a budget. A given config's ids must lie in the vocabulary.
NOTE 5 (Triton): the kernels run on CUDA or under ``TRITON_INTERPRET=1`` and tile with
``tl.dot`` (``block_size``, ``head_dim`` powers of two >= 16); ``LLM()`` refuses a Triton
backend (asked for, or "auto" on CUDA) that could not run, not failing at the first step.
NOTE 6 (validation): arguments first (``tinyvllm.validation``'s rule: a wrong type TypeError,
a wrong value ValueError, naming both), then what needs the model: reasoning ids, Triton,
whether the KV pool fits in free memory (``worker/kv_cache.py`` NOTE 3). ``generate`` checks
every prompt and params object before queuing any. A prompt is a str or a dict with the keys
of vLLM's ``TextPrompt``/``TokensPrompt``: ``"prompt"``, ``"prompt_token_ids"``,
``"cache_salt"`` (different salts never share a cached block); any other key is a ValueError.
NOTE 7 (custom logits processors): ``logits_processors`` takes ``LogitsProcessor`` classes and
``"module.path:QualName"`` strings, as vLLM's ``LLM``; they run after the built-ins and any
plugin (``logits_processors/loader.py``); ``validate_params`` is asked about every request.
NOTE 8 (attention backends): "triton" (CUDA-graph safe), "torch" (``torch_sdpa.py``, decodes
batched into SDPA calls) and "reference" (a loop over requests, the specification);
"auto" picks Triton on CUDA and torch on the CPU, the faster without Triton's interpreter.
NOTE 9 (model ids): ``model`` is a folder or a hub id (``org/name``), ``revision`` a branch,
tag or commit; ``models/hub.py`` resolves it into the hub cache (a folder of that spelling
wins), after the other arguments are checked and before the folder is read.
NOTE 10 (sampling defaults): ``generation_config`` is vLLM's: ``"auto"`` takes the model's
``generation_config.json`` defaults, ``"vllm"`` none, a folder its file, read once
(``sampling_defaults.py``); ``get_default_sampling_params()`` builds them for a ``generate``
given no params. EOS ids always come from the model folder.
NOTE 11 (speculative decoding): ``speculative_config={"method": "ngram",
"num_speculative_tokens": k, ...}`` turns on n-gram prompt lookup (``spec_decode/``): up to k
drafts per decoding request after each step, verified the next (``rejection_sampler.py``).
As seed 001 ch. 11.4 says, only MinTokens is built then (custom processors refused); min_p
and logit_bias are refused per request, and at start-up when ``generation_config.json``
makes either a default; bad words, allowed ids and logprobs act on every draft row.
NOTE 12 (chat): ``chat(messages)`` takes one conversation or a list of them, renders each
through the chat template (``chat_template.py``), tokenizes without special tokens (the
template writes them) and generates as ``generate`` does, every conversation rendered and
checked (as prompt i) before the first request is queued.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tinyvllm.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ReasoningConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.chat_template import check_template_kwargs, flatten_messages, load_chat_template, render_chat
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.executor.abstract import initialize_kv_caches
from tinyvllm.executor.uniproc_executor import UniProcExecutor
from tinyvllm.engine.request_checks import check_defaults_with_speculation, check_request_against_model
from tinyvllm.stdlib_tiny import STDLIB_TINY
from tinyvllm.models.hub import check_revision, resolve_model
from tinyvllm.models.loader import check_eos_token_ids, load_eos_token_ids, load_model_spec, load_tokenizer, resolve_dtype
from tinyvllm.outputs import RequestOutput
from tinyvllm.platform import triton_can_run_on
from tinyvllm.sample.logits_processors.interface import LogitsProcessor
from tinyvllm.sample.logits_processors.loader import cached_load_custom_logitsprocs, validate_logits_processors_parameters
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.sampling_defaults import check_generation_config, generation_defaults
from tinyvllm.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from tinyvllm.validation import (
    INT64_MAX,
    INT64_MIN,
    check_bool,
    check_int,
    check_optional_int,
    check_real,
    check_token_ids,
)
from tinyvllm.worker.kv_cache import available_memory_bytes, bytes_per_block, check_fits_one_request, check_kv_cache_fits
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "triton", "torch", "reference")  # NOTE 8
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")  # NOTE 6
THINK_START, THINK_END = "<think>", "</think>"  # NOTE 4
PromptType = str | dict
LogitsProcessorSpec = str | type[LogitsProcessor]


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be 'auto', 'cpu' or 'cuda[:N]' (a str), got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but no CUDA device is available")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return torch.device(device)


def _speculative_config(config: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config``: a dict or a ``SpeculativeConfig`` (NOTE 11)."""
    if config is None or isinstance(config, SpeculativeConfig):
        return config
    if isinstance(config, dict):
        return SpeculativeConfig.from_dict(config)  # ValueError for a bad key or value
    raise TypeError(f"speculative_config must be a dict, a SpeculativeConfig or None, got {config!r}")


def _compilation_config(config: dict | CompilationConfig | None, enforce_eager: bool) -> CompilationConfig:
    """vLLM's ``compilation_config`` (a dict or a ``CompilationConfig``); ``enforce_eager`` means NONE."""
    check_bool("enforce_eager", enforce_eager)
    if config is None:
        config = CompilationConfig()
    elif isinstance(config, dict):
        config = CompilationConfig.from_dict(config)  # ValueError for a bad key or value
    elif not isinstance(config, CompilationConfig):
        raise TypeError(f"compilation_config must be a dict, a CompilationConfig or None, got {config!r}")
    if enforce_eager:
        config = dataclasses.replace(config, cudagraph_mode=CUDAGraphMode.NONE)
    return config


def reasoning_config_from_tokenizer(tokenizer, vocab_size: int) -> ReasoningConfig | None:
    """``<think>`` and ``</think>`` as single tokens of the model's vocabulary, else None (NOTE 4)."""
    vocab = tokenizer.get_vocab()
    start, end = vocab.get(THINK_START), vocab.get(THINK_END)
    if start is None or end is None or not (0 <= start < vocab_size and 0 <= end < vocab_size):
        return None
    return ReasoningConfig((start,), (end,))


def _check_triton(requested: str, device: torch.device, block_size: int, head_dim: int) -> None:
    """Refuse a Triton backend that would fail at the first step (NOTE 5)."""
    chosen = f"attention_backend={requested!r}" + (" (Triton on CUDA)" if requested == "auto" else "")
    if not triton_can_run_on(device):
        raise ValueError(
            f"{chosen} runs Triton kernels, which need a CUDA device or, on the CPU, the interpreter "
            f"(TRITON_INTERPRET=1; it is {os.environ.get('TRITON_INTERPRET')!r}); device is {device}: "
            "use attention_backend='torch'"
        )
    for name, value in (("block_size", block_size), ("the model's head_dim", head_dim)):
        if value < 16 or value & (value - 1):
            raise ValueError(
                f"{chosen} needs {name} to be a power of two >= 16 (the kernel's tl.dot tiles), got {value}: "
                "use attention_backend='torch'"
                + (" or a block_size of 16, 32, ..." if name == "block_size" else "")
            )


def _checked_logits_processors(value: object) -> tuple[LogitsProcessorSpec, ...]:
    """Classes and ``"module:QualName"`` strings, imported now so a bad name fails before any weight loads."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"logits_processors must be a list of LogitsProcessor classes or 'module:QualName' strings, got {value!r}"
        )
    for index, item in enumerate(value):
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"logits_processors[{index}] must be a LogitsProcessor class or a 'module:QualName' string, got {item!r}"
            )
    procs = tuple(value)
    cached_load_custom_logitsprocs(procs)  # ValueError (not a LogitsProcessor, bad name), RuntimeError (import)
    return procs


class LLM:
    """Generate text from a Hugging Face model (Qwen3, Qwen2, Llama families): a local
    folder or a hub model id (NOTE 9); with no ``model``, the small model shipped with the
    package (``STDLIB_TINY``)."""

    def __init__(
        self,
        model: str = STDLIB_TINY,
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
        logits_processors: Sequence[LogitsProcessorSpec] | None = None,
        *,
        revision: str | None = None,
        generation_config: str = "auto",
        speculative_config: dict | SpeculativeConfig | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        torch_threads: int | None = None,
    ) -> None:
        # --8<-- [start:arguments]
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a local folder or a Hugging Face model id (a str), got {model!r}")
        revision = check_revision(revision)
        self.device = _resolve_device(device)
        for name, value in (("dtype", dtype), ("attention_backend", attention_backend)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {value!r} ({type(value).__name__})")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        max_model_len = check_optional_int("max_model_len", max_model_len, 1)
        block_size = check_int("block_size", block_size, 1)
        gpu_memory_utilization = check_real("gpu_memory_utilization", gpu_memory_utilization)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        num_gpu_blocks_override = check_optional_int("num_gpu_blocks_override", num_gpu_blocks_override, 1)
        enable_prefix_caching = check_bool("enable_prefix_caching", enable_prefix_caching)
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        max_num_batched_tokens = check_optional_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        seed = check_int("seed", seed, INT64_MIN, INT64_MAX)
        self.max_logprobs = check_int("max_logprobs", max_logprobs, -1)  # -1: no cap, as vLLM
        torch_threads = check_optional_int("torch_threads", torch_threads, 1)  # None: torch's as it is (cpu_threads.py)
        if reasoning_config is not None and not isinstance(reasoning_config, ReasoningConfig):
            raise TypeError(f"reasoning_config must be a ReasoningConfig or None, got {reasoning_config!r}")
        compilation = _compilation_config(compilation_config, enforce_eager)
        self.logits_processors = _checked_logits_processors(logits_processors)
        generation_config = check_generation_config(generation_config)  # NOTE 10
        self.speculative_config = _speculative_config(speculative_config)  # NOTE 11
        if self.speculative_config is not None and self.logits_processors:
            raise ValueError("custom logits_processors cannot be combined with speculative decoding (seed 001 ch. 11.4)")
        # --8<-- [end:arguments]
        model = resolve_model(model, revision)  # NOTE 9: a local folder, or the hub snapshot of an id
        spec = load_model_spec(model)
        self.dtype = resolve_dtype(dtype, spec, self.device.type)
        requested_backend = attention_backend
        if attention_backend == "auto":
            attention_backend = "triton" if self.device.type == "cuda" else "torch"  # NOTE 8
        if attention_backend == "triton":
            _check_triton(requested_backend, self.device, block_size, spec.head_dim)  # NOTE 5
        self.cudagraph_memory_bytes = 0  # what the graphs take from the KV budget (GPU only)
        max_model_len = spec.max_position_embeddings if max_model_len is None else max_model_len
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{spec.max_position_embeddings}"
            )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max(8192, max_num_seqs) if max_num_batched_tokens is None else max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        per_block = bytes_per_block(spec.num_hidden_layers, block_size, spec.num_key_value_heads, spec.head_dim, self.dtype)
        if num_gpu_blocks_override is not None:
            check_fits_one_request(num_gpu_blocks_override, block_size, max_model_len)
            check_kv_cache_fits(num_gpu_blocks_override, per_block, available_memory_bytes(self.device))
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks_override)  # validates early

        self.tokenizer = load_tokenizer(model)
        eos_ids = load_eos_token_ids(model, self.tokenizer)
        tok_eos = self.tokenizer.eos_token_id
        self.eos_token_id = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        self.extra_stop_token_ids = tuple(e for e in eos_ids if e != self.eos_token_id)  # NOTE 1
        check_eos_token_ids(model, eos_ids, self.eos_token_id, spec.vocab_size)
        self.generation_defaults = generation_defaults(generation_config, model)  # NOTE 10
        if self.speculative_config is not None:  # NOTE 11: a default drafts cannot honour refuses here
            source = Path(model if generation_config == "auto" else generation_config) / "generation_config.json"
            check_defaults_with_speculation(self.generation_defaults, source)
        if reasoning_config is None:
            reasoning_config = reasoning_config_from_tokenizer(self.tokenizer, spec.vocab_size)  # NOTE 4
        else:
            for name in ("reasoning_start_token_ids", "reasoning_end_token_ids"):
                check_token_ids(f"reasoning_config.{name}", getattr(reasoning_config, name), spec.vocab_size)

        # --8<-- [start:kv_start_up]
        model_config = ModelConfig(
            model=str(model), spec=spec, dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=attention_backend, seed=seed, logits_processors=self.logits_processors,
            max_logprobs=self.max_logprobs,
        )  # fmt: skip
        device_config = DeviceConfig(str(self.device), gpu_memory_utilization, num_gpu_blocks_override, torch_threads)
        cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
        config = EngineConfig(
            scheduler_config, cache_config, reasoning_config, compilation, self.speculative_config,
            model_config, device_config,
        )  # fmt: skip
        executor = UniProcExecutor(config, self.eos_token_id)  # the worker: threads, seed, weights
        self.config = initialize_kv_caches(executor, config)  # KV blocks, the runner, its graphs
        # --8<-- [end:kv_start_up]
        worker = executor.driver_worker
        self.model, self.spec = worker.model, spec
        self.cudagraph_memory_bytes = worker.cudagraph_memory_bytes  # what the graphs took from the KV budget
        self.startup_report = worker.startup_report
        logger.info("tinyvllm start-up:\n  %s", "\n  ".join(self.startup_report.lines()))
        scheduler = Scheduler(scheduler_config, self.config.cache_config, log_stats=True)
        spec_config = self.speculative_config
        proposer = None if spec_config is None else NgramProposer(
            spec_config.num_speculative_tokens, spec_config.prompt_lookup_min, spec_config.prompt_lookup_max, max_model_len
        )  # fmt: skip
        self.engine = LLMEngine(
            scheduler, executor, self.tokenizer, self.eos_token_id,
            vocab_size=spec.vocab_size, reasoning_config=reasoning_config, proposer=proposer,
            max_logprobs=self.max_logprobs,
        )  # fmt: skip
        self._ids = itertools.count()

    # --8<-- [start:default_sampling_params]
    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (NOTE 10); ``SamplingParams()`` when it has none."""
        return SamplingParams(**self.generation_defaults)
    # --8<-- [end:default_sampling_params]

    def get_tokenizer(self):
        return self.tokenizer

    # -- generation -------------------------------------------------------------------------

    # --8<-- [start:prompt_inputs]
    def _prompt_inputs(self, index: int, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """``(text, token ids, cache_salt)`` of one prompt: a str, or a dict as vLLM takes it (NOTE 6)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids, None  # with BOS where the tokenizer adds one
        if not isinstance(prompt, dict):
            hint = " (token ids go in a dict: {'prompt_token_ids': [...]})" if isinstance(prompt, (list, tuple)) else ""
            raise TypeError(
                f"prompt {index} must be a str or a dict with 'prompt' or 'prompt_token_ids', got {prompt!r}{hint}"
            )
        unknown = [key for key in prompt if key not in PROMPT_KEYS]
        if unknown:
            raise ValueError(f"prompt {index} has an unknown key {unknown[0]!r}; a prompt dict takes {PROMPT_KEYS}")
        text, salt = prompt.get("prompt"), prompt.get("cache_salt")
        for key, value in (("prompt", text), ("cache_salt", salt)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"prompt {index}: {key!r} must be a str, got {value!r} ({type(value).__name__})")
        if salt == "":
            raise ValueError(f"prompt {index}: 'cache_salt' must be a non-empty string (or left out), got ''")
        if "prompt_token_ids" in prompt:
            return text, check_token_ids(f"prompt {index}", prompt["prompt_token_ids"], self.spec.vocab_size), salt
        if text is None:
            raise ValueError(f"prompt {index} needs 'prompt' (text) or 'prompt_token_ids', got {prompt!r}")
        return text, self.tokenizer(text).input_ids, salt
    # --8<-- [end:prompt_inputs]

    # --8<-- [start:eos_stops]
    def _with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        extra = [t for t in self.extra_stop_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *extra))
    # --8<-- [end:eos_stops]

    # --8<-- [start:prepare_request]
    def prepare_request(
        self, index: int, prompt: PromptType, params: SamplingParams, label: str = "sampling_params"
    ) -> tuple[str | None, list[int], SamplingParams, str | None]:
        """Check one prompt and its params against the model; ``(text, ids, params, cache_salt)``.

        Raises TypeError or ValueError naming prompt ``index`` or ``label``; changes nothing.
        ``generate`` calls it for every prompt before queuing any; ``AsyncLLM`` for each request.
        """
        text, ids, salt = self._prompt_inputs(index, prompt)
        max_len = self.config.scheduler_config.max_model_len
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) > max_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_model_len {max_len}")
        has_reasoning = self.config.reasoning_config is not None
        speculative = self.speculative_config is not None
        check_request_against_model(  # ids, thinking, logprobs
            label, params, self.spec.vocab_size, has_reasoning, speculative, self.max_logprobs
        )
        validate_logits_processors_parameters(self.logits_processors, params)  # custom processors' own checks
        return text, ids, self._with_eos_stops(params), salt
    # --8<-- [end:prepare_request]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in prompt order.

        ``prompts``: a str, a dict (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, each
        optionally with ``"cache_salt"``), or a list of them. Every prompt and every params
        object is checked before the first request is queued (NOTE 6).
        """
        # --8<-- [start:validation]
        check_bool("use_tqdm", use_tqdm)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a str, a prompt dict or a list of them, got {prompts!r}")
        prompts = list(prompts)
        single = sampling_params is None or isinstance(sampling_params, SamplingParams)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()  # NOTE 10
        if single:
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams, a list of them or None, got {sampling_params!r}")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        requests, in_use = [], self.engine.unfinished_request_ids()
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # every check before anything runs
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {p!r}")
            if p.output_kind != RequestOutputKind.FINAL_ONLY:  # generate returns finished outputs only, as vLLM's
                p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            label = "sampling_params" if single else f"sampling_params[{i}]"
            requests.append((self._next_request_id(in_use), *self.prepare_request(i, prompt, p, label)))
        added = []
        try:
            for req_id, text, ids, p, salt in requests:
                self.engine.add_request(req_id, ids, p, prompt=text, cache_salt=salt)
                added.append(req_id)
        except Exception:
            self.engine.abort_request(added)  # nothing half-started is left behind
            raise
        # --8<-- [end:validation]
        return self._run(added, use_tqdm)

    # --8<-- [start:chat]
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """The assistant's reply to each conversation, in order (NOTE 12); each output's
        ``prompt`` is the rendered text. ``chat_template``: a Jinja template or a file
        holding one, instead of the tokenizer's; ``chat_template_kwargs``: extra variables
        for it; ``continue_final_message=True`` (with ``add_generation_prompt=False``)
        continues the last message instead of opening a new assistant turn."""
        check_bool("use_tqdm", use_tqdm)
        check_bool("add_generation_prompt", add_generation_prompt)
        check_bool("continue_final_message", continue_final_message)
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message=True continues the last message, so it needs add_generation_prompt=False "
                "(which would open a new assistant turn)"
            )
        if chat_template is not None:
            template = load_chat_template(chat_template, "chat_template")
        else:
            template = getattr(self.tokenizer, "chat_template", None)
            if not template:
                raise ValueError(
                    "the model has no chat template: pass chat_template= (a Jinja template or a file holding one)"
                )
        kwargs = check_template_kwargs(chat_template_kwargs)
        prompts = []
        for i, conversation in enumerate(_conversations(messages)):
            if isinstance(conversation, Sequence) and not conversation:
                raise ValueError(f"conversation {i} holds no message")
            try:
                text = render_chat(
                    self.tokenizer, template, flatten_messages(conversation),
                    add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    template_kwargs=kwargs,
                )  # fmt: skip
            except (TypeError, ValueError) as error:
                raise type(error)(f"conversation {i}: {error}") from None
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm)
    # --8<-- [end:chat]

    def _next_request_id(self, in_use: set[str]) -> str:
        """``generate``'s next id, counting "0", "1", ...: a number not in ``in_use``, the ids of
        the engine's unfinished requests (a caller may have queued one through
        ``engine.add_request``)."""
        while (req_id := str(next(self._ids))) in in_use:
            pass
        return req_id

    # --8<-- [start:run_loop]
    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(req_ids), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():  # FINAL_ONLY: finished requests only
                        finished[out.request_id] = out
                        bar.update(1)
            except BaseException:  # the failed step is undone by the engine; drop the rest of this call
                self.engine.abort_request([r for r in req_ids if r not in finished])
                raise
        return [finished[r] for r in req_ids]
    # --8<-- [end:run_loop]


def _conversations(messages: Any) -> list[Any]:
    """``LLM.chat``'s ``messages`` as a list of conversations: one list of message dicts, or
    a list of such lists (an empty list is one empty conversation, refused by the caller)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of message dicts, or a list of such lists, got {messages!r}")
    if messages and all(isinstance(m, Sequence) and not isinstance(m, (str, bytes)) for m in messages):
        return list(messages)
    return [messages]
