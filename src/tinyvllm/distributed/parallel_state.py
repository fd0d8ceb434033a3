"""Parallel state: this process's place in the tensor-parallel group, and the group's collectives.

Concept: every worker process of a tensor-parallel engine joins one ``torch.distributed``
process group (gloo on the CPU, NCCL on CUDA, NOTE 1) when it starts
(``init_distributed_environment``). Layers never see the group: they ask this module for the
world size and their rank, and call ``tensor_model_parallel_all_reduce`` /
``tensor_model_parallel_all_gather``, which do nothing in a one-rank process. The state is
per process (a module global, as vLLM's ``_TP``), so a process holds at most one engine
with more than one rank.

Mirrors: ``vllm/distributed/parallel_state.py`` (``init_distributed_environment``,
``initialize_model_parallel``, ``get_tp_group``, ``GroupCoordinator``) and
``vllm/distributed/communication_op.py`` (``tensor_model_parallel_all_reduce``,
``tensor_model_parallel_all_gather``).

Invariants: before ``init_distributed_environment`` (and after
``destroy_distributed_environment``) the group is the one-rank group: world size 1, rank 0,
collectives return their input; ``0 <= rank < world_size``.

NOTE 1 (the backend): NCCL wants one device per rank and is capturable in a CUDA graph;
gloo runs on the CPU (and, through host copies, on CUDA tensors: two ranks may share one
GPU for a correctness test, without CUDA graphs). ``default_backend`` picks by device;
``TINYVLLM_DISTRIBUTED_BACKEND`` overrides it.
NOTE 2 (a finite timeout): a rank waiting in a collective for a rank that died waits
``GROUP_TIMEOUT_S`` at most (gloo's default is 30 minutes), then raises. The multiprocess
executor's monitor ends such a rank much sooner (``multiproc_executor.py`` NOTE 3); the
timeout is the guard when nothing watches, as under ``torchrun``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


# --8<-- [start:group_coordinator]
@dataclass(frozen=True)
class GroupCoordinator:
    """One process group as this rank sees it; the one-rank group has ``group=None``."""

    world_size: int = 1
    rank: int = 0
    backend: str = "none"
    group: object | None = None  # a torch.distributed ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place (``x`` itself with one rank)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order, on every rank."""
        if self.world_size == 1:
            return x
        if self.backend == "gloo" and x.device.type != "cpu":  # NOTE 1: gloo gathers host tensors
            return self.all_gather(x.cpu(), dim).to(x.device)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def collectives_capturable(self, device_type: str) -> bool:
        """Whether a CUDA graph on ``device_type`` may hold this group's collectives: NCCL's
        can be captured, gloo's (host copies) cannot; one rank has none (NOTE 1)."""
        return self.world_size == 1 or device_type != "cuda" or self.backend == "nccl"

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
# --8<-- [end:group_coordinator]


_TP = GroupCoordinator()
GROUP_TIMEOUT_S = 300.0  # NOTE 2


def default_backend(device_type: str) -> str:
    """NCCL on CUDA, gloo elsewhere, unless ``TINYVLLM_DISTRIBUTED_BACKEND`` says (NOTE 1)."""
    forced = os.environ.get("TINYVLLM_DISTRIBUTED_BACKEND")
    if forced:
        return forced
    return "nccl" if device_type == "cuda" else "gloo"


# --8<-- [start:init_distributed_environment]
def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str = "env://", backend: str = "gloo"
) -> None:
    """Join the tensor-parallel group as ``rank`` of ``world_size`` (all ranks must call it)."""
    global _TP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    if world_size == 1:
        _TP = GroupCoordinator()
        return
    if _TP.world_size > 1:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=distributed_init_method, world_size=world_size, rank=rank,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),  # NOTE 2
        )  # fmt: skip
    _TP = GroupCoordinator(world_size, rank, backend, dist.group.WORLD)
# --8<-- [end:init_distributed_environment]


def destroy_distributed_environment() -> None:
    """Leave the group (nothing with one rank); the process is a one-rank process again."""
    global _TP
    if _TP.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP.all_gather(x, dim)
