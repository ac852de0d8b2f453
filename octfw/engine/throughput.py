"""Throughput accounting: samples per second, the share spent waiting on data, and MFU.

:class:`Throughput` keeps a run's host-side figures: the time blocked on
the data loader, the clock between log steps (evaluation left out), the
samples consumed (derived from the update step) and model FLOPs
utilisation, achieved FLOP/s over the device's peak.

Peaks are dense bf16 matmul figures from the vendors' data sheets, per
device as torch sees it. Where the peak is not known (CPUs, unlisted
accelerators) octfw says "unknown peak" rather than inventing one; set
``engine.peak_flops_per_device`` to supply it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch

from octfw.engine.distributed import BatchLayout, step_time
from octfw.engine.metrics import mfu

if TYPE_CHECKING:
    from octfw.recipe.config import EngineConfig
    from octfw.engine.backend import Backend

__all__ = ["SLOW_UPDATE_S", "Throughput", "device_peak_flops", "flops_per_sample", "published_peak"]

#: An update step estimated to take longer than this is announced (with its time) at the start.
SLOW_UPDATE_S = 60.0

log = logging.getLogger(__name__)

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


class Throughput:
    """One process's throughput accounting for a run (this attempt), all on the host: no sync.

    Samples count every device of the run (``layout.global_batch`` per update step); a
    process's own share (``layout.process_batch``) only positions its data loader."""

    def __init__(self, backend: Backend, layout: BatchLayout, engine: EngineConfig, start_step: int):
        self.backend, self.layout, self.global_batch = backend, layout, engine.global_batch
        self.peak_flops, self.device_name = device_peak_flops(backend.kind, backend.device,
                                                              engine.peak_flops_per_device)
        self.flops_per_sample: int | None = None  # counted once, on meta tensors, at the first log
        self.data_wait_s = 0.0  # host time blocked on the data loader since the last log step
        self.data_wait_total_s = 0.0  # ... and since the run (this attempt) started
        self._batch_shapes: Any = None  # the latest batch, for the FLOP count
        self._micro_started = time.perf_counter()
        self._last_log = (time.perf_counter(), start_step)

    def samples_done(self, done: int) -> int:
        """This process's samples after update step ``done``: its data loader's position, as its
        checkpoints record it. Derived, not counted: the global batch is the run's throughout
        (resume refuses another), so this is exact with any number of hosts."""
        return done * self.layout.process_batch

    def next_batch(self, batches: Iterator[dict[str, Any]]) -> dict[str, Any]:
        """The next batch of ``batches``, the time blocked on it counted as data wait; a
        micro-step starts here."""
        self._micro_started = time.perf_counter()
        batch = next(batches)
        waited = time.perf_counter() - self._micro_started
        self.data_wait_s += waited
        self.data_wait_total_s += waited
        self._batch_shapes = batch["tensors"]
        return batch

    def announce_step_time(self) -> None:
        """After the run's first micro-step: what one update step will take, where it is long or
        the global batch is pinned (a recipe written for more devices than this machine has)."""
        micro_step_s = time.perf_counter() - self._micro_started
        slow = micro_step_s * self.layout.grad_accum_steps > SLOW_UPDATE_S
        if self.backend.is_main_process and (self.global_batch is not None or slow):
            log.warning("%s; the first micro-step includes compilation and warm-up",
                        step_time(self.layout, self.global_batch, micro_step_s))

    def interval(self, done: int, model: torch.nn.Module) -> dict[str, Any]:
        """At log step ``done``: the throughput arguments of
        :func:`~octfw.engine.metrics.log_metrics` since the last log step; a new interval begins."""
        now = time.perf_counter()
        last_time, last_step = self._last_log
        if self.flops_per_sample is None and self._batch_shapes is not None:
            self.flops_per_sample = flops_per_sample(model, self._batch_shapes) or 0
        figures = {"interval_s": now - last_time, "updates": done - last_step,
                   "samples_per_update": self.layout.global_batch, "device_count": self.backend.device_count,
                   "data_wait_s": self.data_wait_s, "flops_per_sample": self.flops_per_sample,
                   "peak_flops": self.peak_flops}
        self.data_wait_s = 0.0
        self._last_log = (now, done)
        return figures

    def leave_out(self, seconds: float) -> None:
        """``seconds`` that were not training (evaluation): out of the interval's clock."""
        last_time, last_step = self._last_log
        self._last_log = (last_time + seconds, last_step)

    def run_figures(self, updates: int, elapsed_s: float) -> dict[str, Any]:
        """The run summary's throughput after ``updates`` update steps in ``elapsed_s``."""
        samples_per_s = updates * self.layout.global_batch / max(elapsed_s, 1e-9)
        return {"samples_per_s": samples_per_s, "elapsed_s": elapsed_s, "device": self.device_name,
                "data_wait_share": round(min(self.data_wait_total_s / elapsed_s, 1.0), 4) if elapsed_s > 0 else None,
                "mfu": mfu(self.flops_per_sample, samples_per_s, self.peak_flops, self.backend.device_count)}
