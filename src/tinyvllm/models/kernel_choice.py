"""Choosing between a one-kernel form and the torch operations: one rule for every such module.

Concept: ``rms_norm.py``, ``rotary.py`` and ``qk_norm_rotary.py`` each have a Triton kernel
and the torch operations it replaces. The choice is one of ``IMPLS``: ``auto`` takes the
kernel where it pays and can run (CUDA tensors of a form the kernel takes, which each
module states), ``torch`` and ``triton`` force one. An environment variable per kernel
(``TINYVLLM_RMS_NORM``, ``TINYVLLM_ROTARY``) sets it when the model is built, so that a
benchmark can A/B the two on one machine.

Invariants: a value outside ``IMPLS`` is a ``ValueError`` naming the variable and the value.
"""

from __future__ import annotations

import os

IMPLS = ("auto", "torch", "triton")


def impl_from_env(env: str) -> str:
    """The implementation the environment variable ``env`` asks for ("auto" when unset)."""
    impl = os.environ.get(env, "auto")
    if impl not in IMPLS:
        raise ValueError(f"{env}={impl!r} is not one of {IMPLS}")
    return impl


def uses_kernel(impl: str, on_cuda_and_taken: bool) -> bool:
    """Whether ``impl`` means the kernel, given whether the tensors are on CUDA and of a form
    the kernel takes (what ``auto`` asks)."""
    return impl == "triton" or (impl == "auto" and on_cuda_and_taken)
