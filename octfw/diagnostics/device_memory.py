"""How much memory a device offers, and how far a process's resident size grew.

Device memory: the CPU's available RAM (``MemAvailable``), a CUDA device's
total memory, a TPU chip's HBM by generation (from ``TPU_ACCELERATOR_TYPE``,
set on TPU VMs). ``OCTFW_DEVICE_MEMORY_GIB`` or ``octfw check
--device-memory`` overrides it, to size a run for another machine
(:mod:`octfw.diagnostics.memory` estimates what a run needs of it).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from octfw.recipe import fields

__all__ = ["TPU_HBM_GIB", "device_memory", "device_memory_bytes", "peak_rss_growth"]

GIB = 1024**3

#: HBM per torch_xla device (a chip from v4 on, a core on v2 and v3), GiB.
TPU_HBM_GIB: dict[str, float] = {
    "v2": 8.0, "v3": 16.0, "v4": 32.0, "v5litepod": 16.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0,
}


def device_memory_bytes(text: str) -> int:
    """A device's memory: ``"32GiB"``, ``"16 GB"``, ``"80g"``, ``"1.5TiB"`` -> bytes, more than 0
    (:func:`octfw.recipe.fields.parse_bytes`, which also reads 0); ValueError otherwise."""
    try:
        size = fields.parse_bytes(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"{text!r} is not a memory size; write it like 32GiB, 16GB or 80G")
    return size


def _proc_status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def peak_rss_growth(function: Callable[[], Any]) -> int:
    """How far above its resident size at the call the process's peak resident
    size went while ``function()`` ran, in bytes (Linux: /proc/self).

    Measures CPU tensors the way the kernel sees them. Start the process with
    ``MALLOC_MMAP_THRESHOLD_`` fixed (e.g. 65536): glibc then serves every
    large tensor with its own mapping and unmaps it when freed, instead of
    keeping freed memory resident under a threshold it raises as it goes.
    """
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets VmHWM (the peak) to the current resident size
    before = _proc_status("VmRSS")
    function()
    return _proc_status("VmHWM") - before


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
