"""EngineArgs: every engine argument, checked once, into an ``EngineConfig``.

Concept: the arguments of ``LLM(...)`` (so of ``AsyncLLM`` and the CLI) as one dataclass, and
``create_engine_config()``, the one place each is checked (``tinyvllm.validation``'s rule: a
wrong type TypeError, a wrong value ValueError, naming both) and resolved into a frozen config:
the device, compilation (NOTE 3), the model folder (NOTE 4), its dtype and attention backend
(NOTE 6), the limits (NOTE 2). The input processor adds what needs the tokenizer.

Mirrors: ``vllm/engine/arg_utils.py`` (``EngineArgs``, ``create_engine_config``) and vLLM's config checks.

Invariants: ``create_engine_config`` changes nothing and starts nothing (no weights, no
device memory); every check a bad argument can fail runs before the model folder is read,
except those that need the folder (dtype, max_model_len, the Triton tile sizes, the runner).

NOTE 1 (defaults): vLLM's ``LLM``'s where it has the argument; ``model``: the shipped ``STDLIB_TINY``.
NOTE 2 (limits): ``max_model_len`` is the model's ``max_position_embeddings`` when unset, and
may not exceed it; ``max_num_batched_tokens`` is ``max(8192, max_num_seqs)``. A
``num_gpu_blocks_override`` must hold one request of ``max_model_len`` tokens and fit in
free memory (``worker/kv_cache.py`` NOTE 3).
NOTE 3 (CUDA graphs): ``compilation_config`` is vLLM's dict or a ``CompilationConfig``;
``enforce_eager=True`` means NONE. The default is FULL_AND_PIECEWISE on CUDA, NONE on the
CPU, where any other mode runs emulated graphs (seed 000, vLLM's "CUDA Graphs").
NOTE 4 (model ids): ``model`` is a folder or a hub id (``org/name``), ``revision`` a branch,
tag or commit; ``models/hub.py`` resolves it into the hub cache (a folder of that spelling
wins), after the other arguments are checked and before the folder is read.
NOTE 5 (sampling defaults): ``generation_config`` is vLLM's: ``"auto"`` takes the model's
``generation_config.json`` defaults, ``"vllm"`` none, a folder its file, read once
(``sampling_defaults.py``) by the input processor. EOS ids always come from the model folder.
NOTE 6 (attention backends): "triton" (CUDA-graph safe), "torch" (``torch_sdpa.py``, decodes
batched into SDPA calls) and "reference" (a loop over requests, the specification);
"auto" picks Triton on CUDA and torch on the CPU, the faster without Triton's interpreter.
A Triton backend (asked for, or "auto" on CUDA) that could not run is refused here: the
kernels run on CUDA or under ``TRITON_INTERPRET=1`` and tile with ``tl.dot``
(``block_size``, ``head_dim`` powers of two >= 16).
NOTE 7 (speculative decoding): ``speculative_config={"method": "ngram",
"num_speculative_tokens": k, ...}`` turns on n-gram prompt lookup (``spec_decode/``). As seed
001 ch. 11.4 says, only MinTokens is built then: custom logits processors are refused here.
NOTE 8 (custom logits processors): ``logits_processors`` takes ``LogitsProcessor`` classes and
``"module.path:QualName"`` strings, as vLLM's ``LLM``, imported here so a bad name fails
before any weight loads; they run after the built-ins and any plugin.
NOTE 9 (the command line): ``add_cli_args`` declares the engine flags every engine command
takes and ``from_cli_args`` reads them back, as vLLM's; ``tinyvllm --help`` and a typo must
not wait for torch, so this module imports torch, and what needs it, only where it is used.
The command line checks its flags before torch loads with the rules here (``check_counts``,
``resolve_max_model_len``, ``SpeculativeConfig``, ``check_generation_config``), each spelling
the flag's name: no rule of an engine argument is written twice.
NOTE 10 (tensor parallelism): ``tensor_parallel_size`` N and ``distributed_executor_backend``
are vLLM's: None picks "uni" (one worker here) for N = 1 and "mp" (a process per rank) for
more; "external_launcher" runs one rank in this process, its peers started alike by
``torchrun``. N must split the model's heads (``distributed/utils.py``) and, with NCCL, not
pass the GPUs present; all of it is refused here, before any process starts.
NOTE 11 (async scheduling): ``async_scheduling=True`` (``--async-scheduling``) has the engine
schedule a step while the last one runs (``core/async_scheduler.py``); with speculative
decoding the runner proposes the drafts (its NOTE 6). ``scheduling_policy`` ("fcfs",
"priority": ``core/request_queue.py``) is vLLM's ``--scheduling-policy``.
NOTE 12 (pooling, ``docs/pooling.md``): ``runner`` "auto" is "pooling" for a classifier (no LM
head: "generate" is refused), else "generate" (a ``pooler_config`` is then refused); "pooling"
refuses drafts and custom logits processors (seed 001 ch. 11); ``pooler_config``'s unset fields
come from the folder (``models/pooling_spec.py``); ``hf_overrides`` over config.json (``loader.py`` NOTE 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tinyvllm.config import (
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    ReasoningConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from tinyvllm.core.request_queue import SCHEDULING_POLICIES, check_policy
from tinyvllm.distributed.utils import check_tensor_parallel_size, kv_heads_per_rank
from tinyvllm.models.hub import check_revision, resolve_model
from tinyvllm.models.loader import ModelSpec, load_model_spec, resolve_dtype
from tinyvllm.models.model_files import check_hf_overrides
from tinyvllm.models.pooling_spec import resolve_pooling_model
from tinyvllm.platform import triton_can_run_on
from tinyvllm.sampling_defaults import check_generation_config
from tinyvllm.sampling_params import MAX_LOGPROBS
from tinyvllm.stdlib_tiny import STDLIB_TINY
from tinyvllm.validation import INT64_MAX, INT64_MIN, check_bool, check_int, check_optional_int, check_real
from tinyvllm.worker.cudagraph_dispatcher import CUDAGraphMode

if TYPE_CHECKING:
    import torch

    from tinyvllm.sample.logits_processors.interface import LogitsProcessor

    LogitsProcessorSpec = str | type[LogitsProcessor]

ATTENTION_BACKENDS = ("auto", "triton", "torch", "reference")  # NOTE 6
# How the command line spells the counts it sets, so that the rules below name the flag (NOTE 9).
CLI_NAMES = {"max_model_len": "--max-model-len", "num_gpu_blocks_override": "--num-gpu-blocks-override",
             "torch_threads": "--threads", "tensor_parallel_size": "--tensor-parallel-size",
             "distributed_executor_backend": "--distributed-executor-backend"}  # fmt: skip
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")  # NOTE 10
RUNNERS = ("auto", "generate", "pooling")  # NOTE 12
# The five CUDAGraphMode names, spelled out so that `tinyvllm --help` imports no torch (NOTE 9).
MODE_NAMES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@dataclass
class EngineArgs:
    """Every argument of ``LLM`` (NOTE 1), unchecked until ``create_engine_config``."""

    model: str = STDLIB_TINY
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    attention_backend: str = "auto"
    seed: int = 0
    reasoning_config: ReasoningConfig | None = None
    compilation_config: dict | CompilationConfig | None = None
    enforce_eager: bool = False
    logits_processors: Sequence[LogitsProcessorSpec] | None = None
    revision: str | None = None
    generation_config: str = "auto"
    speculative_config: dict | SpeculativeConfig | None = None
    max_logprobs: int = MAX_LOGPROBS
    torch_threads: int | None = None
    tensor_parallel_size: int = 1  # NOTE 10
    distributed_executor_backend: str | None = None
    async_scheduling: bool = False  # NOTE 11
    scheduling_policy: str = "fcfs"  # NOTE 11
    structured_outputs_config: dict | StructuredOutputsConfig | None = None
    runner: str = "auto"  # NOTE 12
    pooler_config: dict | PoolerConfig | None = None
    hf_overrides: dict | str | None = None  # NOTE 12: laid over config.json; a str is JSON

    # --8<-- [start:add_cli_args]
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        """The flags that build the engine, shared by ``generate``, ``serve`` and ``trace`` (not ``--model``)."""
        p.add_argument("--no-prefix-caching", action="store_true")
        p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch", "reference"])
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
        p.add_argument("--device", default="auto")
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--num-gpu-blocks-override", type=int, default=None)
        p.add_argument(
            "--cudagraph-mode", default=None, choices=MODE_NAMES,
            help="CUDA graphs (default: FULL_AND_PIECEWISE on CUDA, NONE on the CPU, where other modes are emulated)",
        )  # fmt: skip
        p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (cudagraph mode NONE)")
        p.add_argument(
            "--generation-config", default="auto", metavar="{auto,vllm,PATH}",
            help="sampling defaults: the model's generation_config.json (auto), none (vllm), or a folder's",
        )  # fmt: skip
        p.add_argument(
            "--max-logprobs", type=int, default=MAX_LOGPROBS,
            help="the most logprobs (or prompt logprobs) a request may ask for; -1: no cap (vLLM's engine argument)",
        )  # fmt: skip
        p.add_argument(
            "--speculative-config", default=None, metavar="JSON",
            help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\'',
        )  # fmt: skip
        p.add_argument(
            "--threads", type=int, default=None, metavar="N",
            help="torch CPU threads (default: 1 for a model under 100M parameters on the CPU, else torch's; cpu_threads.py)",
        )  # fmt: skip
        p.add_argument(
            "--tensor-parallel-size", type=int, default=1, metavar="N",
            help="split the model over N ranks, a worker process each (tensor parallelism; gloo on the CPU, NCCL on CUDA)",
        )  # fmt: skip
        p.add_argument(
            "--async-scheduling", action="store_true",
            help="schedule the next step while the last one runs on the device (vLLM's flag)",
        )  # fmt: skip
        p.add_argument(
            "--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
            help="the waiting queue's order: first come first served, or by each request's priority "
            "(lower first), which also picks whom to preempt (vLLM's flag)",
        )  # fmt: skip
        p.add_argument(
            "--distributed-executor-backend", default=None, choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
            help="who runs the ranks: uni (this process; N = 1), mp (a process per rank; N > 1) or "
            "external_launcher (torchrun starts every rank)",
        )  # fmt: skip
        p.add_argument(
            "--hf-overrides", default=None, metavar="JSON",
            help='fields laid over the model\'s config.json (vLLM\'s flag), e.g. a causal LM read as a reranker: '
            '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
            '"method": "from_2_way_softmax"}\'',
        )  # fmt: skip
    # --8<-- [end:add_cli_args]

    # --8<-- [start:from_cli_args]
    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, torch_threads: int | None = None) -> EngineArgs:
        """The arguments the parsed flags give; ``args.model_folder`` (the CLI resolved a hub id
        already) wins over ``--model``, and ``args.speculative`` is ``--speculative-config``
        parsed, ``args.pooler`` serve's ``--pooler-config``. ``tinyvllm trace`` adds ``--block-size``,
        ``--max-num-seqs`` and ``--max-num-batched-tokens``; the other commands take the defaults."""
        folder = getattr(args, "model_folder", None)  # resolved once: the engine does not ask the hub again
        return cls(
            folder or args.model, revision=None if folder else getattr(args, "revision", None), dtype=args.dtype,
            device=args.device, max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
            attention_backend=args.attention_backend, num_gpu_blocks_override=args.num_gpu_blocks_override,
            enforce_eager=args.enforce_eager,
            compilation_config={"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else None,
            generation_config=getattr(args, "generation_config", "auto"),
            block_size=getattr(args, "block_size", 16), max_num_seqs=getattr(args, "max_num_seqs", 256),
            max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),  # tinyvllm trace's own flags
            speculative_config=getattr(args, "speculative", None), max_logprobs=getattr(args, "max_logprobs", MAX_LOGPROBS),
            torch_threads=torch_threads, tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
            async_scheduling=getattr(args, "async_scheduling", False),
            scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),
            runner=getattr(args, "runner", "generate"), pooler_config=getattr(args, "pooler", None),  # serve's flags
            hf_overrides=getattr(args, "hf_overrides", None),
        )  # fmt: skip
    # --8<-- [end:from_cli_args]

    # --8<-- [start:create_engine_config]
    def create_engine_config(self) -> EngineConfig:
        """Check every argument, resolve the model folder and read its spec; no weights load."""
        from tinyvllm.worker.kv_cache import (  # torch: NOTE 9
            available_memory_bytes,
            bytes_per_block,
            check_fits_one_request,
            check_kv_cache_fits,
        )

        # --8<-- [start:arguments]
        model, dtype, attention_backend = self.model, self.dtype, self.attention_backend
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a local folder or a Hugging Face model id (a str), got {model!r}")
        revision = check_revision(self.revision)
        device = _resolve_device(self.device)
        for name, value in (("dtype", dtype), ("attention_backend", attention_backend)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {value!r} ({type(value).__name__})")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        max_model_len, num_gpu_blocks_override, torch_threads = check_counts(
            self.max_model_len, self.num_gpu_blocks_override, self.torch_threads
        )  # None: the model's length, profiling, torch's threads as they are (cpu_threads.py)
        tensor_parallel_size, executor_backend = check_parallel(
            self.tensor_parallel_size, self.distributed_executor_backend
        )  # NOTE 10
        block_size = check_int("block_size", self.block_size, 1)
        gpu_memory_utilization = check_real("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        enable_prefix_caching = check_bool("enable_prefix_caching", self.enable_prefix_caching)
        max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1)
        max_num_batched_tokens = check_optional_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        seed = check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        max_logprobs = check_int("max_logprobs", self.max_logprobs, -1)  # -1: no cap, as vLLM
        reasoning_config = self.reasoning_config
        if reasoning_config is not None and not isinstance(reasoning_config, ReasoningConfig):
            raise TypeError(f"reasoning_config must be a ReasoningConfig or None, got {reasoning_config!r}")
        compilation = _compilation_config(self.compilation_config, self.enforce_eager)
        logits_processors = _checked_logits_processors(self.logits_processors)
        generation_config = check_generation_config(self.generation_config)  # NOTE 5
        speculative_config = _speculative_config(self.speculative_config)  # NOTE 7
        if speculative_config is not None and logits_processors:
            raise ValueError("custom logits_processors cannot be combined with speculative decoding (seed 001 ch. 11.4)")
        async_scheduling = check_bool("async_scheduling", self.async_scheduling)
        check_policy(self.scheduling_policy)  # NOTE 11: before the model folder is read
        structured_outputs_config = self.structured_outputs_config
        if isinstance(structured_outputs_config, Mapping):  # vLLM's {"backend": "xgrammar"}
            structured_outputs_config = StructuredOutputsConfig.from_dict(structured_outputs_config)
        elif structured_outputs_config is None:
            structured_outputs_config = StructuredOutputsConfig()
        elif not isinstance(structured_outputs_config, StructuredOutputsConfig):
            raise TypeError(f"structured_outputs_config must be a dict, a StructuredOutputsConfig or None, got {structured_outputs_config!r}")
        runner, pooler_config = check_runner(self.runner, self.pooler_config, speculative_config, logits_processors)
        hf_overrides = check_hf_overrides(self.hf_overrides)
        # --8<-- [end:arguments]
        model = resolve_model(model, revision)  # NOTE 4: a local folder, or the hub snapshot of an id
        spec = load_model_spec(model, hf_overrides)
        runner, pooler_config = check_runner(runner, pooler_config, speculative_config, logits_processors, spec)
        pooling = None if pooler_config is None else resolve_pooling_model(
            pooler_config.pooling_type, pooler_config.normalize, model, spec.hidden_size, spec.labels, hf_overrides,
            pooler_config.step_tag_id)  # fmt: skip
        torch_dtype = resolve_dtype(dtype, spec, device.type)
        check_tensor_parallel_size(
            tensor_parallel_size, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
        )  # NOTE 10: the heads split, or a one-line error naming tensor_parallel_size
        _check_gpus(tensor_parallel_size, executor_backend, device)
        requested_backend = attention_backend
        if attention_backend == "auto":
            attention_backend = "triton" if device.type == "cuda" else "torch"  # NOTE 6
        if attention_backend == "triton":
            _check_triton(requested_backend, device, block_size, spec.head_dim)  # NOTE 6
        max_model_len = resolve_max_model_len(max_model_len, spec)  # NOTE 2
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max(8192, max_num_seqs) if max_num_batched_tokens is None else max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            async_scheduling=async_scheduling,
            policy=self.scheduling_policy,
        )
        num_kv_heads = kv_heads_per_rank(spec.num_key_value_heads, tensor_parallel_size)  # one rank's cache
        per_block = bytes_per_block(spec.num_hidden_layers, block_size, num_kv_heads, spec.head_dim, torch_dtype)
        if num_gpu_blocks_override is not None:  # NOTE 2
            check_fits_one_request(num_gpu_blocks_override, block_size, max_model_len)
            if device.type == "cpu" or tensor_parallel_size == 1:  # every rank's cache in this memory
                per_block *= tensor_parallel_size
                check_kv_cache_fits(num_gpu_blocks_override, per_block, available_memory_bytes(device))
            # else each rank's own GPU: the workers check it (``initialize_kv_caches``), and the
            # engine's process opens no CUDA context of its own
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks_override)  # validates early
        return EngineConfig(
            scheduler_config,
            CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),  # sized at start-up
            reasoning_config,  # checked, or built from the tokenizer, by the input processor
            compilation,
            speculative_config,
            ModelConfig(
                model, spec, str(torch_dtype).removeprefix("torch."), attention_backend, seed,
                logits_processors, max_logprobs, generation_config, runner,
                None if pooling is None else PoolerConfig(pooling.pooling_type, pooling.normalize, pooling.step_tag_id),
                pooling, hf_overrides,
            ),
            DeviceConfig(str(device), gpu_memory_utilization, num_gpu_blocks_override, torch_threads),
            ParallelConfig(tensor_parallel_size, executor_backend),
            structured_outputs_config,
        )
    # --8<-- [end:create_engine_config]


# --8<-- [start:runner]
def check_runner(
    runner: object, pooler_config: object, speculative: SpeculativeConfig | None, logits_processors: tuple,
    spec: ModelSpec | None = None,
) -> tuple[str, PoolerConfig | None]:
    """NOTE 12: the runner type, and the pooler config a pooling engine starts from. Without
    ``spec`` (the command line, before the folder is read) "auto" is left undecided."""
    if not isinstance(runner, str) or runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    if isinstance(pooler_config, Mapping):
        pooler_config = PoolerConfig.from_dict(pooler_config)
    elif pooler_config is not None and not isinstance(pooler_config, PoolerConfig):
        raise TypeError(f"pooler_config must be a dict, a PoolerConfig or None, got {pooler_config!r}")
    if pooler_config is not None and runner == "generate":
        raise ValueError(f"pooler_config={pooler_config!r} needs runner='pooling', got runner={runner!r}")
    classifier = spec is not None and spec.labels is not None
    if runner == "auto":
        if spec is None:
            return runner, pooler_config
        runner = "pooling" if classifier else "generate"
        if runner == "generate" and pooler_config is not None:  # a causal LM: it generates unless told to pool
            raise ValueError(f"pooler_config={pooler_config!r} needs runner='pooling': runner='auto' chose 'generate' "
                             f"for {spec.architecture}, which has an LM head")  # fmt: skip
    if runner == "generate":
        if classifier:
            raise ValueError(f"runner='generate': {spec.architecture} has a score head and no LM head, so it cannot "
                             "generate; it classifies and scores (runner='pooling', or 'auto')")  # fmt: skip
        return runner, None
    refused = [name for name, on in (("speculative_config", speculative is not None),
               ("custom logits_processors", bool(logits_processors))) if on]  # fmt: skip
    if refused:  # async scheduling pools as it samples: the step that ends a prompt leaves no token to feed
        raise ValueError(
            f"runner='pooling' cannot be combined with {refused[0]}: a pooling request samples no token "
            "(no drafts to verify, no logits to process)"
        )
    return runner, pooler_config or PoolerConfig()
# --8<-- [end:runner]


# --8<-- [start:shared_rules]
def check_counts(
    max_model_len: object, num_gpu_blocks_override: object, torch_threads: object, names: Mapping[str, str] = {}
) -> tuple[int | None, int | None, int | None]:
    """The three optional counts, each None or an int >= 1; ``names`` spells them as the
    caller takes them (the command line's ``CLI_NAMES``). Torch-free (NOTE 9)."""
    values = {"max_model_len": max_model_len, "num_gpu_blocks_override": num_gpu_blocks_override,
              "torch_threads": torch_threads}  # fmt: skip
    return tuple(check_optional_int(names.get(key, key), value, 1) for key, value in values.items())


def check_parallel(
    tensor_parallel_size: object, distributed_executor_backend: object, names: Mapping[str, str] = {}
) -> tuple[int, str]:
    """NOTE 10: the size, an int >= 1, and the backend it runs on (None: "uni" for 1, "mp"
    for more), each named as the caller takes it. Torch-free (NOTE 9)."""
    size_name = names.get("tensor_parallel_size", "tensor_parallel_size")
    backend_name = names.get("distributed_executor_backend", "distributed_executor_backend")
    size = check_int(size_name, tensor_parallel_size, 1)
    backend = distributed_executor_backend
    if backend is None:
        return size, "uni" if size == 1 else "mp"
    if not isinstance(backend, str):
        raise TypeError(f"{backend_name} must be a str or None, got {backend!r} ({type(backend).__name__})")
    if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise ValueError(f"{backend_name} must be one of {DISTRIBUTED_EXECUTOR_BACKENDS} or None, got {backend!r}")
    if backend == "uni" and size > 1:
        raise ValueError(f"{backend_name} 'uni' runs one worker, but {size_name} is {size}: use 'mp'")
    return size, backend


def resolve_max_model_len(max_model_len: int | None, spec: ModelSpec, name: str = "max_model_len", where: str = "") -> int:
    """NOTE 2: ``max_model_len``, or the model's ``max_position_embeddings`` when None; a
    ValueError naming ``name`` (and ``where`` the model's config is) past it. Torch-free."""
    if max_model_len is None:
        return spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"{name} {max_model_len} exceeds the model's max_position_embeddings {spec.max_position_embeddings}{where}"
        )
    return max_model_len
# --8<-- [end:shared_rules]


def _resolve_device(device: str | torch.device) -> torch.device:
    import torch  # NOTE 9

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


def _check_gpus(tensor_parallel_size: int, backend: str, device: torch.device) -> None:
    """NCCL wants a GPU per rank: refuse more "mp" ranks than GPUs present (NOTE 10)."""
    import torch  # NOTE 9

    from tinyvllm.distributed.parallel_state import default_backend

    if backend != "mp" or device.type != "cuda" or default_backend("cuda") != "nccl":
        return
    present = torch.cuda.device_count()
    if tensor_parallel_size > present:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} needs a GPU per rank (NCCL), but {present} are present"
        )


def _speculative_config(config: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config``: a dict or a ``SpeculativeConfig`` (NOTE 7)."""
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


def _check_triton(requested: str, device: torch.device, block_size: int, head_dim: int) -> None:
    """Refuse a Triton backend that would fail at the first step (NOTE 6)."""
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
    from tinyvllm.sample.logits_processors.loader import cached_load_custom_logitsprocs  # torch: NOTE 9

    procs = tuple(value)
    cached_load_custom_logitsprocs(procs)  # ValueError (not a LogitsProcessor, bad name), RuntimeError (import)
    return procs
