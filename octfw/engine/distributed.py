"""Scale-out on existing engines.

- GPUs and CPUs: torch.distributed data parallel (DDP) under ``torchrun``;
  the process group comes from the usual environment (RANK, WORLD_SIZE,
  MASTER_ADDR), gloo on the CPU, NCCL on CUDA.
- TPUs: XLA SPMD in one process per host, driving all of that host's
  devices; multi-host through PJRT (every host runs the same ``octfw run``).

Only rank 0 logs, writes files and talks to W&B; every rank takes the same
skip decision.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["init_process_group", "is_ddp", "broadcast_object", "all_reduce_", "min_across_ranks"]


def init_process_group(kind: str) -> tuple[int, int]:
    """Join the torchrun process group when WORLD_SIZE > 1; returns (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or kind == "xla":
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def is_ddp() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (e.g. the run directory it created)."""
    if not is_ddp():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_(*tensors: torch.Tensor) -> None:
    """Sum in place across DDP ranks (no-op in a single process)."""
    if is_ddp():
        import torch.distributed as dist

        for t in tensors:
            dist.all_reduce(t)


def min_across_ranks(verdict: torch.Tensor) -> torch.Tensor:
    """A boolean verdict that is True only if it is True on every rank."""
    if not is_ddp():
        return verdict
    import torch.distributed as dist

    value = verdict.float()
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return value > 0
