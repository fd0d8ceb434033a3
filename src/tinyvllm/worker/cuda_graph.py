"""The CUDA-graph wrapper: capture a callable once per batch shape, then replay it.

Concept: the runner decides, per step, the runtime mode and the ``BatchDescriptor``
(``CudagraphDispatcher.dispatch``) and announces them with ``set_forward_context``. Every
``CUDAGraphWrapper`` reads that context when it is called. With no context, with
``NONE``, or with a mode that is not its own, it just calls the wrapped callable. With its
own mode it captures a graph the first time it sees a descriptor and replays it every
later time. Two wrappers nest: one FULL wrapper around the whole forward, one PIECEWISE
wrapper around each piece between attention ops; in a FULL step the inner ones pass
through, in a PIECEWISE step the outer one does.

Follows: seed 000, vLLM design doc "CUDA Graphs" (Chinese translation; based on vLLM PR
#20059), sections "CUDAGraphWrapper" and "嵌套 Wrapper 设计" (the nested wrappers).
Mirrors: ``vllm/compilation/cuda_graph.py`` (``CUDAGraphWrapper``) and
``vllm/forward_context.py`` (``set_forward_context``, ``get_forward_context``).

Invariants: ``entries`` has one entry per descriptor ever captured by this wrapper; a
replay returns tensors at the very addresses the capture returned, overwritten in place.

NOTE 1 (what a replay checks): a real graph reads its inputs from the addresses it was
captured with and bakes every Python value into its kernels. Passing a new tensor, a
tensor of another shape, or a changed Python number silently computes with stale data.
So every replay compares each argument with the captured one: tensors (also inside
lists, tuples, dicts and dataclasses) by storage address, shape, stride and dtype, all
other values by equality, and raises ``RuntimeError`` naming the argument. It costs each
replay host time, so it compares flat leaves (``flat_leaves``), takes the very tensor object
captured (held weakly: the record owns no input, NOTE 5) as unchanged (only ``set_`` or
``resize_`` could move it), and names the argument (``describe_arguments``) only on a difference.
NOTE 2 (emulation): ``emulate=True`` stands in for a graph on a machine without CUDA.
Capture runs the callable and keeps its arguments and outputs; replay runs it again on
the *captured* arguments and copies the results into the captured outputs. Both run under
``forbid_host_reads``: an op that needs a tensor's value on the host (``.item()``,
``nonzero``, boolean-mask indexing) raises, as it does while CUDA captures a stream.
Together with NOTE 1 this makes the rules a real graph imposes visible in a CPU test.
NOTE 3 (capture then replay): on CUDA, kernels recorded during capture do not run, so
the wrapper replays once right after capturing: the first call returns real results too.
NOTE 4 (one memory pool): all graphs allocate from one pool (``torch.cuda.graph_pool_handle``,
the runner's, or a wrapper's own), so graphs of different sizes share memory.
NOTE 5 (outputs the wrapper does not own): on CUDA an entry keeps only *weak* references
to the capture's outputs (``weak_ref_tensors``: tensors at the same addresses that do not
own the memory), as vLLM's wrapper does. The capture call itself returns the owning
tensors, so while the dummy forward of a capture size runs, each piece's outputs stay
alive exactly as long as the model's Python code holds them, and the next piece's capture
allocates around them. Once that forward ends the memory goes back to the shared pool
(NOTE 4) and the next capture size reuses it. A replay of size ``S`` then writes the same
addresses in the same order as ``S``'s capture forward did, so nothing a later piece still
reads is overwritten; other sizes may share those addresses, which is safe because only
one graph runs at a time and a forward's outputs are used before the next forward. Were
the outputs owned, every piece of every size would hold its own: for the Qwen3-0.6B shape
(29 pieces, 51 sizes, 10,503 tokens in all) about 20 KiB per token per piece, some 6 GB
taken from the KV cache; shared, about what the largest size's one forward needs. So the
tensors a replay returns must be used before the next forward, and must never be kept. An
emulated entry (NOTE 2) keeps its outputs, since a replay copies into them; instead an
``EmulatedPool`` shared by the emulated wrappers makes the hazard visible: when a graph of
another shape (another runtime mode or descriptor) captures or replays, every output of
the other shapes is overwritten with NaN (the lowest value for integers), so code that
keeps a graph's output past the next forward of another shape fails in a CPU test.

Left out: garbage-collection tricks during capture, debug-mode address logging, streams.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tinyvllm.worker.cudagraph_dispatcher import BatchDescriptor, CUDAGraphMode


# --8<-- [start:context]
@dataclass(frozen=True)
class ForwardContext:
    """What every wrapper needs to know about the forward that is running now."""

    runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(
    runtime_mode: CUDAGraphMode, batch_descriptor: BatchDescriptor | None
) -> Iterator[ForwardContext]:
    """Announce the runtime mode and descriptor of one forward to every wrapper."""
    global _forward_context
    if runtime_mode not in CUDAGraphMode.valid_runtime_modes():
        raise ValueError(f"runtime mode must be one of NONE, PIECEWISE, FULL, got {runtime_mode.name}")
    if runtime_mode != CUDAGraphMode.NONE and batch_descriptor is None:
        raise ValueError(f"runtime mode {runtime_mode.name} needs a batch descriptor")
    previous, _forward_context = _forward_context, ForwardContext(runtime_mode, batch_descriptor)
    try:
        yield _forward_context
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext | None:
    """The context of the forward running now, or None outside ``set_forward_context``."""
    return _forward_context
# --8<-- [end:context]


# --8<-- [start:signature]
def describe_arguments(value: Any, name: str, out: dict[str, tuple] | None = None) -> dict[str, tuple]:
    """Flatten an argument into ``{path: fingerprint}``: tensors by (storage address, shape,
    stride, dtype), lists/tuples/dicts/dataclasses by their parts, anything else by value.
    Parts are added to ``out`` (a new dict when None), which is returned."""
    out = {} if out is None else out
    if isinstance(value, torch.Tensor):
        out[name] = ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
    elif isinstance(value, (list, tuple)):
        out[name] = (type(value).__name__, len(value))
        for i, item in enumerate(value):
            describe_arguments(item, f"{name}[{i}]", out)
    elif isinstance(value, dict):
        out[name] = ("dict", tuple(value))
        for key, item in value.items():
            describe_arguments(item, f"{name}[{key!r}]", out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        out[name] = ("dataclass", type(value))
        for f in dataclasses.fields(value):
            describe_arguments(getattr(value, f.name), f"{name}.{f.name}", out)
    elif isinstance(value, float) and value != value:
        out[name] = ("value", "nan")  # NaN != NaN, yet an unchanged NaN is no change
    else:
        out[name] = ("value", value)
    return out


def flat_leaves(value: Any, out: list) -> list:
    """An argument's leaves in ``describe_arguments``' order, without names: each tensor
    itself, each container's type and size, every other value (NaN as ``"nan"``). Appended
    to ``out``, which is returned."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        out.append((type(value), len(value)))
        for item in value:
            flat_leaves(item, out)
    elif isinstance(value, dict):
        out.append(tuple(value))
        for item in value.values():
            flat_leaves(item, out)
    elif hasattr(type(value), "__dataclass_fields__"):
        out.append(type(value))
        for name in type(value).__dataclass_fields__:
            flat_leaves(getattr(value, name), out)
    else:
        out.append("nan" if isinstance(value, float) and value != value else value)
    return out


def leaf_fact(leaf: Any) -> Any:
    """What a replay compares of a leaf: a tensor's (storage address, shape, stride, dtype), else the leaf."""
    return (leaf.data_ptr(), leaf.shape, leaf.stride(), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf


def held_leaves(leaves: list) -> tuple:
    """What an entry keeps of its captured leaves (NOTE 1): a weak reference to each tensor, so
    that the record owns no input (a piece's input is the last piece's output, which goes back
    to the pool when the capture's forward ends, NOTE 5), and every other leaf itself."""
    return tuple(weakref.ref(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)


def leaves_unchanged(captured: tuple, facts: tuple, now: list) -> bool:
    """NOTE 1, the fast comparison: each leaf of ``now`` is the very object captured (``captured``
    is ``held_leaves``': tensors behind weak references), or has the captured leaf's fact."""
    if len(now) != len(captured):
        return False
    for then, fact, leaf in zip(captured, facts, now):
        if then is leaf or (type(then) is weakref.ref and then() is leaf):
            continue
        if leaf_fact(leaf) != fact:
            return False
    return True


def first_difference(captured: dict[str, tuple], now: dict[str, tuple]) -> str | None:
    """A sentence naming the first argument that differs from the capture, or None."""
    for path, then in captured.items():
        if path not in now:
            return f"argument {path} is missing (it was {then})"
        if now[path] != then:
            what = "tensor (address, shape, stride, dtype)" if then[0] == "tensor" else "value"
            return f"argument {path} changed since capture: {what} was {then[1:]}, now {now[path][1:]}"
    extra = next((p for p in now if p not in captured), None)
    return None if extra is None else f"argument {extra} was not there at capture"
# --8<-- [end:signature]


def _positional_names(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The parameter names positional arguments bind to, when every parameter is a plain one
    (no ``*args``, ``**kwargs`` or keyword-only); else None, and a call binds the slow way."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params)


# --8<-- [start:host_reads]
_aten = torch.ops.aten
# Ops whose result depends on a tensor's values on the host: a CUDA graph cannot capture them.
HOST_READ_OPS = frozenset({
    _aten.item.default, _aten._local_scalar_dense.default, _aten.is_nonzero.default,
    _aten.nonzero.default, _aten.masked_select.default, _aten.equal.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.bincount.default,
})  # fmt: skip
_INDEX_OPS = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default})


def _host_read(name: str) -> Callable[..., Any]:
    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"Tensor.{name}() reads a tensor's value on the host, which a CUDA graph cannot capture")

    return refuse


class forbid_host_reads(TorchDispatchMode):
    """Raise on any op that reads a tensor's value on the host (NOTE 2): the CPU stand-in
    for CUDA's "operation not permitted when stream is capturing".

    Ops reach ``__torch_dispatch__``; ``Tensor.tolist`` and ``Tensor.numpy`` read CPU memory
    without dispatching an op, so inside the ``with`` block they are replaced by methods
    that raise, and restored on exit.
    """

    _UNDISPATCHED = ("tolist", "numpy")

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in self._UNDISPATCHED}
        for name in self._UNDISPATCHED:
            setattr(torch.Tensor, name, _host_read(name))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, method in self._saved.items():
                setattr(torch.Tensor, name, method)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func in _INDEX_OPS and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1]
        )
        unsized_repeat = func is _aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None
        if func in HOST_READ_OPS or bool_index or unsized_repeat:
            what = "boolean-mask indexing" if bool_index else str(func)
            raise RuntimeError(f"{what} reads a tensor's value on the host, which a CUDA graph cannot capture")
        return func(*args, **(kwargs or {}))
# --8<-- [end:host_reads]


def _copy_into(target: Any, source: Any) -> None:
    """Copy ``source``'s tensors into the matching tensors of ``target`` (same structure)."""
    if isinstance(target, torch.Tensor):
        target.copy_(source)
    elif isinstance(target, (list, tuple)):
        for t, s in zip(target, source):
            _copy_into(t, s)
    elif isinstance(target, dict):
        for key in target:
            _copy_into(target[key], source[key])
    elif dataclasses.is_dataclass(target):
        for f in dataclasses.fields(target):
            _copy_into(getattr(target, f.name), getattr(source, f.name))


# --8<-- [start:emulated_pool]
class EmulatedPool:
    """The emulated stand-in for the graph pool (NOTE 5): the wrappers sharing it, and the
    shape whose graphs ran last. A capture or replay of another shape poisons every output
    the pool's entries returned for other shapes, as reusing their memory would."""

    def __init__(self) -> None:
        self.wrappers: list[CUDAGraphWrapper] = []
        self.current: tuple[CUDAGraphMode, BatchDescriptor] | None = None

    def enter(self, shape: tuple[CUDAGraphMode, BatchDescriptor]) -> None:
        """A graph of ``shape`` is about to capture or replay."""
        if shape == self.current:
            return
        for wrapper in self.wrappers:
            for key, entry in wrapper.entries.items():
                if (wrapper.runtime_mode, key) != shape:
                    _poison(entry.output)
        self.current = shape
# --8<-- [end:emulated_pool]


def _poison(value: Any) -> None:
    """Overwrite every tensor in ``value`` with NaN, or its dtype's lowest value (integers)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            value.fill_(float("nan"))
        elif value.dtype != torch.bool:
            value.fill_(torch.iinfo(value.dtype).min)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _poison(item)
    elif isinstance(value, dict):
        for item in value.values():
            _poison(item)


# --8<-- [start:weak_ref]
def weak_ref_tensors(value: Any) -> Any:
    """``value`` with every tensor (also inside lists, tuples and dicts) replaced by one at
    the same address, shape, stride, offset and dtype that does not own its memory (NOTE 5).

    The caller must keep the memory alive some other way (here: the graph pool) for as
    long as the alias is read; torch's own CUDA-graph trees build their aliases the same way.
    """
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), value.device, storage.nbytes())
        empty = torch.empty(0, dtype=value.dtype, device=value.device)
        return empty.set_(alias, value.storage_offset(), value.shape, value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(weak_ref_tensors(item) for item in value)
    if isinstance(value, dict):
        return {key: weak_ref_tensors(item) for key, item in value.items()}
    return value
# --8<-- [end:weak_ref]


@dataclass
class CUDAGraphEntry:
    """One captured graph: what it was captured with, what it returns."""

    batch_descriptor: BatchDescriptor
    signature: dict[str, tuple]  # NOTE 1
    output: Any  # the tensors a replay overwrites and returns (CUDA: weak references, NOTE 5)
    graph: Any = None  # torch.cuda.CUDAGraph; None when emulated
    args: tuple = ()  # emulated: the captured arguments (NOTE 2)
    kwargs: dict = dataclasses.field(default_factory=dict)
    num_replays: int = 0
    leaves: tuple = ()  # NOTE 1: the captured arguments' leaves (held_leaves: tensors weakly), each one's fact
    facts: tuple = ()


class CUDAGraphWrapper:
    """Capture / replay / pass through one callable for one runtime mode (module header)."""

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode,
        emulate: bool = False,
        *,
        pool: Any = None,
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError(f"a CUDAGraphWrapper is bound to PIECEWISE or FULL, got {runtime_mode.name}")
        if not emulate and not torch.cuda.is_available():
            raise ValueError("CUDAGraphWrapper needs CUDA unless emulate=True")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.emulate = emulate
        if emulate:
            if pool is not None and not isinstance(pool, EmulatedPool):
                raise ValueError(f"an emulated wrapper takes an EmulatedPool or None, got {pool!r}")
            pool = pool if pool is not None else EmulatedPool()
            pool.wrappers.append(self)  # NOTE 5
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()  # NOTE 4
        self.entries: dict[BatchDescriptor, CUDAGraphEntry] = {}
        self._parameter_names = _positional_names(self._callable())  # looked up once: a replay checks every call

    # --8<-- [start:call]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        if context is None or context.runtime_mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)  # NONE, or the other wrapper's step: pass through
        key = context.batch_descriptor
        leaves = flat_leaves((args, kwargs), [])  # NOTE 1
        if self.emulate:
            self.pool.enter((self.runtime_mode, key))  # other shapes' outputs are gone (NOTE 5)
        entry = self.entries.get(key)
        if entry is None:
            entry, owned = self._capture(key, self._signature(args, kwargs), args, kwargs)
            entry.leaves, entry.facts = held_leaves(leaves), tuple(map(leaf_fact, leaves))
            self.entries[key] = entry
            self._replay(entry)  # NOTE 3
            return owned  # the caller owns the capture's outputs; the entry does not (NOTE 5)
        if not leaves_unchanged(entry.leaves, entry.facts, leaves):  # NOTE 1: a difference is named
            problem = first_difference(entry.signature, self._signature(args, kwargs))
            if problem is not None:
                raise RuntimeError(f"{self.runtime_mode.name} graph for {key}: {problem}")
        self._replay(entry)
        return entry.output
    # --8<-- [end:call]

    def _signature(self, args: tuple, kwargs: dict) -> dict[str, tuple]:
        """NOTE 1: every argument's fingerprint, under its parameter name where known."""
        names = self._parameter_names
        if names is not None and not kwargs and len(args) <= len(names):  # the model's call: positions only
            named = dict(zip(names, args))
        else:
            try:
                named = dict(inspect.signature(self._callable()).bind(*args, **kwargs).arguments)
            except (TypeError, ValueError):  # no introspectable signature: positions and keywords
                named = {f"#{i}": a for i, a in enumerate(args)} | kwargs
        signature: dict[str, tuple] = {}
        for name, value in named.items():
            describe_arguments(value, name, signature)
        return signature

    def _callable(self) -> Callable[..., Any]:
        return getattr(self.runnable, "forward", self.runnable)

    def _capture(
        self, key: BatchDescriptor, signature: dict, args: tuple, kwargs: dict
    ) -> tuple[CUDAGraphEntry, Any]:
        """The new entry and the capture's owning outputs (NOTE 5); replayed next (NOTE 3)."""
        if self.emulate:
            with forbid_host_reads():
                output = self.runnable(*args, **kwargs)
            return CUDAGraphEntry(key, signature, output, args=args, kwargs=kwargs, num_replays=-1), output
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.runnable(*args, **kwargs)
        return CUDAGraphEntry(key, signature, weak_ref_tensors(output), graph=graph, num_replays=-1), output

    def _replay(self, entry: CUDAGraphEntry) -> None:
        entry.num_replays += 1
        if entry.graph is not None:
            entry.graph.replay()
        elif entry.num_replays > 0:  # emulated: the capture itself already ran the callable
            with forbid_host_reads():
                _copy_into(entry.output, self.runnable(*entry.args, **entry.kwargs))

    def check_invariants(self) -> None:
        for key, entry in self.entries.items():
            assert entry.batch_descriptor == key, f"entry for {key} holds {entry.batch_descriptor}"
            assert (entry.graph is None) == self.emulate, f"entry for {key}: graph {entry.graph} with emulate={self.emulate}"
