"""Device synchronisations: where a step makes the host wait for the GPU, counted on a CPU.

Concept: a GPU runs the kernels the host queues, in order, while the host goes on. The
host waits (the CUDA stream is synchronised) whenever it needs a value the queue has not
produced yet, or hands the GPU memory it must not touch again before the copy is done.
Each wait empties the queue: the GPU idles while the host prepares and launches the next
kernels. A step needs one such wait, for the sampled token ids the scheduler must see;
vLLM's model runner is built around keeping every other one out of the step. On a machine
without a GPU nothing waits, so a stray ``.item()`` cannot be seen in a timing:
``DeviceSyncCounter`` makes them countable instead. It is a ``TorchFunctionMode``: it sees
every torch call, follows which tensors live on the device, and records each call that
would make a CUDA stream synchronise, with the line of tinyvllm that made it. ``upload``
is the way around the commonest one: values sent up from pinned memory without a wait.

Follows: seed 001 "vLLM V1 Sample, Part 2" ch. 10.1 (MinP's double buffer: "异步CPU→GPU
传输", an asynchronous CPU → GPU copy) and ch. 10.2 (LogitBias's ``_device_tensor``:
"创建CPU tensor + 异步传输到GPU", build a CPU tensor, then copy it up asynchronously),
which ``upload`` is. Facts: PyTorch's CUDA copy waits for the stream after a copy made
without ``non_blocking`` (``memcpy_and_sync``) and moves host indices up that way before
indexing a device tensor. Mirrors: what ``torch.cuda.set_sync_debug_mode("warn")``
reports on a GPU, which the ``gpu`` twin of the tests compares with this count.

Invariants: a tensor is on the device when it was made for a ``torch.device`` (a factory's
``device=`` argument, ``Tensor.to(device)``, ``Tensor.cuda()``), was marked with ``mark``,
or was computed from one that is; ``syncs`` lists, in order, every call since the last
``take`` that would synchronise, each of one of the three kinds of NOTE 2
(``check_invariants``).

NOTE 1 (intent, not placement): on the CPU the "device" and the host are one memory, so
the counter cannot ask a tensor where it is. It follows the code's intent instead:
tinyvllm passes the runner's ``torch.device`` for device tensors and makes host tensors
with no device or with the string ``"cpu"`` (``torch.tensor(data, device="cpu",
pin_memory=...)``). ``Tensor.to("cpu")`` and ``Tensor.cpu()`` move to the host. Buffers
that are one tensor on the CPU but two on a GPU (the persistent input buffers, the block
table) are marked device by the caller, with every view of them (a graph's, made earlier).
NOTE 2 (what synchronises), following PyTorch's CUDA copy and indexing code:
  read:  a value to the host: ``tolist``, ``item``, ``bool``/``int``/``float``/``index``
         of a tensor, ``numpy``, ``cpu``, ``to("cpu")``, ``torch.equal``/``allclose``, and
         a blocking ``copy_`` into a host tensor;
  copy:  a blocking copy to the device (``torch.tensor(data, device=...)``, ``to(device)``
         or ``copy_`` without ``non_blocking=True``): PyTorch waits for the stream after
         it, and so does indexing a device tensor with host indices (a list of ints, or a
         host tensor), which copies them up first, and writing a host tensor, or a Python
         number into one element (``t[i] = 5``) or through indices (``t[rows, cols] = 1``),
         made a one-element host tensor and copied up (a number filling a slice is a fill
         on the device; ``fill_at`` writes through indices without the copy);
  shape: an output whose size depends on values: ``nonzero``, ``masked_select``,
         ``unique``, ``bincount``, one-argument ``where``, ``repeat_interleave`` by a
         tensor without ``output_size``, indexing with a boolean mask.
A ``non_blocking=True`` copy up is counted free: tinyvllm makes it only from pinned
memory (``pin_memory=True`` off the CPU), which the driver copies without waiting.
NOTE 3 (not counted): calls made inside Triton's interpreter (``TRITON_INTERPRET=1``,
which stands in for a kernel launch on the CPU and reads its arguments on the host), and
everything while ``counting`` is False (start-up: the counter must see the engine built to
know its device tensors).

Left out: host syncs outside torch (``torch.cuda.synchronize`` and events are explicit
and appear only off the CPU), allocator syncs (``cudaMalloc`` after the cache is full),
and the cost of each wait, which only a GPU can give.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class Sync:
    """One call that would make the host wait for the device (NOTE 2)."""

    kind: str  # "read", "copy" or "shape"
    op: str  # the torch call, e.g. "Tensor.tolist"
    file: str  # where the call was made: "tinyvllm/worker/model_runner.py"
    line: int
    function: str  # "execute_model"

    def __str__(self) -> str:
        return f"{self.kind:5} {self.op:20} {self.file}:{self.line} {self.function}"


# --8<-- [start:upload]
def pin_memory_for(device: torch.device | str) -> bool:
    """Whether host buffers copied up to ``device`` should be pinned: on CUDA, where a
    ``non_blocking`` copy from pageable memory is staged by the host first (NOTE 2); vLLM's
    ``is_pin_memory_available()``."""
    return torch.device(device).type == "cuda"


def upload(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A new tensor on ``device`` holding ``values`` (a list, an array or a host tensor),
    copied up without making the host wait (NOTE 2): built in pinned memory off the CPU,
    then one ``non_blocking`` copy. PyTorch keeps a pinned block from reuse until its copy
    is done."""
    device = torch.device(device)
    pin = pin_memory_for(device)
    if isinstance(values, torch.Tensor):
        host = torch.empty(values.shape, dtype=dtype, device="cpu", pin_memory=pin).copy_(values)
    else:
        host = torch.tensor(values, dtype=dtype, device="cpu", pin_memory=pin)
    return host.to(device, non_blocking=True)
# --8<-- [end:upload]


# --8<-- [start:fill_at]
def fill_at(tensor: torch.Tensor, indices: tuple[torch.Tensor, ...], value: float) -> torch.Tensor:
    """``tensor[indices] = value`` with ``indices`` already on the device, without a wait:
    written as ``tensor[indices] = value``, PyTorch makes ``value`` a one-element host tensor
    and copies it up, blocking (NOTE 2); here it is made on the device."""
    return tensor.index_put_(indices, torch.full((), value, dtype=tensor.dtype, device=tensor.device))
# --8<-- [end:fill_at]


KINDS = ("read", "copy", "shape")  # NOTE 2
_T = torch.Tensor
_READS = {_T.tolist, _T.item, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.numpy, _T.cpu,
          _T.__array__, torch.equal, torch.allclose}  # fmt: skip
_SHAPES = {torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.masked_select, _T.masked_select,
           torch.unique, _T.unique, torch.unique_consecutive, _T.unique_consecutive, torch.bincount,
           _T.bincount}  # fmt: skip
_INDEXING = {_T.__getitem__, _T.__setitem__}
_MAKES_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, _T.new_tensor}
_TO_DEVICE = {_T.to, _T.cuda}
_MOVES = _TO_DEVICE | {_T.cpu}
_HERE = __file__
_TORCH = torch.__path__[0]


def _name(func: Any) -> str:
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
    owner, _, rest = qualname.partition(".")
    if owner in ("_TensorBase", "TensorBase"):
        qualname = "Tensor." + rest
    elif owner == "_VariableFunctionsClass":  # torch.tensor, torch.bincount, ...
        qualname = "torch." + rest
    module = getattr(func, "__module__", None)
    return qualname if "." in qualname or module is None else f"torch.{qualname}"


def _is_device_target(value: Any) -> bool | None:
    """True: ``value`` names the device; False: the host; None: it names no device (NOTE 1)."""
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        return not value.startswith("cpu")
    return None


class DeviceSyncCounter(TorchFunctionMode):
    """Use as ``with counter:`` around everything that builds and runs the engine."""

    def __init__(self) -> None:
        super().__init__()
        self._device: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> True
        self._marked_memory: set[int] = set()  # the storage addresses of marked tensors (NOTE 1)
        self.syncs: list[Sync] = []
        self.counting = False

    # -- what the caller tells and asks -----------------------------------------------------

    def mark(self, tensors: Iterable[torch.Tensor]) -> None:
        """These tensors live on the device (NOTE 1)."""
        for t in tensors:
            self._device[t] = True
            self._marked_memory.add(t.untyped_storage().data_ptr())

    def is_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        return t in self._device or (bool(self._marked_memory) and t.untyped_storage().data_ptr() in self._marked_memory)

    def check_invariants(self) -> None:
        for sync in self.syncs:
            assert sync.kind in KINDS, f"{sync} is of no known kind"
        for tensor in self._device.keys():
            assert isinstance(tensor, torch.Tensor), f"{tensor!r} is marked on the device but is no tensor"

    def take(self) -> list[Sync]:
        """The syncs recorded since the last ``take``, and forget them."""
        syncs, self.syncs = self.syncs, []
        return syncs

    # -- the mode --------------------------------------------------------------------------

    # --8<-- [start:classify]
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        on_device, kind = self._classify(func, args, kwargs)
        if out is (args[0] if args else None) and func in _MOVES and on_device != self.is_device(out):
            out = out.detach()  # on the CPU a move returns its input: the copy gets its own object
        if on_device:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._device[t] = True
        if kind is not None and self.counting:
            site = call_site(sys._getframe(1))
            if site is not None:
                self.syncs.append(Sync(kind, _name(func), *site))
        return out

    def _classify(self, func: Any, args: tuple, kwargs: dict) -> tuple[bool, str | None]:
        """(is the output on the device, which kind of sync the call is or None)."""
        leaves = tree_flatten((args, kwargs))[0]
        from_device = any(self.is_device(t) for t in leaves)
        if func in _READS:
            return False, "read" if from_device else None
        if func in _TO_DEVICE:
            return self._classify_to(func, args, kwargs, from_device)
        if func is _T.copy_:
            dst, src = args[0], args[1]
            blocking = not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            if self.is_device(dst) != self.is_device(src) and blocking:
                return self.is_device(dst), "copy" if self.is_device(dst) else "read"
            return self.is_device(dst), None
        if "device" in kwargs and kwargs["device"] is not None:
            target = _is_device_target(kwargs["device"])
            copies = func in _MAKES_FROM_DATA and target and not from_device
            return bool(target), "copy" if copies else None
        if not from_device:
            return False, None
        if func in _SHAPES:
            return True, "shape"
        if func in (torch.where, _T.where) and len(args) + len(kwargs) == 1:
            return True, "shape"
        if func in (torch.repeat_interleave, _T.repeat_interleave):
            by_tensor = len(args) > 1 and isinstance(args[1], torch.Tensor) or isinstance(kwargs.get("repeats"), torch.Tensor)
            return True, "shape" if by_tensor and kwargs.get("output_size") is None else None
        if func in _INDEXING and self.is_device(args[0]):
            if func is _T.__setitem__ and self._write_copies_up(args[0], args[1], args[2]):
                return True, "copy"
            return True, self._classify_index(args[1])
        return True, None
    # --8<-- [end:classify]

    def _classify_to(self, func: Any, args: tuple, kwargs: dict, from_device: bool) -> tuple[bool, str | None]:
        if func is _T.cuda:
            target: bool | None = True
        else:
            target = _is_device_target(kwargs.get("device"))
            for a in args[1:]:
                if target is None and isinstance(a, torch.Tensor):
                    target = self.is_device(a)
                elif target is None:
                    target = _is_device_target(a)
        if target is None:  # a dtype change: stays where it is
            return from_device, None
        if target == from_device:
            return from_device, None
        if kwargs.get("non_blocking"):
            return target, None
        return target, "copy" if target else "read"

    def _write_copies_up(self, target: torch.Tensor, index: Any, value: Any) -> bool:
        """Does ``target[index] = value`` copy ``value`` up first (NOTE 2)? A host tensor
        does; so does a Python number written into one element or through index tensors
        (PyTorch makes it a one-element host tensor); a number filling a slice does not."""
        if isinstance(value, torch.Tensor):
            return not self.is_device(value)
        if not isinstance(value, (bool, int, float)):
            return False
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(part, (torch.Tensor, list)) for part in parts):
            return True
        return len(parts) == target.dim() and all(isinstance(part, int) for part in parts)

    def _classify_index(self, index: Any) -> str | None:
        parts = index if isinstance(index, tuple) else (index,)
        for part in parts:
            if isinstance(part, torch.Tensor):
                if part.dtype == torch.bool:
                    return "shape"
                if not self.is_device(part):
                    return "copy"  # host indices go up first, blocking
            elif isinstance(part, list):
                return "copy"
        return None


def call_site(frame: Any) -> tuple[str, int, str] | None:
    """(file, line, function) of the first frame at or above ``frame`` that is neither this
    module, torch, ``contextlib`` nor ``warnings`` (the line that made the call, in tinyvllm
    or a test); None when Triton's interpreter made it (NOTE 3). The GPU twin places CUDA's
    own warnings with it, from inside ``warnings.showwarning``."""
    site = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if "/triton/" in filename.replace("\\", "/"):
            return None
        skipped = filename == _HERE or filename.startswith(_TORCH) or filename.endswith(("contextlib.py", "warnings.py"))
        if site is None and not skipped:
            parts = filename.replace("\\", "/").split("/")
            short = "/".join(parts[parts.index("tinyvllm"):]) if "tinyvllm" in parts else "/".join(parts[-2:])
            site = (short, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return site
