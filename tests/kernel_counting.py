"""Counting what a kernel replaces: the torch operations a piece of code runs, and the launches
of a jitted Triton kernel (stood in for), for the one-kernel tests (RMSNorm, rotary)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class CountKernels(TorchDispatchMode):
    """The operations that compute something (views and shape changes are free)."""

    FREE = {"view", "_unsafe_view", "unsqueeze", "squeeze", "slice", "select", "expand", "detach", "alias", "empty",
            "lift_fresh", "flatten", "transpose", "split", "split_with_sizes", "resolve_conj", "resolve_neg"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class Launches:
    """Stands in for the jitted kernel: records each ``kernel[grid](*args, **constexprs)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple):
        return lambda *args, **constexprs: self.calls.append((grid, constexprs))
