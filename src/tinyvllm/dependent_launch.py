"""Programmatic dependent launch: a step's Triton kernel starts while the kernel ahead of it ends.

Concept: on a GPU a kernel normally starts only once the kernel before it in the stream has
finished; in between, the device sits idle for the launch itself (about a microsecond in a
CUDA graph), a few hundred times a decode step. On sm_90 and later a kernel may be launched
with the *programmatic stream serialization* attribute (Triton's ``launch_pdl=True``): it may
then start before the kernel ahead of it has finished, and each of its programs first runs
``griddepcontrol.wait`` (Triton's ``gdc_wait``), which returns once that kernel has finished
and its writes are visible. What overlaps is the launch and the start of the programs, never
the work. A kernel lets the ones after it start early with ``griddepcontrol.launch_dependents``
(``gdc_launch_dependents``); without it they may start as its last programs end.

The rule, for every kernel that takes part: its launcher passes ``launch_options(device)``, and
the kernel's first statement is ``wait_for_the_kernel_ahead(USE_PDL)`` (NOTE 1). The kernels: the
norms, the rotary kernels, SiLU-and-multiply, the KV write, paged attention and its merge.

Mirrors: vLLM's Triton kernels with a ``USE_PDL`` constexpr that call ``gdc_wait`` and
``gdc_launch_dependents`` and are launched with ``launch_pdl`` where
``current_platform.is_arch_support_pdl()``; Triton's tutorial 11 (programmatic dependent launch).

Invariants:
- ``launch_options(device)`` is ``{"USE_PDL": False}`` unless ``TINYVLLM_PDL=1`` and ``device``
  is a CUDA device of compute capability 9.0 or later; then ``{"USE_PDL": True, "launch_pdl": True}``.
- A kernel launched with ``launch_pdl`` waits in every program before any load or store (NOTE 1).
- ``TINYVLLM_PDL`` other than unset, "0" or "1" is a ``ValueError`` naming it (``pdl_from_env``).

NOTE 1 (why every program waits, and first): a kernel that starts early may run beside the
kernel ahead of it, so it must not read what that kernel writes, nor write what it reads,
before the wait. And the chain must hold: kernel C, launched after B, starts once B has ended
(or triggered), and B can end only after its programs waited for A; a B that never waited
could end before A, and C would read A's output unfinished. So the wait is the first
statement, before any early return, in every program. (Inside a software-pipelined loop a
load may be hoisted above a wait, Triton issue 11905: here no wait is inside a loop.)
NOTE 2 (the trigger at once): each program calls ``gdc_launch_dependents`` right after its
wait. The kernel after it can start only once every program has called it, that is once the
last program has started, so its early programs never take an SM that one of this kernel's
programs still waited for; they wait in their own ``gdc_wait``. A cuBLAS matmul between two
Triton kernels takes no part: it starts when the kernel ahead ends, as before, and the
Triton kernel after it may start as the matmul's last programs end.
NOTE 3 (off by default): the overlap is at most a microsecond or so a kernel, and whether
it pays is a GPU question: ``bench/cudagraphs.py --pdl-ab`` times the decode step both ways
in one run. An H200 run found no gain (docs page), so ``TINYVLLM_PDL=1`` turns it on.
Left out: a trigger placed later in a kernel (after its loads, say), PDL for the cuBLAS
matmuls (cuBLAS launches its own kernels).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_ENV = "TINYVLLM_PDL"
PDL_DEFAULT = False  # NOTE 3: off: timed on an H200, no gain
MIN_CAPABILITY = (9, 0)  # griddepcontrol is sm_90's


def pdl_from_env() -> bool:
    """Whether ``TINYVLLM_PDL`` asks for programmatic dependent launch (``PDL_DEFAULT`` when unset)."""
    value = os.environ.get(PDL_ENV)
    if value not in (None, "0", "1"):
        raise ValueError(f"{PDL_ENV}={value!r}: must be '0' or '1'")
    return PDL_DEFAULT if value is None else value == "1"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_90_or_later(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or later (the interpreter never launches): where
    griddepcontrol and TMA copies exist (also asked by ``triton_attention.choose_kv_desc``)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= MIN_CAPABILITY


def pdl_supported(device: torch.device) -> bool:
    """Where a dependent launch can be asked for: ``sm_90_or_later``."""
    return sm_90_or_later(device)


# --8<-- [start:launch_options]
def launch_keywords(on: bool) -> dict[str, bool]:
    """The ``USE_PDL`` constexpr, and Triton's ``launch_pdl`` option when it is on."""
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keywords a launcher passes its kernel on ``device`` (``launch_keywords``)."""
    return launch_keywords(pdl_from_env() and pdl_supported(device))


@triton.jit
def wait_for_the_kernel_ahead(USE_PDL: tl.constexpr):
    """A participating kernel's first statement (NOTE 1): wait until the kernel ahead has
    finished and its writes are visible, then let the kernel after start (NOTE 2)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
# --8<-- [end:launch_options]
