"""Engine configuration: frozen dataclasses, validated once in ``__post_init__``.

Concept: every knob the engine reads, grouped by the component that reads it. A config
is built and checked once and never changed afterwards (no late filling of fields, no
class attributes used as globals).

Mirrors: ``vllm/config/`` (``SchedulerConfig``, ``CacheConfig``, ``ModelConfig``,
``DeviceConfig``, ``VllmConfig``) and ``vllm/config/compilation.py`` (``CompilationConfig``:
``cudagraph_mode``, capture sizes; the ``CUDAGraphMode`` enum lives there too, so the worker
imports it from here) and ``vllm/config/structured_outputs.py``.
Invalid values raise ``ValueError`` naming the field and the value; ``ReasoningConfig``,
which users build and pass to ``LLM``, follows ``tinyvllm.validation``'s rule (a wrong type
is a ``TypeError``). Whether its ids lie in the vocabulary is checked by the input processor
(``engine/input_processor.py``), which has the model's vocabulary size.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tinyvllm.core.request_queue import check_policy
from tinyvllm.sampling_params import MAX_LOGPROBS
from tinyvllm.validation import check_optional_int, check_token_ids

if TYPE_CHECKING:
    from tinyvllm.models.loader import ModelSpec
    from tinyvllm.pooling_params import PoolingModel


def check_known_keys(name: str, config: Mapping[str, object], known: set[str]) -> None:
    """A config dict's keys against its class's fields (every ``from_dict`` here): a ValueError
    naming the unknown ones and the known ones."""
    unknown = sorted(map(str, set(config) - known))
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known keys are {sorted(known)}")


# --8<-- [start:modes]
class CUDAGraphMode(enum.Enum):
    """How the model may run under CUDA graphs. ``NONE``, ``PIECEWISE`` and ``FULL`` are
    single modes (and the only runtime modes); the two tuple modes name a routine for
    uniform decode batches first and one for every other batch second."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (FULL, NONE)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        """True for the two-mode settings: decode and mixed batches go different ways."""
        return isinstance(self.value, tuple)

    def decode_mode(self) -> CUDAGraphMode:
        """The runtime mode for uniform decode batches."""
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> CUDAGraphMode:
        """The runtime mode for prefill and mixed batches."""
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: CUDAGraphMode) -> bool:
        """Whether this setting can ever dispatch to the single mode ``mode``."""
        if mode.separate_routine():
            raise ValueError(f"has_mode takes a single mode, got {mode.name}")
        return mode in (self.decode_mode(), self.mixed_mode())

    def has_full_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.FULL)

    def has_piecewise_cudagraphs(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    @classmethod
    def valid_runtime_modes(cls) -> frozenset[CUDAGraphMode]:
        """What ``dispatch`` may return and what a wrapper may be bound to (plus NONE)."""
        return frozenset({cls.NONE, cls.PIECEWISE, cls.FULL})
# --8<-- [end:modes]


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put into one step.

    Attributes:
        max_num_batched_tokens: the token budget of one step (seed 002 opening).
        max_num_seqs: the most requests running at once.
        max_model_len: the most tokens (prompt + output) one request may reach.
        long_prefill_token_threshold: when > 0, caps every prefill chunk at this many tokens.
        enable_chunked_prefill: when False, a prompt is scheduled whole or waits.
        async_scheduling: schedule the next step while the last one runs on the device
            (``core/async_scheduler.py``; vLLM's flag of that name).
        policy: the waiting queue's order and the preemption victim, ``"fcfs"`` or
            ``"priority"`` (``core/request_queue.py``; vLLM's ``--scheduling-policy``).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        check_policy(self.policy, "policy")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold > 0:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} chunks prompts, "
                "which needs enable_chunked_prefill=True"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache's shape and policy.

    Attributes:
        block_size: tokens per KV-cache block.
        num_gpu_blocks: blocks in the pool; None until the engine measures memory.
        enable_prefix_caching: reuse cached full blocks across requests.
        hash_algo: "sha256" (default) or "builtin" (see ``core.prefix_hash``).
        num_preallocate_tokens: extra tokens' worth of blocks handed out with each new
            allocation (seed 003's preallocation); 0 turns it off.
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    num_preallocate_tokens: int = 0

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.num_gpu_blocks is not None:
            _check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        if self.hash_algo not in ("sha256", "builtin"):
            raise ValueError(f"unknown hash_algo {self.hash_algo!r}; choose 'sha256' or 'builtin'")
        _check_int("num_preallocate_tokens", self.num_preallocate_tokens, 0)


@dataclass(frozen=True)
class CompilationConfig:
    """How the model runs under CUDA graphs (seed 000 "CudagraphModes" and "使用指南").

    Attributes:
        cudagraph_mode: the requested mode; None means the platform default
            (FULL_AND_PIECEWISE on CUDA, NONE on the CPU). The runner may still downgrade
            it to what the attention backend supports.
        cudagraph_capture_sizes: the padded token counts to capture graphs for; None means
            vLLM's default list up to ``max_cudagraph_capture_size``.
        max_cudagraph_capture_size: the largest default capture size; None means
            ``min(2 * max_num_seqs, 512)``, as vLLM does.
    """

    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None

    def __post_init__(self) -> None:
        if self.cudagraph_mode is not None and not isinstance(self.cudagraph_mode, CUDAGraphMode):
            raise ValueError(f"cudagraph_mode must be a CUDAGraphMode or None, got {self.cudagraph_mode!r}")
        if self.cudagraph_capture_sizes is not None:
            sizes = self.cudagraph_capture_sizes
            if isinstance(sizes, (str, bytes, Mapping)) or not hasattr(sizes, "__iter__"):
                raise ValueError(f"cudagraph_capture_sizes must be a list of ints, got {sizes!r}")
            sizes = tuple(sizes)
            if not sizes:
                raise ValueError("cudagraph_capture_sizes must not be empty (use cudagraph_mode NONE instead)")
            for size in sizes:
                _check_int("every cudagraph_capture_sizes entry", size, 1)
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        if self.max_cudagraph_capture_size is not None:
            _check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, 1)

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> "CompilationConfig":
        """Build from a dict like vLLM's ``--compilation-config``; unknown keys are a ValueError."""
        if not isinstance(config, Mapping):
            raise ValueError(f"compilation_config must be a dict, got {config!r}")
        known = {"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"}
        check_known_keys("compilation_config", config, known)
        values = dict(config)
        if values.get("cudagraph_mode") is not None:  # None: the platform default, as documented
            values["cudagraph_mode"] = parse_cudagraph_mode(values["cudagraph_mode"])
        return cls(**values)


def parse_cudagraph_mode(value: object) -> CUDAGraphMode:
    """A ``CUDAGraphMode`` or its name in capitals ("FULL_AND_PIECEWISE"), as vLLM's CLI takes it."""
    if isinstance(value, CUDAGraphMode):
        return value
    if isinstance(value, str) and value in CUDAGraphMode.__members__:
        return CUDAGraphMode[value]
    raise ValueError(f"cudagraph_mode must be one of {list(CUDAGraphMode.__members__)}, got {value!r}")


# --8<-- [start:speculative]
@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with n-gram prompt lookup (vLLM's ``speculative_config``).

    Attributes:
        method: how drafts are proposed; ``"ngram"`` (prompt lookup) is the one built.
        num_speculative_tokens: the most drafts per request per step (k >= 1).
        prompt_lookup_min, prompt_lookup_max: the shortest and longest suffix the proposer
            looks for (``spec_decode/ngram_proposer.py``); as in vLLM, when neither is given
            both are 5, and when one is given the other equals it.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram' (n-gram prompt lookup), got {self.method!r}")
        _check_int("speculative_config num_speculative_tokens", self.num_speculative_tokens, 1)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = (5, 5) if low is None and high is None else (low if low is not None else high, high if high is not None else low)
        _check_int("speculative_config prompt_lookup_min", low, 1)
        _check_int("speculative_config prompt_lookup_max", high, 1)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min {low} > prompt_lookup_max {high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> "SpeculativeConfig":
        """Build from a dict like vLLM's ``--speculative-config``; unknown keys are a ValueError."""
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {config!r}")
        check_known_keys("speculative_config", config, {"method", "num_speculative_tokens", "prompt_lookup_min",
                                                        "prompt_lookup_max"})  # fmt: skip
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**config)
# --8<-- [end:speculative]


# --8<-- [start:structured_outputs_config]
@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How requests with ``SamplingParams.structured_outputs`` are constrained
    (``structured_output/``; vLLM's ``StructuredOutputsConfig``).

    Attributes:
        backend: the grammar library; "xgrammar" (vLLM's default) is the one built here.
        enable_in_reasoning: False (vLLM's default): a request inside a think section is not
            constrained until the section ends (``structured_output/manager.py`` NOTE 4).
    """

    backend: str = "xgrammar"
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("xgrammar", "auto"):
            raise ValueError(f"structured_outputs_config backend must be 'xgrammar' (or 'auto'), got {self.backend!r}")
        if not isinstance(self.enable_in_reasoning, bool):
            raise TypeError(f"structured_outputs_config enable_in_reasoning must be a bool, got {self.enable_in_reasoning!r}")
        object.__setattr__(self, "backend", "xgrammar")  # "auto" picks the one backend

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> "StructuredOutputsConfig":
        """Build from a dict like vLLM's ``structured_outputs_config``; unknown keys are a ValueError."""
        if not isinstance(config, Mapping):
            raise TypeError(f"structured_outputs_config must be a dict, got {config!r}")
        check_known_keys("structured_outputs_config", config, {"backend", "enable_in_reasoning"})
        return cls(**config)
# --8<-- [end:structured_outputs_config]


# --8<-- [start:pooler_config]
POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNER_TYPES = ("generate", "pooling")  # engine_args.py takes "auto" too, and resolves it


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine (``runner="pooling"``) makes one vector of a prompt's hidden
    states (``worker/pooler.py``; vLLM's ``PoolerConfig``).

    Attributes:
        pooling_type: "LAST" (the last prompt token's hidden state: a causal model's only
            state that has read the whole prompt), "MEAN" (the mean over the prompt) or "CLS"
            (the first token's). None: the model folder's sentence-transformers ``Pooling``
            module says, else "LAST" (vLLM's default for an embedding model made of a
            causal LM).
        normalize: L2-normalise each vector (a request's ``PoolingParams.normalize`` may
            override it). None: whether the folder's sentence-transformers modules end in
            ``Normalize``, else True (vLLM's default for embeddings).
        step_tag_id: a token task keeps only the rows of the prompt positions holding this
            token id (vLLM's step pooling: a process reward model scores each step at the tag
            that ends it); a request's ``PoolingParams.step_tag_id`` may override it. None:
            every row.
    """

    pooling_type: str | None = None
    normalize: bool | None = None
    step_tag_id: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of {POOLING_TYPES} or None, got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise TypeError(f"pooler_config normalize must be a bool or None, got {self.normalize!r}")
        object.__setattr__(self, "step_tag_id", check_optional_int("pooler_config step_tag_id", self.step_tag_id, 0))

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> "PoolerConfig":
        """Build from a dict like vLLM's ``--pooler-config``; unknown keys are a ValueError."""
        if not isinstance(config, Mapping):
            raise TypeError(f"pooler_config must be a dict, got {config!r}")
        check_known_keys("pooler_config", config, {"pooling_type", "normalize", "step_tag_id"})
        return cls(**config)
# --8<-- [end:pooler_config]


@dataclass(frozen=True)
class ModelConfig:
    """The model as the worker loads it: every field resolved and checked.

    Attributes:
        model: a local folder (a hub id is resolved before this is built).
        spec: its ``config.json`` as read by ``models/loader.py`` (``ModelSpec``).
        dtype: "float32", "float16" or "bfloat16" (``"auto"`` already resolved).
        attention_backend: "triton", "torch" or "reference" (``"auto"`` already resolved).
        seed: the global seed set before the weights load.
        logits_processors: custom processor classes or "module:QualName" strings, imported once.
        max_logprobs: the most logprobs a request may ask for; -1: no cap.
        generation_config: where the sampling defaults come from: "auto" (the model's
            ``generation_config.json``), "vllm" (none) or a folder; read by the input processor.
        runner_type: "generate" (sampling tokens) or "pooling" (one vector per prompt).
        pooler_config: a pooling engine's, every field resolved; None for "generate".
        pooling_model: what a pooling engine's model does (tasks, matryoshka, activations,
            labels: ``pooling_params.PoolingModel``); None for "generate".
        hf_overrides: fields laid over the folder's config.json (vLLM's ``hf_overrides``), read
            again by the worker when it loads the weights; None: none.
    """

    model: str | Path
    spec: "ModelSpec"
    dtype: str
    attention_backend: str
    seed: int = 0
    logits_processors: tuple = ()
    max_logprobs: int = MAX_LOGPROBS
    generation_config: str = "auto"
    runner_type: str = "generate"
    pooler_config: PoolerConfig | None = None
    pooling_model: "PoolingModel | None" = None
    hf_overrides: dict | None = None

    def __post_init__(self) -> None:
        pooling = self.runner_type == "pooling"
        if pooling != (self.pooler_config is not None) or pooling != (self.pooling_model is not None) or self.runner_type not in RUNNER_TYPES:
            raise ValueError(f"ModelConfig: runner_type {self.runner_type!r} with pooler_config {self.pooler_config!r}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"ModelConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.attention_backend not in ("triton", "torch", "reference"):
            raise ValueError(f"ModelConfig.attention_backend must be resolved, got {self.attention_backend!r}")


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs and how much of it the engine may take.

    Attributes:
        device: "cpu", "cuda" or "cuda:N" (``"auto"`` already resolved).
        gpu_memory_utilization: the fraction of the GPU's memory the engine may use (CUDA).
        num_gpu_blocks_override: KV blocks to allocate instead of profiling; None: profile
            (CUDA) or the CPU's byte budget.
        torch_threads: intra-op threads for the process; None: torch's as it is.
    """

    device: str = "cpu"
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    torch_threads: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices the model is split over, and who starts their workers.

    Attributes:
        tensor_parallel_size: ranks the weights and the KV heads are split over (Megatron's
            tensor parallelism, ``docs/tensor_parallel.md``); 1: one worker, no process group.
        distributed_executor_backend: "uni" (one worker in the engine's process), "mp" (a
            worker process per rank, the default for more than one) or "external_launcher"
            (every rank started by ``torchrun``, each running the same engine on the same
            inputs), as vLLM's.
    """

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    """All configs of one engine, handed to components that need more than one.

    ``reasoning_config`` (seed 001 ch. 13) turns on the thinking-token budget; None
    (the default) means the model has no think sections. ``model_config`` is None for an
    engine assembled by hand (tests); ``cache_config.num_gpu_blocks`` is None until the
    worker has sized the KV cache.
    """

    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    reasoning_config: "ReasoningConfig | None" = None
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
    model_config: ModelConfig | None = None
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)


@dataclass(frozen=True)
class ReasoningConfig:
    """The token sequences that open and close a reasoning ("think") section.

    Seed 001 ch. 13.3: the thinking budget is enabled when this config exists. Both
    sequences may be several tokens long (e.g. ``<|end_thinking|>`` split by the tokenizer);
    an empty end sequence disables budget tracking (nothing could be forced). ``LLM``
    builds one from the tokenizer when the vocabulary has ``<think>`` and ``</think>`` as
    single tokens and none is passed.

    Attributes:
        reasoning_start_token_ids: the sequence that opens a think section.
        reasoning_end_token_ids: the sequence that closes it, forced when the budget runs out.
    """

    reasoning_start_token_ids: tuple[int, ...] = ()
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("reasoning_start_token_ids", "reasoning_end_token_ids"):
            value = getattr(self, name)
            ids = () if value is None else tuple(check_token_ids(name, value))  # TypeError, or ValueError if < 0
            object.__setattr__(self, name, ids)
