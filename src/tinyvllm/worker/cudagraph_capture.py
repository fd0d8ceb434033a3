"""CUDA-graph set-up and capture: the runtime mode, the capture sizes, the wrappers, the capture.

Concept: before the first step the worker decides how the model may run under CUDA graphs
and records every graph it will replay. ``init_cudagraphs`` resolves the requested mode to
what the attention backend supports (NOTE 1), picks the capture sizes that a step can hold
(``resolve_capture_sizes``), initialises the dispatcher's keys and builds the wrappers: one
FULL wrapper around the whole forward, one PIECEWISE wrapper around each of the model's
pieces. It returns them in a ``CUDAGraphSetup`` and changes nothing: the worker installs
the piece wrappers on the model (the one place that writes ``model.pieces``) and hands the
setup to the runner. ``capture_model`` then runs, for every key, an eager warm-up and a
capture on a dummy batch (NOTE 2).

Follows: seed 000 "CUDA Graphs" ("CudagraphModes", "完整 CUDA 图捕获 & 热身": eager warm-up,
capture on dummy batches).
Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``initialize_cudagraph_capture``,
``_dummy_run``, ``capture_model``) and ``vllm/config/compilation.py`` (the capture sizes).

Invariants: ``capture_model`` runs before any request is in the batch; a setup's mode is
NONE, PIECEWISE, FULL or a two-mode setting whose keys the dispatcher holds; with mode NONE
there are no wrappers and no pool.

NOTE 1 (the mode): ``cudagraph_mode`` (None: ``default_cudagraph_mode``, seed 000's default) is
downgraded to what the attention backend supports (``resolve_cudagraph_mode``); on the CPU a
mode other than NONE runs emulated graphs that check every rule a real graph imposes
(``cuda_graph.py`` NOTE 2). With no capture size that fits the token budget it is NONE.
NOTE 2 (dummy batches): warm-up and capture run ``desc.num_reqs`` (or ``min(N,
max_num_seqs)``) empty requests, KV writes to ``PAD_SLOT_ID``, block rows ``PAD_BLOCK_ID``
(``model_runner.py`` NOTE 5): nothing reaches the KV cache.
NOTE 3 (tensor parallelism): the pieces hold the row-parallel layers' all-reduces. NCCL's
can be captured in a CUDA graph; gloo's cannot (it copies through the host), so ranks over
gloo on CUDA (two sharing one GPU) run eager. Emulated graphs on the CPU keep gloo's.
NOTE 4 (the LM head in the FULL graph): launched from the host, the LM head and its cast to
float32 cost a decode step host time of their own, while the device could already be busy.
For a generating engine without drafts the FULL wrapper runs ``ForwardAndLogits``: the
forward, then ``compute_logits`` on each request's logits row, so a FULL step's logits come
out of the graph (SGLang's decode graphs hold the LM head too; vLLM's do not). Steps that
pass through run the same callable eagerly, so the runner reads the logits of every step
from the forward. With drafts the rows to verify are the rejection sampler's, and a pooling
engine has no LM head: both wrap the plain model. The logits of the largest capture size
stay in the graphs' pool, whose size the worker takes off the KV budget (``worker.py`` NOTE 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from tinyvllm.arith import cdiv
from tinyvllm.config import CompilationConfig
from tinyvllm.distributed.parallel_state import get_tp_group
from tinyvllm.worker.block_table import PAD_BLOCK_ID
from tinyvllm.worker.cuda_graph import CUDAGraphWrapper, EmulatedPool
from tinyvllm.worker.cudagraph_dispatcher import (
    BatchDescriptor,
    CUDAGraphMode,
    CudagraphDispatcher,
    default_capture_sizes,
    resolve_cudagraph_mode,
    uniform_decode_query_lens,
)
from tinyvllm.worker.input_batch import InputBatch
from tinyvllm.worker.input_buffers import PAD_TOKEN_ID

logger = logging.getLogger(__name__)


class CapturingRunner(Protocol):
    """What capture reads, runs and resets of the runner (``ModelRunner``; a Protocol, so
    that ``model_runner.py`` can import this module's ``CUDAGraphSetup`` without a circle)."""

    block_size: int
    device: torch.device
    input_batch: InputBatch
    dispatcher: CudagraphDispatcher
    cudagraph_mode: CUDAGraphMode
    full_graph: CUDAGraphWrapper | None

    def _forward(self, token_ids: list[int], num_computed: list[int], num_scheduled: list[int],
                 block_ids: list[list[int]], dispatch: tuple[CUDAGraphMode, BatchDescriptor] | None = None,
                 dummy: bool = False) -> tuple: ...  # fmt: skip


# --8<-- [start:capture_sizes]
def resolve_capture_sizes(
    config: CompilationConfig, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> list[int]:
    """The capture sizes to use: the configured ones, else vLLM's defaults up to
    ``max_cudagraph_capture_size`` (default ``min(2 * max_num_seqs, 512)``). A step never
    holds more than the token budget, nor more than ``max_num_seqs`` requests of
    ``max_model_len`` tokens: larger sizes are dropped, and the default list is never built
    past that limit, however large the maximum asked for."""
    limit = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    why = "max_num_batched_tokens (or max_num_seqs * max_model_len)"
    if config.cudagraph_capture_sizes is None:
        max_size = config.max_cudagraph_capture_size or min(2 * max_num_seqs, 512)
        if config.max_cudagraph_capture_size is not None and max_size > limit:
            logger.warning("max_cudagraph_capture_size %d exceeds %s = %d: capturing up to %d", max_size, why, limit, limit)
        return default_capture_sizes(min(max_size, limit))
    sizes = list(config.cudagraph_capture_sizes)  # sorted, no repeats
    usable = [s for s in sizes if s <= limit]
    if len(usable) < len(sizes):
        dropped = sizes[len(usable) :]
        shown = dropped if len(dropped) <= 8 else [*dropped[:4], "...", *dropped[-2:]]
        logger.warning(
            "%d cudagraph capture sizes exceed %s = %d and are dropped: %s", len(dropped), why, limit, shown
        )  # fmt: skip
    return usable
# --8<-- [end:capture_sizes]


@dataclass(frozen=True)
class CUDAGraphSetup:
    """What ``init_cudagraphs`` chose: the runner runs under it, the worker installs ``pieces``."""

    mode: CUDAGraphMode  # after the downgrade (NOTE 1)
    dispatcher: CudagraphDispatcher  # its keys initialised for ``mode``
    emulate: bool  # True off CUDA: emulated graphs (cuda_graph.py NOTE 2)
    pieces: list  # the model's pieces, each in a PIECEWISE wrapper when the mode has piecewise graphs
    full_graph: CUDAGraphWrapper | None  # the FULL wrapper around the whole forward (NOTE 4), if the mode has one


# --8<-- [start:forward_and_logits]
class ForwardAndLogits:
    """What the FULL wrapper runs for a generating engine without drafts (NOTE 4)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The hidden states ``[N_pad, hidden]`` and each request's logits ``[R_pad, V]`` float32."""
        hidden = self.model(input_ids, positions, kv_caches, attn_metadata)  # [N_pad, hidden]
        return hidden, self.model.compute_logits(hidden[attn_metadata.logits_indices])  # [R_pad, V]

    __call__ = forward
# --8<-- [end:forward_and_logits]


def eager_pieces(model: torch.nn.Module) -> list:
    """The model's pieces without any wrapper (a set-up before this one may have wrapped them)."""
    return [getattr(p, "runnable", p) for p in model.pieces]


# --8<-- [start:init_cudagraphs]
# --8<-- [start:default_mode]
def default_cudagraph_mode(device_type: str, pooling: bool) -> CUDAGraphMode:
    """Seed 000's default: FULL_AND_PIECEWISE on CUDA, "still PIECEWISE for pooling models" (a
    pooling engine's batches are prompts, which the FULL graphs of uniform decode batches do not
    serve); NONE on the CPU, where graphs are only emulated."""
    if device_type != "cuda":
        return CUDAGraphMode.NONE
    return CUDAGraphMode.PIECEWISE if pooling else CUDAGraphMode.FULL_AND_PIECEWISE
# --8<-- [end:default_mode]


def init_cudagraphs(
    model: torch.nn.Module,
    device: torch.device,
    config: CompilationConfig,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    uniform_decode_query_len: int,
    pooling: bool = False,
) -> CUDAGraphSetup:
    """Resolve the mode (NOTE 1), initialise the dispatcher's keys, build the wrappers.
    Changes nothing: the caller installs ``pieces`` (``model.pieces = setup.pieces``)."""
    requested = config.cudagraph_mode
    if requested is None:
        requested = default_cudagraph_mode(device.type, pooling)
    mode = resolve_cudagraph_mode(
        requested, model.cudagraph_support, piecewise_available=True,
        uniform_decode_query_len=uniform_decode_query_len,
    )  # fmt: skip
    sizes = []
    if mode != CUDAGraphMode.NONE:
        sizes = resolve_capture_sizes(config, max_num_seqs, max_num_batched_tokens, max_model_len)
    if mode != CUDAGraphMode.NONE and not sizes:
        logger.warning("cudagraph_mode %s -> NONE: no capture size fits the token budget", mode.name)
        mode = CUDAGraphMode.NONE
    group = get_tp_group()
    if mode != CUDAGraphMode.NONE and not group.collectives_capturable(device.type):  # NOTE 3
        logger.warning("cudagraph_mode %s -> NONE: %s's all-reduce cannot be captured in a CUDA graph",
                       mode.name, group.backend)  # fmt: skip
        mode = CUDAGraphMode.NONE
    emulate = device.type != "cuda"
    if mode != CUDAGraphMode.NONE and emulate:
        logger.warning("cudagraph_mode %s on %s: CUDA graphs are emulated (no speed-up)", mode.name, device)
    dispatcher = CudagraphDispatcher(sizes or [1], max_num_seqs)
    lens = (1,)  # uniform keys for 1 and 1 + k tokens per request (cudagraph_dispatcher.py NOTE 4)
    if mode.separate_routine() and mode.decode_mode() == CUDAGraphMode.FULL:
        lens = uniform_decode_query_lens(uniform_decode_query_len, model.cudagraph_support)
    dispatcher.initialize_cudagraph_keys(mode, uniform_decode_query_len, uniform_decode_query_lens=lens)
    if mode == CUDAGraphMode.NONE:
        pool = None
    else:  # one pool for every graph (cuda_graph.py NOTES 4 and 5)
        pool = EmulatedPool() if emulate else torch.cuda.graph_pool_handle()
    pieces = eager_pieces(model)
    if mode.has_piecewise_cudagraphs():
        pieces = [CUDAGraphWrapper(p, CUDAGraphMode.PIECEWISE, emulate, pool=pool) for p in pieces]
    full_graph = None
    if mode.has_full_cudagraphs():  # NOTE 4: the LM head inside, unless drafts or pooling
        runnable = model if pooling or uniform_decode_query_len > 1 else ForwardAndLogits(model)
        full_graph = CUDAGraphWrapper(runnable, CUDAGraphMode.FULL, emulate, pool=pool)
    return CUDAGraphSetup(mode, dispatcher, emulate, pieces, full_graph)
# --8<-- [end:init_cudagraphs]


# --8<-- [start:capture]
def dummy_run(runner: CapturingRunner, mode: CUDAGraphMode, desc: BatchDescriptor) -> None:
    """Run a dummy batch shaped like ``desc`` in runtime mode ``mode`` (NOTE 2)."""
    if desc.uniform:  # 1 or 1 + k tokens per request: the key says which
        lens = [desc.uniform_query_len] * desc.num_reqs
    else:  # spread evenly: no dummy request is longer than max_model_len
        num_reqs = desc.num_reqs or min(desc.num_tokens, runner.input_batch.max_num_reqs)
        base, extra = divmod(desc.num_tokens, num_reqs)
        lens = [base + 1] * extra + [base] * (num_reqs - extra)
    block_ids = [[PAD_BLOCK_ID] * cdiv(n, runner.block_size) for n in lens]
    runner._forward([PAD_TOKEN_ID] * sum(lens), [0] * len(lens), lens, block_ids, dispatch=(mode, desc), dummy=True)
    if runner.device.type == "cuda":  # the next dummy rewrites the pinned host buffers (input_buffers NOTE 2)
        torch.cuda.synchronize(runner.device)


@torch.inference_mode()
def capture_model(runner: CapturingRunner) -> int:
    """Warm up eagerly, then capture every key the runner's dispatcher holds; returns the count."""
    if runner.input_batch.num_reqs:
        raise RuntimeError("capture_model runs at start-up, before any request is in the batch")
    captured = 0
    for mode, descs in runner.dispatcher.get_capture_descs():  # PIECEWISE first, largest first
        for desc in descs:
            dummy_run(runner, CUDAGraphMode.NONE, desc)  # warm-up: eager, same shapes
            dummy_run(runner, mode, desc)  # the wrapper of this mode captures
            captured += 1
    return captured
# --8<-- [end:capture]


def release_cudagraphs(runner: CapturingRunner) -> None:
    """Drop the runner's graphs: mode NONE, no FULL wrapper, no keys. The caller unwraps the
    model's pieces (``model.pieces = eager_pieces(model)``)."""
    runner.full_graph = None
    runner.cudagraph_mode = CUDAGraphMode.NONE
    runner.dispatcher.initialize_cudagraph_keys(CUDAGraphMode.NONE)
