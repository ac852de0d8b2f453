"""Device backends: CPU and CUDA through torch, TPU (or CPU in tests) through torch_xla.

torch_xla is imported only when the ``xla`` device is chosen: importing it
patches ``torch.nn.utils.clip_grad_norm_`` for the whole process.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import attrs
import torch

from octfw.errors import UserError

__all__ = ["Backend", "select_backend"]


def _tpu_present() -> bool:
    return any(Path("/dev").glob("accel*")) or Path("/dev/vfio").exists()


def resolve_device(requested: str) -> str:
    """``auto`` picks xla on a TPU host (or when PJRT_DEVICE asks for it), then cuda, then cpu."""
    if requested != "auto":
        return requested
    pjrt = os.environ.get("PJRT_DEVICE", "")
    if pjrt and pjrt.upper() != "CPU" or (not pjrt and _tpu_present()):
        return "xla"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


@attrs.define
class Backend:
    """Where tensors live and how the host talks to that device."""

    kind: str  #: "cpu", "cuda" or "xla"
    device: torch.device
    precision: str  #: "fp32" or "bf16"
    rank: int = 0
    world_size: int = 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def device_count(self) -> int:
        return self.world_size

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision != "bf16":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.kind, dtype=torch.bfloat16)

    def device_batches(self, loader: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
        """Batches with their tensors on the device. On xla through the parallel
        loader, which uploads the next batch while the current one runs."""
        if self.kind == "xla":
            import torch_xla.distributed.parallel_loader as pl

            yield from pl.MpDeviceLoader(loader, self.device)
            return
        non_blocking = self.kind == "cuda"
        for batch in loader:
            tensors = {k: v.to(self.device, non_blocking=non_blocking) for k, v in batch["tensors"].items()}
            yield {**batch, "tensors": tensors}

    def step_boundary(self) -> None:
        """End of one update step: cut and launch the XLA graph; nothing elsewhere."""
        if self.kind == "xla":
            import torch_xla

            torch_xla.sync()

    def read(self, values: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Device tensors to host values in one transfer: a float per scalar,
        a list per vector. This is a sync point: the engine calls it on log
        steps only."""
        if not values:
            return {}
        flat = [values[name].detach().float().reshape(-1) for name in values]
        host = torch.cat(flat).cpu().tolist()
        out: dict[str, Any] = {}
        start = 0
        for name, tensor in zip(values, flat):
            n = tensor.numel()
            out[name] = host[start] if values[name].dim() == 0 else host[start:start + n]
            start += n
        return out

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings at log steps)."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.kind == "xla":
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()


def select_backend(requested: str, precision: str) -> Backend:
    kind = resolve_device(requested)
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("run.device = \"cuda\" but torch sees no CUDA device; use \"cpu\" or \"auto\"")
    if kind == "xla":
        try:
            import torch_xla
        except ImportError as exc:
            raise UserError(
                "run.device = \"xla\" needs torch_xla: pip install 'octfw[xla]' "
                f"(torch_xla 2.9.0 with torch 2.9.0); import failed: {exc}"
            ) from None
        device = torch_xla.device()
    elif kind == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if precision == "auto":
        precision = "fp32" if kind == "cpu" else "bf16"
    return Backend(kind=kind, device=device, precision=precision)
