"""Scale-out on existing engines.

- GPUs and CPUs: torch.distributed data parallel (DDP) under ``torchrun``;
  the process group comes from the usual environment (RANK, WORLD_SIZE,
  MASTER_ADDR), gloo on the CPU, NCCL on CUDA.
- TPUs: XLA SPMD in one process per host, driving all of that host's
  devices; multi-host through PJRT (every host runs the same ``octfw run``).
  Each host loads only its own part of every global batch
  (:class:`BatchLayout`); docs/tpu-pods.md says how to launch and resume.

Only rank 0 logs, writes files and talks to W&B; every rank takes the same
skip decision.
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import torch

from octfw.tables import counted

__all__ = ["BatchLayout", "init_process_group", "is_ddp", "broadcast_object", "all_reduce_",
           "min_across_ranks"]


@attrs.frozen
class BatchLayout:
    """How one update step's global batch splits over processes, devices and micro-steps.

    A *process* loads data: one per TPU host under SPMD (driving all of that
    host's devices), one per device under torchrun. Every process loads the
    same number of samples per micro-step, so the global batch is
    ``per_device_batch x devices x grad_accum_steps`` whatever the split.
    """

    per_device_batch: int
    grad_accum_steps: int
    processes: int = 1
    devices_per_process: int = 1

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process

    @property
    def process_micro_batch(self) -> int:
        """Samples one process loads per micro-step (its data loader's batch size)."""
        return self.per_device_batch * self.devices_per_process

    @property
    def global_micro_batch(self) -> int:
        """Samples of one micro-step over all devices: one forward/backward."""
        return self.process_micro_batch * self.processes

    @property
    def global_batch(self) -> int:
        """Samples of one update step over all devices and micro-steps."""
        return self.global_micro_batch * self.grad_accum_steps

    @property
    def process_batch(self) -> int:
        """Samples one process loads per update step (its share of the global batch)."""
        return self.process_micro_batch * self.grad_accum_steps

    def describe(self) -> str:
        """One line, e.g. for a TPU v4-32: ``global batch 32 = per_device_batch 1 x 16
        devices x grad_accum_steps 2; 4 processes x 4 devices: each process loads 4
        samples per micro-step, 8 per update step``."""
        split = ("1 process loads" if self.processes == 1 else
                 f"{self.processes} processes x {counted(self.devices_per_process, 'device')}: "
                 "each process loads")
        return (f"global batch {self.global_batch} = per_device_batch {self.per_device_batch} x "
                f"{counted(self.devices, 'device')} x grad_accum_steps {self.grad_accum_steps}; {split} "
                f"{counted(self.process_micro_batch, 'sample')} per micro-step, "
                f"{self.process_batch} per update step")


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
