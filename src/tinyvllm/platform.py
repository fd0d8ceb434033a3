"""Where kernels can run, and the choice between a one-kernel form and the torch operations.

Concept: two questions that several layers ask, answered in one place. ``triton_can_run_on``:
can a Triton kernel run on tensors of this device (CUDA, or the CPU under Triton's
interpreter)? The paged-attention and KV-write kernels ask it before a launch, the norm and
rotary kernels too, and ``LLM`` before it accepts a Triton attention backend. The kernel
choice: ``rms_norm.py``, ``rotary.py`` and ``qk_norm_rotary.py`` each have a Triton kernel
and the torch operations it replaces, and pick one of ``IMPLS``: ``auto`` takes the kernel
where it pays and can run (CUDA tensors of a form the kernel takes, which each module
states), ``torch`` and ``triton`` force one. An environment variable per kernel
(``TINYVLLM_RMS_NORM``, ``TINYVLLM_ROTARY``) sets it when the model is built, so that a
benchmark can A/B the two on one machine (``impl_from_env``).

Mirrors: ``vllm/platforms/`` (``current_platform``, ``Platform.is_cuda()``: what the
machine can run, asked by every layer), and ``vllm/model_executor/custom_op.py``
(``CustomOp.dispatch_forward`` picks ``forward_cuda`` or ``forward_native``; vLLM's
switch is ``CompilationConfig.custom_ops``, ``"+rms_norm"`` or ``"-rms_norm"``, where
tinyvllm reads an environment variable per kernel).

Invariants:
- ``triton_can_run_on(device)`` is true exactly when ``device.type == "cuda"`` or
  ``TRITON_INTERPRET=1`` is set.
- ``uses_kernel``: "triton" always, "torch" never, "auto" when the tensors are on CUDA and
  of a form the kernel takes.
- A value outside ``IMPLS`` is a ``ValueError`` naming the variable and the value.
- This module imports nothing of tinyvllm and neither torch nor Triton (NOTE 2).

NOTE 1 (why a module of its own): the KV write, the paged-attention kernel, the norm and
rotary kernels and ``LLM``'s check of the attention backend ask the same question, from
``attention/``, ``models/`` and ``engine/``. Kept in ``attention/kv_cache_write.py`` it made
``models/`` and ``engine/`` import a KV-cache writer to learn where Triton runs; as in vLLM,
where every layer asks ``vllm/platforms/``, the answer sits below all of them.
NOTE 2 (the bottom layer): it reads ``device.type`` and the environment and nothing else,
so importing it loads no torch (``tests/test_import_layers.py`` checks both), and any
module of any layer may import it without an arrow running back up.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the annotation: importing this module loads no torch (NOTE 2)
    import torch


def triton_can_run_on(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# --8<-- [start:kernel_choice]
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
# --8<-- [end:kernel_choice]
