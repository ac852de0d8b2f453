"""The metrics of a log step, derived from host values and timings only.

No device and no torch here: the engine reads the device once per log step
(:meth:`octfw.engine.backend.Backend.read`) and hands the host values to
:func:`log_metrics`, so the arithmetic is testable on its own.

Throughput counts every device of the run (all processes); a process's own
share only positions its data loader.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["UNKNOWN_PEAK", "log_metrics", "mfu"]

#: The run summary's MFU when the model's FLOPs are known but the device's peak is not.
UNKNOWN_PEAK = "unknown peak"


def mfu(flops_per_sample: int | None, samples_per_s: float, peak_flops: float | None,
        device_count: int) -> float | str | None:
    """Model FLOPs utilisation: model FLOP/s reached over the peak of all devices.

    None when the model's FLOPs per sample are unknown (not counted yet, or
    counted as 0); :data:`UNKNOWN_PEAK` when the device's peak is unknown.
    """
    if not flops_per_sample:
        return None
    if not peak_flops:
        return UNKNOWN_PEAK
    return flops_per_sample * samples_per_s / (peak_flops * device_count)


def log_metrics(
    host: Mapping[str, Any],
    *,
    interval_s: float,
    updates: int,
    samples_per_update: int,
    device_count: int,
    data_wait_s: float,
    epoch: float,
    lr: float,
    ema_momentum: float | None,
    domains: Sequence[str],
    flops_per_sample: int | None,
    peak_flops: float | None,
) -> dict[str, float]:
    """The metrics handed to loggers and guards at one log step.

    ``host`` holds the values read from the device: ``loss`` (mean over the
    updates applied since the last log step), ``applied`` (how many),
    ``grad_norm``, ``skipped_updates`` (whole run), ``domain_loss`` and
    ``domain_count`` (one entry per name in ``domains``) and the model's
    ``metric/*`` values. ``interval_s`` is the wall time since the last log
    step, ``updates`` the update steps in it, ``samples_per_update`` the
    samples one update consumes on all ``device_count`` devices, and
    ``data_wait_s`` the host time spent waiting on the data loader in it.
    """
    interval_s = max(interval_s, 1e-9)
    samples_per_s = updates * samples_per_update / interval_s
    metrics = {
        # Every update since the last log step skipped: there is no loss to show.
        "loss": host["loss"] if host["applied"] > 0 else float("nan"),
        "lr": lr,
        "grad_norm": host["grad_norm"],
        "skipped_updates": host["skipped_updates"],
        "updates_since_log": float(updates),
        "samples_per_s": samples_per_s,
        "samples_per_s_per_device": samples_per_s / device_count,
        "step_time_s": interval_s / updates,
        "data_wait_share": min(data_wait_s / interval_s, 1.0),
        "epoch": epoch,
        **{k: v for k, v in host.items() if k.startswith("metric/")},
        # A domain with no sample since the last log step has no loss to show.
        **{f"loss/{d}": host["domain_loss"][i] for i, d in enumerate(domains)
           if host["domain_count"][i] > 0},
    }
    utilisation = mfu(flops_per_sample, samples_per_s, peak_flops, device_count)
    if isinstance(utilisation, float):  # left out while the FLOPs or the peak are unknown
        metrics["mfu"] = utilisation
    if ema_momentum is not None:
        metrics["ema_momentum"] = ema_momentum
    return metrics
