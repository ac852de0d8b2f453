"""Model FLOPs utilisation: achieved FLOP/s over the device's peak.

Peaks are dense bf16 matmul figures from the vendors' data sheets, per
device as torch sees it. Where the peak is not known (CPUs, unlisted
accelerators) octfw says "unknown peak" rather than inventing one; set
``engine.peak_flops_per_device`` to supply it.
"""

from __future__ import annotations

import os

from typing import Any, Mapping

import torch

__all__ = ["device_peak_flops", "flops_per_sample", "published_peak"]

#: (substring of the device name, dense bf16 FLOP/s per device); the first
#: match wins, so a form factor comes before its family. NVIDIA's data sheets
#: give bf16 tensor-core figures "with sparsity"; these are half of those
#: (dense): H100 SXM 1,979 -> 989, H100 PCIe 1,513 -> 756, H100/H200 NVL
#: 1,671 -> 835, L4 242 -> 121, L40S 733 -> 362, L40 362 -> 181, B200
#: 4,500 -> 2,250 TFLOP/s; A100's 312 is dense already. torch names an H100
#: SXM "NVIDIA H100 80GB HBM3" and a GH200 "NVIDIA GH200 ...", whose GPU is an
#: H100 SXM's (989).
KNOWN_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("B200", 2250e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("TPU v6e", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5e", 197e12),
    ("TPU v5 lite", 197e12),
    ("TPU v4", 275e12),
)


def device_name(kind: str, device: torch.device) -> str:
    if kind == "cuda":
        return torch.cuda.get_device_name(device)
    if kind == "xla":
        import torch_xla.core.xla_model as xm

        hw = xm.xla_device_hw(device)
        if hw == "TPU":
            from torch_xla._internal import tpu

            # The slice's accelerator type ("v5litepod-16"): the environment's (as octfw check's
            # memory figure reads it), else the TPU host's metadata.
            try:
                return tpu_name(os.environ.get("TPU_ACCELERATOR_TYPE") or tpu.get_tpu_type())
            except (EnvironmentError, KeyError):
                return f"TPU v{tpu.version()}"
        return hw
    return "CPU"


#: Google Cloud's accelerator type prefixes whose chip has another marketing name.
_TPU_TYPES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e"}


def tpu_name(accelerator_type: str) -> str:
    """The chip's name for an accelerator type ("v5litepod-16" -> "TPU v5e", "v5p-8" -> "TPU v5p"):
    the key :data:`KNOWN_PEAKS` knows it by. torch_xla's ``version()`` gives only the digit (5),
    which both v5e (197 TFLOP/s) and v5p (459) share."""
    prefix = accelerator_type.split("-")[0].lower()
    return f"TPU {_TPU_TYPES.get(prefix, prefix)}"


def device_peak_flops(kind: str, device: torch.device, override: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, device name)."""
    name = device_name(kind, device)
    if override is not None:
        return override, name
    return published_peak(name), name


def published_peak(name: str) -> float | None:
    """Dense bf16 FLOP/s of the device torch calls ``name`` (:data:`KNOWN_PEAKS`), or None."""
    for key, peak in KNOWN_PEAKS:
        if key.lower() in name.lower():
            return peak
    return None


def flops_per_sample(model: torch.nn.Module, batch: Mapping[str, Any]) -> int | None:
    """Training FLOPs per sample, counted on meta tensors (no device work); None if the
    model cannot be traced on meta tensors."""
    from octfw.models.flops import training_flops_per_sample_on_meta

    return training_flops_per_sample_on_meta(model, batch)
