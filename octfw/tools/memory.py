"""Per-device memory of a training step, estimated before the run.

The seeds' smoke test died with ``BrokenProcessPool`` after workers ran out
of memory on a batch and volume size nobody had sized beforehand. ``octfw
check`` calls :func:`estimate_memory` on the model and one per-device batch
and :func:`memory_report` compares the total with the device's memory.

What is counted, in bytes, for one device:

- ``parameters``: trainable parameters (fp32 master weights, also under bf16
  autocast) and ``ema``: the frozen (EMA target encoder) parameters;
- ``buffers``: position embeddings and other buffers;
- ``gradients``: one fp32 gradient per trainable parameter;
- ``optimizer``: AdamW's two moments per trainable parameter;
- ``activations``: the tensors autograd saves for the backward pass of one
  micro-batch, measured by running the forward on ``meta`` tensors (shapes
  only: nothing is computed or allocated) with ``saved_tensors_hooks``.
  They are counted at the dtype the meta forward produces (fp32), an upper
  bound under bf16 autocast;
- ``batch``: the input tensors of one micro-batch.

Allocator fragmentation, compiler workspaces and the transient buffers of
the backward pass and of the optimizer step (a few per parameter in eager
mode, fused away on xla) come on top:
a total near the device's memory is already a risk. A guard's veto costs no
memory: it goes into the update itself (:mod:`octfw.engine.optim`).

Device memory: the CPU's available RAM (``MemAvailable``), a CUDA device's
total memory, a TPU chip's HBM by generation (from ``TPU_ACCELERATOR_TYPE``,
set on TPU VMs). ``OCTFW_DEVICE_MEMORY_GIB`` overrides it, to size a run for
a machine other than the one ``check`` runs on.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import attrs
import torch

__all__ = ["MemoryEstimate", "estimate_memory", "device_memory", "memory_report", "TPU_HBM_GIB"]

GIB = 1024**3

#: HBM per torch_xla device (a chip from v4 on, a core on v2 and v3), GiB.
TPU_HBM_GIB: dict[str, float] = {
    "v2": 8.0, "v3": 16.0, "v4": 32.0, "v5litepod": 16.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0,
}

#: AdamW keeps exp_avg and exp_avg_sq per parameter, at the parameter's dtype.
ADAMW_STATES = 2


@attrs.frozen
class MemoryEstimate:
    """Bytes per part for one device; :attr:`total` is their sum."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {_gib(n)}" for name, n in self.parts.items() if n)


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if n >= 0.1 * GIB else f"{n / 1024**2:.3g} MiB"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)


def activation_bytes(model: torch.nn.Module, batch: Mapping[str, Any]) -> int:
    """Bytes autograd saves for backward in one ``model(batch)``, on meta tensors."""
    state = {name: _meta(p) for name, p in model.named_parameters()}
    state.update({name: _meta(b) for name, b in model.named_buffers()})
    meta_batch = {k: _meta(v) if torch.is_tensor(v) else v for k, v in batch.items()}
    frozen = {id(state[name]) for name in state}  # parameters and buffers are not activations
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t  # a view shares its base's storage
        if id(base) not in frozen:
            seen.setdefault(id(base), base)  # kept alive, so ids are not reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.func.functional_call(model, state, (meta_batch,))
    return sum(_nbytes(t) for t in seen.values())


def estimate_memory(model: torch.nn.Module, batch: Mapping[str, Any]) -> MemoryEstimate:
    """Estimate the per-device bytes of training ``model`` on micro-batches like ``batch``."""
    trainable = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
    frozen = sum(_nbytes(p) for p in model.parameters() if not p.requires_grad)
    parts = {
        "parameters": trainable,
        "ema": frozen,
        "buffers": sum(_nbytes(b) for b in model.buffers()),
        "gradients": trainable,
        "optimizer": ADAMW_STATES * trainable,
        "activations": activation_bytes(model, batch),
        "batch": sum(_nbytes(v) for v in batch.values() if torch.is_tensor(v)),
    }
    return MemoryEstimate(parts)


def _available_ram() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _tpu_hbm() -> tuple[int | None, str]:
    accelerator = os.environ.get("TPU_ACCELERATOR_TYPE", "")
    generation = accelerator.split("-")[0].lower()
    if generation in TPU_HBM_GIB:
        return int(TPU_HBM_GIB[generation] * GIB), f"TPU {generation} HBM per device"
    return None, f"TPU of unknown generation ({accelerator or 'TPU_ACCELERATOR_TYPE unset'})"


def device_memory(kind: str) -> tuple[int | None, str]:
    """(bytes one device of ``kind`` offers or None, what that figure is)."""
    override = os.environ.get("OCTFW_DEVICE_MEMORY_GIB")
    if override:
        return int(float(override) * GIB), "OCTFW_DEVICE_MEMORY_GIB"
    if kind == "cuda":
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), f"{props.name} total memory"
        return None, "CUDA device not visible here"
    if kind == "xla" and os.environ.get("PJRT_DEVICE", "TPU").upper() != "CPU":
        return _tpu_hbm()
    return _available_ram(), "available RAM"


def memory_report(estimate: MemoryEstimate, device_bytes: int | None, device_desc: str) -> tuple[str, str | None]:
    """(the report line, a warning line when the estimate exceeds the device's memory, else None)."""
    line = f"memory    ~{_gib(estimate.total)} per device ({estimate.describe()})"
    if device_bytes is None:
        return line + f"; device memory unknown: {device_desc}", None
    line += f" of {_gib(device_bytes)} {device_desc}"
    if estimate.total <= device_bytes:
        return line, None
    biggest = max(estimate.parts, key=estimate.parts.__getitem__)
    warning = (f"estimated memory per device {_gib(estimate.total)} exceeds {_gib(device_bytes)} "
               f"({device_desc}); the largest part is {biggest} ({_gib(estimate.parts[biggest])}): "
               "lower engine.per_device_batch (and raise engine.grad_accum_steps to keep the global "
               "batch), transform.image_size or model.preset")
    return line, warning
