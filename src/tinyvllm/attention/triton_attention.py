"""Paged attention in Triton: one unified kernel for mixed prefill and decode batches.

Concept: the same math as ``reference.paged_attention`` (same signature, same result),
computed in tiles. A program owns one *query tile* (``BLOCK_Q`` consecutive tokens of one
request) and one KV head, and packs the ``G = H // Hkv`` query heads that read that KV head
into the tile's rows (``BLOCK_M >= BLOCK_Q * G``), so each key/value tile loaded from the
cache serves all of them. It walks the request's keys in order, ``TILE_N`` keys per KV tile,
with an online softmax in float32; each key's cache block comes from the block table, so a
tile may span several blocks or part of one (NOTE 3). A split-KV path cuts each request's
tiles into ``NUM_SEGMENTS`` segments handled by separate programs, then a second small
kernel merges the partial results (NOTE 2).

Follows: seed 003 "KV cache物理内存分配" (the cache layout and the block ids in the attention
metadata); seed 000 "Attention 后端对 CUDA 图的兼容性" (this backend is CUDA-graph safe: ``ALWAYS``).
Mirrors: ``vllm/attention/ops/triton_unified_attention.py`` (``kernel_unified_attention_2d``,
``_3d`` and ``reduce_segments``) and ``vllm/v1/attention/backends/triton_attn.py``.

Invariants: identical results to the reference within the dtype's tolerance; every output
row is written (padding rows past ``query_start_loc[-1]`` get zeros); the grid depends only
on tensor shapes, never on their values, so a CUDA graph can replay it (NOTE 1).

NOTE 1 (grid from shapes): request r owns tiles ``query_start_loc[r] // BLOCK_Q + r`` up to
the next request's first tile; the padding rows after ``query_start_loc[R]`` own the tiles
after that. ``cdiv(N, BLOCK_Q) + R`` tiles always cover both; spare programs find no row.
A program finds its request by binary search over ``query_start_loc``.
NOTE 2 (when to split): a decode batch with few requests launches ``R * Hkv`` programs, too
few to fill a GPU's SMs, and each walks the whole context alone. ``choose_num_segments``
splits the context into 16 segments when the batch is pure decode (``N == R``), the block
table can hold a long context, and ``R * Hkv`` is below ``SPLIT_KV_MAX_PROGRAMS``.
NOTE 3 (keys per tile): a KV tile is ``TILE_N`` consecutive key positions, not one cache
block. Key ``k`` lives in slot ``k % S`` of block ``block_table[r, k // S]``, so the kernel
gathers each key row's block id (``TILE_N / S`` distinct ids, read from cache). A wider
tile means fewer loop trips and more bytes in flight per trip (decode is bound by memory)
and a wider ``tl.dot`` (prefill is bound by arithmetic); ``choose_kv_tile`` picks it from
measurements on an H100 (docs: Paged attention, "How fast").
NOTE 4 (a launch plan per step): the checks of the step's metadata, the tile and split
choices, the grid, the constexprs and the partial-result buffers depend on the step and the
model's ``AttentionLayout``, not on the layer; ``plan_step`` makes them once into a frozen
``LaunchPlan`` (the model calls it once per forward, as vLLM's ``TritonAttentionMetadataBuilder``
builds once per step) and each layer only checks its own tensors' shapes against it and
launches. Without a plan ``paged_attention`` makes one, so it keeps the reference's signature.
NOTE 5 (a pre-bound launch, opt-in): ``kernel[grid](...)`` binds the arguments, computes
Triton's specialization key (dtypes, 16-byte alignment, ints equal to 1 or divisible by 16)
and looks the compiled kernel up, on every call. With ``TINYVLLM_TRITON_LAUNCH=prebound`` on
CUDA the plan keeps, per key of what Triton specializes on (strides, pointer alignment), the
kernel ``JITFunction.warmup`` compiled and launches it directly. Triton has no supported API
for this (its ``CompiledKernel`` launch is internal, the same in 3.6 and 3.7), so the JIT
stays the default until a GPU run shows the gain (docs: Paged attention, "Host cost").
NOTE 6 (full and diagonal tiles): a KV tile whose keys all lie at or before the query tile's
first position, and inside what it may see, is visible to every row: it needs neither the
causal mask nor the bounds mask. ``_num_full_kv_tiles`` counts those leading tiles; they run
unmasked, the few diagonal tiles after them masked (a split-KV segment takes its share of
each). A spare tile past its request's last row sees no key at all.
NOTE 7 (prefill tiles and launch): rows per query tile, keys per KV tile, ``num_warps`` and
``num_stages`` come from ``choose_*`` functions, each overridable on ``paged_attention`` so
``bench/attention.py`` can sweep them on a GPU; the defaults stay until a sweep says otherwise.

Left out: sliding windows, ALiBi, soft-capping, sinks, fp8 KV, head sizes that are not a
power of two, autotuning (one configuration per shape class).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton

from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.arith import cdiv
from tinyvllm.attention.metadata import AttentionLayout, AttentionMetadata
from tinyvllm.attention.triton_kernels import (  # noqa: F401  (the kernels' pieces, for tests and the AOT compile)
    _attend_kv_tile,
    _find_request,
    _merge_segments_kernel,
    _num_full_kv_tiles,
    _paged_attention_kernel,
)
from tinyvllm.dependent_launch import launch_keywords, launch_options, sm_90_or_later
from tinyvllm.platform import triton_can_run_on

# Seed 000 "Attention 后端对 CUDA 图的兼容性": the grid, the tile sizes and the split-KV choice
# depend on tensor shapes only, and the launcher never reads a tensor's value on the host,
# so a CUDA graph of any batch (mixed prefill and decode included) replays correctly.
CUDAGRAPH_SUPPORT = AttentionCGSupport.ALWAYS

SPLIT_KV_SEGMENTS = 16  # segments per request on the split-KV path (a power of two)
SPLIT_KV_MIN_CONTEXT = 512  # tokens the block table must be able to hold before splitting
SPLIT_KV_MAX_PROGRAMS = 128  # split only when R * Hkv programs would be fewer than this
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Keys per KV tile (NOTE 3), from bench/attention.py's sweep of 16-128 on an H100 (Llama-3-8B
# attention shape, bf16, blocks of 16): 32 was the fastest, or within 2%, at decode batches
# 4, 64 and 256 and at prefill lengths 128 and 1024-4096 (mostly 1.2-1.3x faster than 16, one
# block a tile). 128 won where too few programs each walk a long context (batch 16 without
# a split, batch 1 at 2048+): a question for the split rule, not the tile. One constant per
# kind of batch, because the two are bound by different things and another shape may split them.
LAUNCH_ENV = "TINYVLLM_TRITON_LAUNCH"  # "prebound": NOTE 5's launch on CUDA; "jit" (unset): Triton's own
DECODE_KV_TILE = 32  # every request has one query token: bound by memory
PREFILL_KV_TILE = 32  # a batch with prompt rows: bound by arithmetic
# Rows per query tile (BLOCK_M's target, NOTE 7): about 16 for decode (one token per request),
# 64 for prefill; the GPU sweep in bench/attention.py tries 64 and 128 for prefill.
DECODE_QUERY_ROWS = 16
PREFILL_QUERY_ROWS = 64
# (num_warps, num_stages) per kind of batch (NOTE 7): Triton's defaults for a CUDA launch, the
# launch options vLLM's unified attention kernel uses (it passes none); not yet measured here.
DECODE_LAUNCH = (4, 3)
PREFILL_LAUNCH = (4, 3)
# The step's full KV tiles through tensor descriptors (triton_kernels.py NOTE 4): on where a
# descriptor load is one TMA copy, CUDA sm_90 and later (choose_kv_desc; the prefill sweep on an
# H200 timed it ahead of the pointer loads at every length and shape); plan_step(kv_desc=...) and
# TINYVLLM_TRITON_KV_DESC=0/1 (every step of an engine, an A/B of a whole workload) override it.
KV_DESC = True
KV_DESC_ENV = "TINYVLLM_TRITON_KV_DESC"
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)  # Triton needs a power of two; 16 warps = 512 threads


# --8<-- [start:choose]
def choose_num_segments(num_tokens: int, num_reqs: int, num_kv_heads: int, max_context: int) -> int:
    """How many KV segments per request (NOTE 2): 16 for few, long, pure-decode requests."""
    decode_only = num_tokens == num_reqs
    few_programs = num_reqs * num_kv_heads < SPLIT_KV_MAX_PROGRAMS
    long_context = max_context >= SPLIT_KV_MIN_CONTEXT
    return SPLIT_KV_SEGMENTS if decode_only and few_programs and long_context else 1


def choose_query_tile(num_queries_per_kv: int, decode_only: bool, rows: int | None = None) -> tuple[int, int]:
    """``(BLOCK_Q, BLOCK_M)``: tokens per query tile and rows per tile (G heads per token).
    ``rows`` (a power of two, default ``DECODE_QUERY_ROWS`` or ``PREFILL_QUERY_ROWS``) is the
    target; BLOCK_M exceeds it only when one token's G heads do. ``tl.dot`` needs 16."""
    target_rows = rows if rows is not None else DECODE_QUERY_ROWS if decode_only else PREFILL_QUERY_ROWS
    block_q = max(1, target_rows // num_queries_per_kv)
    return block_q, max(16, triton.next_power_of_2(block_q * num_queries_per_kv))


def choose_launch_options(decode_only: bool) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the attention kernel's launch (NOTE 7)."""
    return DECODE_LAUNCH if decode_only else PREFILL_LAUNCH


def choose_step_kv(decode_only: bool, num_segments: int) -> bool:
    """Read the step's own keys from its rows (``triton_kernels.py`` NOTE 1): for every batch with
    prompt rows; a pure decode batch has one new key a request, and the split path none."""
    return not decode_only and num_segments == 1


def choose_kv_desc(layout: AttentionLayout) -> bool:
    """Load the step's full tiles through tensor descriptors (``triton_kernels.py`` NOTE 4):
    ``KV_DESC`` where a descriptor load is a TMA copy (sm_90 and later; before sm_90 Triton
    lowers it to ordinary loads, and the interpreter emulates it), for heads whose ``D`` values
    fill whole 16-byte units, so that rows cut from a fused q/k/v projection are aligned as a
    descriptor needs (``_check_step_rows``)."""
    return KV_DESC and sm_90_or_later(layout.device) and layout.head_size * layout.dtype.itemsize % 16 == 0


def choose_kv_tile(decode_only: bool) -> int:
    """Keys per KV tile (NOTE 3): a power of two >= 16, whatever the cache's block size."""
    return DECODE_KV_TILE if decode_only else PREFILL_KV_TILE
# --8<-- [end:choose]




def _check_layer_tensors(query, key_cache, value_cache, out) -> AttentionLayout:
    """One layer's own tensors, in full; returns their layout for ``plan_step`` to check."""
    if query.dim() != 3:
        raise ValueError(f"query {tuple(query.shape)} must be [N, H, D]")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
            "must both be [num_blocks, block_size, Hkv, D]"
        )
    if key_cache.shape[3] != query.shape[2]:
        raise ValueError(f"cache head size {key_cache.shape[3]} != query head size {query.shape[2]}")
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"query {query.dtype}, key_cache {key_cache.dtype}, value_cache {value_cache.dtype}: "
            f"must be one dtype among {SUPPORTED_DTYPES}"
        )
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match query {tuple(query.shape)} {query.dtype}")
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    tensors |= {} if out is None else {"out": out}
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    _, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    return AttentionLayout(num_heads, num_kv_heads, head_size, block_size, query.dtype, query.device)


def _check_step(query_start_loc, seq_lens, block_table, layout: AttentionLayout) -> None:
    """What a step's plan rests on: the layout the kernel supports, the metadata's tensors."""
    if layout.num_heads % layout.num_kv_heads:
        raise ValueError(f"query heads {layout.num_heads} are not a multiple of KV heads {layout.num_kv_heads}")
    for name, size in (("head size", layout.head_size), ("block size", layout.block_size)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} {size} must be a power of two >= 16")
    if layout.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {layout.dtype} must be one dtype among {SUPPORTED_DTYPES}")
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} must be [R] and query_start_loc "
            f"{tuple(query_start_loc.shape)} must be [R + 1]"
        )
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [R, max_blocks] with R = {num_reqs}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} dtype {t.dtype} must be torch.int32")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        raise ValueError(f"block_table strides {block_table.stride()} must be unit along max_blocks")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("query_start_loc and seq_lens must be contiguous")
    devices = {layout.device, query_start_loc.device, seq_lens.device, block_table.device}
    if len(devices) != 1:
        raise ValueError(f"tensors are on several devices: {sorted(map(str, devices))}")
    if not triton_can_run_on(layout.device):
        raise ValueError(f"device {layout.device}: Triton needs CUDA or TRITON_INTERPRET=1")


# --8<-- [start:plan]
@dataclass(frozen=True)
class LaunchPlan:
    """One step's launch of the kernel, the same for every layer (NOTE 4): made by ``plan_step``."""

    query_start_loc: torch.Tensor  # [R + 1] int32: the step's metadata, which every layer passes
    seq_lens: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    layout: AttentionLayout  # what every layer's query and cache look like
    num_tokens: int  # N: query rows, padding included
    grid: tuple[int, int, int]  # (tiles, Hkv, NUM_SEGMENTS), NOTE 1
    constexprs: dict[str, object]  # the kernel's compile-time parameters, in its order (never mutated)
    part_acc: torch.Tensor  # [N, H, NSEG, D] fp32, or [1, 1, 1, D] unused when NSEG == 1
    part_max: torch.Tensor  # [N, H, NSEG] fp32
    part_sum: torch.Tensor  # [N, H, NSEG] fp32
    launchers: dict | None = None  # NOTE 5: pre-bound launches by argument key, filled by the layers; None: JIT
    options: dict[str, object] = field(default_factory=dict)  # Triton's launch options (num_warps, ...), if any

    @property
    def num_segments(self) -> int:
        return self.grid[2]

    @property
    def step_kv(self) -> bool:
        return self.constexprs["STEP_KV"]

    @property
    def kv_desc(self) -> bool:
        return self.constexprs["KV_DESC"]

    @property
    def pdl(self) -> dict[str, bool]:
        """The merge kernel's dependent-launch keywords: the attention kernel's choice (``dependent_launch.py``)."""
        return launch_keywords(self.constexprs["USE_PDL"])


def plan_step(
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    num_tokens: int,  # N: every layer's query rows, padding included
    layout: AttentionLayout,
    *,
    num_segments: int | None = None,  # None: choose_num_segments; 1: no split
    kv_tile: int | None = None,  # keys per KV tile; None: choose_kv_tile
    block_m: int | None = None,  # rows per query tile (target); None: choose_query_tile (NOTE 7)
    num_warps: int | None = None,  # None: choose_launch_options (NOTE 7)
    num_stages: int | None = None,  # None: choose_launch_options (NOTE 7)
    step_kv: bool | None = None,  # the step's keys from key/value; None: choose_step_kv; False: the cache only
    kv_desc: bool | None = None,  # the step's full tiles through tensor descriptors (triton_kernels.py NOTE 4); None: choose_kv_desc
) -> LaunchPlan:
    """Check the step's metadata and layout, choose the tiles and the split, size the grid and
    allocate the partial results: all that depends on the step, not the layer (NOTE 4)."""
    _check_step(query_start_loc, seq_lens, block_table, layout)
    _check_launch_overrides(block_m, num_warps, num_stages)
    num_reqs, num_kv_heads, block_size = seq_lens.shape[0], layout.num_kv_heads, layout.block_size
    if num_segments is None:
        num_segments = choose_num_segments(num_tokens, num_reqs, num_kv_heads, block_table.shape[1] * block_size)
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments {num_segments} must be a power of two >= 1")
    decode_only = num_tokens == num_reqs
    step_kv = choose_step_kv(decode_only, num_segments) if step_kv is None else step_kv
    if step_kv and num_segments > 1:
        raise ValueError(f"step_kv with num_segments {num_segments}: the split path reads the cache only")
    launch = os.environ.get(LAUNCH_ENV, "jit")
    if launch not in ("jit", "prebound"):
        raise ValueError(f"{LAUNCH_ENV}={launch!r}: must be 'jit' or 'prebound'")
    prebound = launch == "prebound" and layout.device.type == "cuda"
    if kv_desc is None:  # descriptors go through Triton's own launch: a prebound one keeps the pointer loads
        env = os.environ.get(KV_DESC_ENV)
        if env not in (None, "0", "1"):
            raise ValueError(f"{KV_DESC_ENV}={env!r}: must be '0' or '1'")
        kv_desc = (choose_kv_desc(layout) if env is None else env == "1") and step_kv and not prebound
    if kv_desc and not step_kv:
        raise ValueError("kv_desc without step_kv: the descriptors load the step's own rows (triton_kernels.py NOTE 4)")
    if kv_desc and prebound:
        raise ValueError(f"kv_desc with {LAUNCH_ENV}=prebound: descriptors go through Triton's own launch only")
    kv_tile = choose_kv_tile(decode_only) if kv_tile is None else kv_tile
    if kv_tile < 16 or kv_tile & (kv_tile - 1):
        raise ValueError(f"kv_tile {kv_tile} must be a power of two >= 16")
    group = layout.num_heads // num_kv_heads
    block_q, block_m = choose_query_tile(group, decode_only=decode_only, rows=block_m)
    warps, stages = choose_launch_options(decode_only)
    pdl = launch_options(layout.device)  # dependent_launch.py: USE_PDL, and launch_pdl when on
    options = dict(num_warps=warps if num_warps is None else num_warps, num_stages=stages if num_stages is None else num_stages)
    options |= {"launch_pdl": True} if pdl["USE_PDL"] else {}
    fp32 = layout.dtype == torch.float32
    constexprs = dict(
        QUERIES_PER_KV=group, BLOCK_SIZE=block_size, TILE_N=kv_tile, HEAD_SIZE=layout.head_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, NUM_SEGMENTS=num_segments,
        DOT_FP32=layout.device.type != "cuda" or fp32, INPUT_PRECISION="ieee" if fp32 else "tf32", STEP_KV=step_kv,
        KV_DESC=kv_desc, USE_PDL=pdl["USE_PDL"],
    )  # fmt: skip
    part_shape = (num_tokens, layout.num_heads, num_segments) if num_segments > 1 else (1, 1, 1)
    new = dict(dtype=torch.float32, device=layout.device)
    return LaunchPlan(
        query_start_loc, seq_lens, block_table, layout, num_tokens,
        grid=(cdiv(num_tokens, block_q) + num_reqs, num_kv_heads, num_segments),  # NOTE 1
        constexprs=constexprs, part_acc=torch.empty((*part_shape, layout.head_size), **new),
        part_max=torch.empty(part_shape, **new), part_sum=torch.empty(part_shape, **new),
        launchers={} if prebound else None, options=options,
    )  # fmt: skip


def plan_from_metadata(meta: AttentionMetadata, layout: AttentionLayout) -> LaunchPlan:
    """``plan_step`` over a step's attention metadata (what the model calls once per step)."""
    return plan_step(meta.query_start_loc, meta.seq_lens, meta.block_table, meta.num_padded_tokens, layout)


def _check_against_plan(plan: LaunchPlan, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out):
    """A layer's own tensors against the step's plan: shapes, dtypes, devices and the unit
    stride along D, no more (NOTE 4). A mismatch is a ValueError naming both."""
    layout = plan.layout
    given = (query_start_loc, seq_lens, block_table)
    if any(a is not b for a, b in zip(given, (plan.query_start_loc, plan.seq_lens, plan.block_table))):
        raise ValueError("query_start_loc, seq_lens and block_table must be the tensors the plan was made from")
    want = (plan.num_tokens, layout.num_heads, layout.head_size)
    if query.shape != want or query.dtype != layout.dtype or query.device != layout.device:
        raise ValueError(f"query {tuple(query.shape)} {query.dtype} on {query.device}: the plan is for {want} "
                         f"{layout.dtype} on {layout.device}")  # fmt: skip
    cache = (layout.block_size, layout.num_kv_heads, layout.head_size)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        shape = t.shape
        if len(shape) != 4 or shape[1:] != cache or t.dtype != layout.dtype or t.device != layout.device:
            raise ValueError(f"{name} {tuple(shape)} {t.dtype} on {t.device}: the plan is for "
                             f"[num_blocks, *{cache}] {layout.dtype} on {layout.device}")  # fmt: skip
    if out is not None and (out.shape != want or out.dtype != layout.dtype or out.device != layout.device):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device} must match query {want} {layout.dtype}")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if t is not None and t.stride()[-1] != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")


def _check_step_rows(plan: LaunchPlan, key, value) -> None:
    """The step's own key and value rows a ``step_kv`` plan reads (``triton_kernels.py`` NOTE 1);
    for ``kv_desc`` (NOTE 4), also what a descriptor of ``[N, Hkv * D]`` needs."""
    layout = plan.layout
    want = (plan.num_tokens, layout.num_kv_heads, layout.head_size)
    if key is None:
        raise ValueError("the plan reads this step's keys from their rows (step_kv): pass key= and value=")
    for name, t in (("key", key), ("value", value)):
        if t.shape != want or t.dtype != layout.dtype or t.device != layout.device or t.stride()[-1] != 1:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} on {t.device}, strides {t.stride()}: the plan is for "
                             f"{want} {layout.dtype} on {layout.device}, unit stride along D")  # fmt: skip
        row, head = t.stride()[:2]
        if plan.kv_desc and (head != layout.head_size or row * t.element_size() % 16 or t.data_ptr() % 16):
            raise ValueError(f"{name} strides {t.stride()}, address {t.data_ptr():#x}: kv_desc reads each row as "
                             f"Hkv * D packed values (head stride {layout.head_size}), rows and address 16-byte aligned")  # fmt: skip


# --8<-- [start:kv_descriptors]
def kv_descriptors(plan: LaunchPlan, key: torch.Tensor, value: torch.Tensor) -> tuple:
    """``key`` and ``value`` [N, Hkv, D] as tensor descriptors of ``[N, Hkv * D]`` whose boxes are
    one KV tile of one head, ``[TILE_N, D]`` (``triton_kernels.py`` NOTE 4)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    box = [plan.constexprs["TILE_N"], plan.layout.head_size]
    return tuple(TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride()[0], 1], box) for t in (key, value))
# --8<-- [end:kv_descriptors]
# --8<-- [end:plan]


def prebound_launcher(plan: LaunchPlan, args: tuple) -> Callable[..., None]:
    """The compiled kernel for these arguments (``JITFunction.warmup`` compiles or finds it,
    launching nothing), as a launcher that takes every parameter in order (NOTE 5)."""
    names = _paged_attention_kernel.arg_names[len(args) :]
    if names != list(plan.constexprs):
        raise RuntimeError(f"the kernel's parameters after its {len(args)} arguments are {names}, "
                           f"not the plan's constexprs {list(plan.constexprs)}")  # fmt: skip
    return _paged_attention_kernel.warmup(*args, grid=plan.grid, **plan.constexprs, **plan.options)[plan.grid]


def _check_launch_overrides(block_m, num_warps, num_stages) -> None:
    """The sweepable launch choices (NOTE 7): each None (the default) or a legal value."""
    for name, value in (("block_m", block_m), ("num_warps", num_warps), ("num_stages", num_stages)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m {block_m} must be a power of two >= 16")
    if num_warps is not None and num_warps not in NUM_WARPS_CHOICES:
        raise ValueError(f"num_warps {num_warps} must be one of {NUM_WARPS_CHOICES}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"num_stages {num_stages} must be >= 1 (1: no software pipelining)")


# --8<-- [start:launcher]
def paged_attention(
    query: torch.Tensor,  # [N, H, D]
    key_cache: torch.Tensor,  # [B, S, Hkv, D]
    value_cache: torch.Tensor,  # [B, S, Hkv, D]
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    block_table: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [N, H, D]
    *,
    key: torch.Tensor | None = None,  # [N, Hkv, D]: this step's keys, already in the cache (triton_kernels.py NOTE 1)
    value: torch.Tensor | None = None,  # [N, Hkv, D]: this step's values, already in the cache
    num_segments: int | None = None,  # None: choose_num_segments; 1: no split (without a plan)
    kv_tile: int | None = None,  # keys per KV tile; None: choose_kv_tile (without a plan)
    block_m: int | None = None,  # rows per query tile (target); None: choose_query_tile (without a plan)
    num_warps: int | None = None,  # None: choose_launch_options (without a plan)
    num_stages: int | None = None,  # software-pipelining depth; None: choose_launch_options (without a plan)
    step_kv: bool | None = None,  # None: choose_step_kv when key is given (without a plan)
    kv_desc: bool | None = None,  # full tiles through tensor descriptors; None: choose_kv_desc (without a plan)
    plan: LaunchPlan | None = None,  # the step's (NOTE 4); made here when not given
) -> torch.Tensor:
    """Causal paged attention with the Triton kernel; same contract as the reference. Given the
    step's ``key`` and ``value``, a plan with ``step_kv`` reads those keys from them, not the
    cache. The keyword overrides exist so that ``bench/attention.py`` can sweep (NOTE 7)."""
    overrides = dict(num_segments=num_segments, kv_tile=kv_tile, block_m=block_m, num_warps=num_warps,
                     num_stages=num_stages, step_kv=step_kv, kv_desc=kv_desc)  # fmt: skip
    given = {name: value for name, value in overrides.items() if value is not None}
    if (key is None) != (value is None):
        raise ValueError("key and value: give both (this step's rows) or neither")
    if plan is None:
        layout = _check_layer_tensors(query, key_cache, value_cache, out)
        overrides["step_kv"] = False if key is None else step_kv  # without the rows, the cache alone
        plan = plan_step(query_start_loc, seq_lens, block_table, query.shape[0], layout, **overrides)
    elif given:
        raise ValueError(", ".join(f"{name} {value}" for name, value in given.items()) + ": give them to plan_step, not with a plan")
    else:
        _check_against_plan(plan, query, key_cache, value_cache, query_start_loc, seq_lens, block_table, out)
    if plan.step_kv:
        _check_step_rows(plan, key, value)
    out = torch.empty_like(query) if out is None else out
    if plan.num_tokens == 0:
        return out
    layout, q_stride, o_stride = plan.layout, query.stride(), out.stride()
    k_stride, v_stride = key_cache.stride(), value_cache.stride()  # one call each: stride(i) is slower
    key, value = (key, value) if plan.step_kv else (key_cache, value_cache)  # the cache: never read as rows
    kn_stride, vn_stride = key.stride(), value.stride()
    descs = kv_descriptors(plan, key, value) if plan.kv_desc else (None, None)
    args = (
        out, plan.part_acc, plan.part_max, plan.part_sum, query, key_cache, value_cache, key, value, *descs,
        plan.query_start_loc, plan.seq_lens, plan.block_table, scale, plan.num_tokens, plan.seq_lens.shape[0],
        layout.num_heads, q_stride[0], q_stride[1], o_stride[0], o_stride[1],
        k_stride[0], k_stride[1], k_stride[2], v_stride[0], v_stride[1], v_stride[2],
        plan.block_table.stride()[0], kn_stride[0], kn_stride[1], vn_stride[0], vn_stride[1],
    )  # fmt: skip
    if plan.launchers is None:
        _paged_attention_kernel[plan.grid](*args, **plan.constexprs, **plan.options)  # the JIT: binds, keys, finds
    else:
        aligned = tuple(t.data_ptr() % 16 for t in (out, query, key_cache, value_cache, key, value))
        launch_key = (q_stride, o_stride, k_stride, v_stride, kn_stride, vn_stride, aligned)
        launch = plan.launchers.get(launch_key)
        if launch is None:  # NOTE 5: the same arguments Triton would specialize on, compiled once a step
            launch = plan.launchers[launch_key] = prebound_launcher(plan, args)
        launch(*args, *plan.constexprs.values())
    if plan.num_segments > 1:
        _merge_segments_kernel[(plan.num_tokens, layout.num_heads)](
            out, plan.part_acc, plan.part_max, plan.part_sum, o_stride[0], o_stride[1], layout.num_heads,
            NUM_SEGMENTS=plan.num_segments, HEAD_SIZE=layout.head_size, **plan.pdl,
        )  # fmt: skip
    return out
# --8<-- [end:launcher]
