"""The CUDA-graph dispatcher: which graph, if any, runs this batch (a pure decision, no torch).

Concept: a CUDA graph replays a fixed sequence of kernels on fixed addresses and shapes,
so a graph exists only for a few padded batch shapes. Each is named by a
``BatchDescriptor`` (padded token count, request count, uniform or not; a uniform key's
query length is their ratio). At start-up the
runner resolves the configured ``CUDAGraphMode`` against what the attention backend
supports (``resolve_cudagraph_mode``) and asks the dispatcher for the set of keys to
capture (``initialize_cudagraph_keys``). Every step it asks ``dispatch`` for the runtime
mode and the key: pad the batch up to the smallest capture size that holds it, then take a
FULL graph if one exists for that key, else a PIECEWISE one, else run eagerly (NONE).

Follows: seed 000, vLLM design doc "CUDA Graphs" (Chinese translation; based on vLLM PR
#20059), sections "CudagraphModes", "BatchDescriptor", "CudagraphDispatcher" and
"Attention 后端对 CUDA 图的兼容性" (AttentionCGSupport and the mode downgrade).
Mirrors: ``vllm/config/compilation.py`` (``CUDAGraphMode``), ``vllm/forward_context.py``
(``BatchDescriptor``), ``vllm/v1/cudagraph_dispatcher.py`` (``CudagraphDispatcher``),
``GPUModelRunner._check_and_update_cudagraph_mode`` (the downgrade rules). ``AttentionCGSupport``
lives with the attention backends (``attention/cudagraph_support.py``) and is re-exported here.

Invariants (``check_invariants``): capture sizes are sorted, unique and positive; every
key's ``num_tokens`` is a capture size; PIECEWISE keys have ``num_reqs=None`` and
``uniform=False``; FULL keys name at most ``max_num_seqs`` requests; a uniform key's query
length (``num_tokens / num_reqs``, whole) is one of ``uniform_decode_query_lens``.
``dispatch`` only ever returns a key from ``cudagraph_keys`` (or ``NONE``, unpadded).

NOTE 1 (where we differ from vLLM's code): with ``AttentionCGSupport.NEVER`` vLLM refuses
a mode whose mixed routine is FULL with an error; we downgrade it (to PIECEWISE, or NONE
without piecewise graphs) and log why, as the seed itself states ("如果最低能力是 NEVER(对于
-O3 编译模式),则降级到 PIECEWISE 模式": if the lowest support is NEVER, downgrade to PIECEWISE). A PIECEWISE-containing mode without piecewise graphs is downgraded too
(FULL_AND_PIECEWISE to FULL_DECODE_ONLY, PIECEWISE to NONE). Capture sizes above the
token budget are dropped by the runner, not here.
NOTE 2 (the mixed FULL key keeps its request count): a FULL graph of a mixed batch is
captured for ``min(size, max_num_seqs)`` requests, the most a batch of ``size`` tokens
can hold; the runner pads the request count up to it (padded requests have no tokens).
A PIECEWISE graph never sees the requests (attention runs eagerly between the pieces),
so its key drops them.
NOTE 3 (a uniform batch may use a mixed FULL graph): a FULL graph captured for a mixed
batch computes any batch of that padded size correctly, so a uniform decode batch with no
uniform key of its own falls back to it.
NOTE 4 (one set of uniform keys per query length): under speculation with k drafts a decode
step is uniform at 1 + k tokens per request when every request verifies k drafts, and at 1
when none has drafts; keys exist for both (``uniform_decode_query_lens``; vLLM's model
runner V2 keys its graphs by this length, ``uniform_token_count``), so a draft-less step
replays a FULL graph. A backend that captures single-token decodes but not UNIFORM_BATCH keeps the length-1
keys only: its draft-less steps still replay FULL graphs, its verification steps run mixed.

Left out: LoRA-specific keys (``has_lora`` is carried, never set), cascade attention
itself (only its effect on dispatch), capture sizes per LoRA count, encoder graphs.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tinyvllm.attention.cudagraph_support import AttentionCGSupport
from tinyvllm.config import CUDAGraphMode  # the mode lives with the compilation config, as in vLLM

__all__ = [
    "AttentionCGSupport",
    "BatchDescriptor",
    "CUDAGraphMode",
    "common_query_len",
    "CudagraphDispatcher",
    "default_capture_sizes",
    "pad_to_capture_size",
    "resolve_cudagraph_mode",
    "uniform_decode_query_lens",
]

logger = logging.getLogger(__name__)


# --8<-- [start:batch_descriptor]
class BatchDescriptor(NamedTuple):
    """The key of one CUDA graph: the fewest facts that tell padded batches apart."""

    num_tokens: int  # padded token count
    num_reqs: int | None = None  # padded request count; None: the graph does not depend on it
    uniform: bool = False  # every request has the same query length (uniform decode)
    has_lora: bool = False

    @property
    def uniform_query_len(self) -> int | None:
        """A uniform key's tokens per request (NOTE 4); None for a key of mixed batches."""
        return self.num_tokens // self.num_reqs if self.uniform and self.num_reqs else None

# --8<-- [end:batch_descriptor]




# --8<-- [start:resolve]
def resolve_cudagraph_mode(
    mode: CUDAGraphMode,
    min_support: AttentionCGSupport,
    piecewise_available: bool = True,
    uniform_decode_query_len: int = 1,
) -> CUDAGraphMode:
    """Downgrade ``mode`` to the closest one the attention backend(s) support (NOTE 1).

    ``min_support`` is the least capable backend's support. Each downgrade logs one line.
    ``uniform_decode_query_len`` (1 + k) is checked but changes no mode: what a backend
    without UNIFORM_BATCH loses is the 1 + k keys (``uniform_decode_query_lens``, NOTE 4).
    """
    if uniform_decode_query_len < 1:
        raise ValueError(f"uniform_decode_query_len must be >= 1, got {uniform_decode_query_len}")

    def downgrade(new: CUDAGraphMode, why: str) -> CUDAGraphMode:
        logger.warning("cudagraph_mode %s -> %s: %s", mode.name, new.name, why)
        return new

    fallback = CUDAGraphMode.PIECEWISE if piecewise_available else CUDAGraphMode.NONE
    if mode.has_piecewise_cudagraphs() and not piecewise_available:
        new = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full_cudagraphs() else CUDAGraphMode.NONE
        mode = downgrade(new, "piecewise graphs are not available")
    if mode.has_full_cudagraphs() and min_support == AttentionCGSupport.NEVER:
        return downgrade(fallback, "the attention backend supports no full CUDA graphs (NEVER)")
    if mode.mixed_mode() == CUDAGraphMode.FULL and min_support != AttentionCGSupport.ALWAYS:
        new = CUDAGraphMode.FULL_AND_PIECEWISE if piecewise_available else CUDAGraphMode.FULL_DECODE_ONLY
        mode = downgrade(new, f"the attention backend captures only uniform batches ({min_support.name})")
    # a FULL decode routine survives a backend without UNIFORM_BATCH under speculation: it
    # keeps the length-1 keys (uniform_decode_query_lens, NOTE 4)
    return mode
# --8<-- [end:resolve]


# --8<-- [start:lens]
def uniform_decode_query_lens(uniform_decode_query_len: int, min_support: AttentionCGSupport) -> tuple[int, ...]:
    """The query lengths that get uniform decode keys (NOTE 4): 1 and ``1 + k`` under
    speculation with k drafts, 1 alone without; ``1 + k`` only if the backend captures
    UNIFORM_BATCH (logs one line when it does not)."""
    if uniform_decode_query_len < 1:
        raise ValueError(f"uniform_decode_query_len must be >= 1, got {uniform_decode_query_len}")
    if uniform_decode_query_len == 1:
        return (1,)
    if min_support.value < AttentionCGSupport.UNIFORM_BATCH.value:
        logger.warning(
            "decode batches of %d tokens per request need UNIFORM_BATCH, not %s: FULL decode graphs "
            "for 1 token per request only", uniform_decode_query_len, min_support.name,
        )  # fmt: skip
        return (1,)
    return (1, uniform_decode_query_len)
# --8<-- [end:lens]


# --8<-- [start:pad]
def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default capture sizes up to ``max_size``: 1, 2, 4, every 8 below 256, then every 16."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


def pad_to_capture_size(num_tokens: int, capture_sizes: list[int]) -> int | None:
    """The smallest capture size >= ``num_tokens`` (sizes sorted), or None past the largest."""
    i = bisect.bisect_left(capture_sizes, num_tokens)
    return capture_sizes[i] if i < len(capture_sizes) else None
# --8<-- [end:pad]


def common_query_len(num_scheduled: Sequence[int], lens: Iterable[int]) -> int | None:
    """The query length every request of the batch shares, if it is one of ``lens``; else None."""
    first = num_scheduled[0] if num_scheduled else None
    if first in set(lens) and all(n == first for n in num_scheduled):
        return first
    return None


def _capture_order(desc: BatchDescriptor) -> tuple[int, bool, int]:
    return desc.num_tokens, desc.uniform, desc.num_reqs or 0


def _check_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class CudagraphDispatcher:
    """The one source of truth for which CUDA graphs exist (see the module header)."""

    def __init__(self, cudagraph_capture_sizes: Iterable[int], max_num_seqs: int) -> None:
        sizes = list(cudagraph_capture_sizes)
        for s in sizes:
            _check_positive_int("every cudagraph capture size", s)
        self.capture_sizes: list[int] = sorted(set(sizes))
        self.max_num_seqs = _check_positive_int("max_num_seqs", max_num_seqs)
        self.cudagraph_mode = CUDAGraphMode.NONE
        self.uniform_decode_query_len = 1  # 1 + k under speculation: the default length of dispatch
        self.uniform_decode_query_lens: tuple[int, ...] = (1,)  # NOTE 4
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(),
            CUDAGraphMode.FULL: set(),
        }
        self.keys_initialized = False

    # --8<-- [start:keys]
    def initialize_cudagraph_keys(
        self, mode: CUDAGraphMode, uniform_decode_query_len: int = 1,
        uniform_decode_query_lens: Iterable[int] | None = None,
    ) -> None:  # fmt: skip
        """Fill ``cudagraph_keys`` for the resolved ``mode`` (call once, at start-up); uniform
        keys for each length of ``uniform_decode_query_lens`` (default 1 and
        ``uniform_decode_query_len``, NOTE 4)."""
        q = _check_positive_int("uniform_decode_query_len", uniform_decode_query_len)
        lens = list((1, q) if uniform_decode_query_lens is None else uniform_decode_query_lens)
        if not lens:
            raise ValueError("uniform_decode_query_lens must not be empty")
        for n in lens:
            _check_positive_int("every uniform decode query length", n)
        self.cudagraph_mode, self.uniform_decode_query_len = mode, q
        self.uniform_decode_query_lens = tuple(sorted(set(lens)))
        for keys in self.cudagraph_keys.values():
            keys.clear()
        mixed = mode.mixed_mode()
        if mixed != CUDAGraphMode.NONE:
            for size in self.capture_sizes:
                self.cudagraph_keys[mixed].add(self._mixed_key(size, mixed))
        if mode.separate_routine() and mode.decode_mode() == CUDAGraphMode.FULL:
            for n, size in ((n, s) for n in self.uniform_decode_query_lens for s in self.capture_sizes):
                if n <= size <= n * self.max_num_seqs and size % n == 0:
                    self.cudagraph_keys[CUDAGraphMode.FULL].add(BatchDescriptor(size, size // n, uniform=True))
        self.keys_initialized = True
        self.check_invariants()

    def _mixed_key(self, size: int, mode: CUDAGraphMode) -> BatchDescriptor:
        if mode == CUDAGraphMode.PIECEWISE:
            return BatchDescriptor(size)  # NOTE 2: pieces never see the requests
        return BatchDescriptor(size, min(size, self.max_num_seqs))
    # --8<-- [end:keys]

    # --8<-- [start:dispatch]
    def dispatch(
        self, num_tokens: int, uniform_decode: bool = False, use_cascade_attn: bool = False,
        uniform_query_len: int | None = None,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:  # fmt: skip
        """The runtime mode and key for a batch of ``num_tokens`` tokens: FULL > PIECEWISE > NONE.
        ``uniform_decode``: every request has ``uniform_query_len`` tokens (default
        ``uniform_decode_query_len``); the uniform key of that length comes first (NOTE 4)."""
        _check_positive_int("num_tokens", num_tokens)
        if uniform_query_len is not None:
            _check_positive_int("uniform_query_len", uniform_query_len)
            if not uniform_decode:
                raise ValueError(f"uniform_query_len={uniform_query_len} needs uniform_decode=True")
        eager = (CUDAGraphMode.NONE, BatchDescriptor(num_tokens))
        padded = pad_to_capture_size(num_tokens, self.capture_sizes)
        if not self.keys_initialized or self.cudagraph_mode == CUDAGraphMode.NONE or padded is None:
            return eager
        full, piecewise = self.cudagraph_keys[CUDAGraphMode.FULL], self.cudagraph_keys[CUDAGraphMode.PIECEWISE]
        if not use_cascade_attn:  # cascade attention cannot run inside a full graph
            q = uniform_query_len or self.uniform_decode_query_len
            if uniform_decode and padded % q == 0:
                key = BatchDescriptor(padded, padded // q, uniform=True)
                if key in full:
                    return CUDAGraphMode.FULL, key
            key = self._mixed_key(padded, CUDAGraphMode.FULL)  # NOTE 3
            if key in full:
                return CUDAGraphMode.FULL, key
        key = self._mixed_key(padded, CUDAGraphMode.PIECEWISE)
        if key in piecewise:
            return CUDAGraphMode.PIECEWISE, key
        return eager
    # --8<-- [end:dispatch]

    def get_capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What to capture at start-up: PIECEWISE keys first, then FULL, each largest first."""
        order = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)
        return [
            (mode, sorted(self.cudagraph_keys[mode], key=_capture_order, reverse=True))
            for mode in order
            if self.cudagraph_keys[mode]
        ]

    def check_invariants(self) -> None:
        sizes = self.capture_sizes
        assert sizes == sorted(set(sizes)) and all(s >= 1 for s in sizes), f"capture sizes {sizes}"
        lens = self.uniform_decode_query_lens
        for key in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            assert key.num_tokens in sizes, f"PIECEWISE key {key} is not a capture size"
            assert key.num_reqs is None and not key.uniform, f"PIECEWISE key {key} must not name requests"
        for key in self.cudagraph_keys[CUDAGraphMode.FULL]:
            assert key.num_tokens in sizes, f"FULL key {key} is not a capture size"
            assert key.num_reqs is not None and 1 <= key.num_reqs <= self.max_num_seqs, f"FULL key {key}"
            if key.uniform:  # NOTE 4: each against its own length
                assert key.num_tokens % key.num_reqs == 0, f"uniform FULL key {key}: tokens not a multiple of requests"
                n = key.uniform_query_len
                assert n in lens, f"uniform FULL key {key}: query length {n} not in {lens}"
