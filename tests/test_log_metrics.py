"""The metrics of a log step, from host values and timings: no device, no model."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from octfw.engine.metrics import UNKNOWN_PEAK, log_metrics, mfu

DOMAINS = ["heidelberg", "topcon", "zeiss"]


def host(**changes) -> dict:
    """Host values as the engine reads them: two of three domains sampled."""
    return {"loss": 0.5, "applied": 2.0, "grad_norm": 1.25, "skipped_updates": 0.0,
            "domain_loss": [0.4, 0.0, 0.6], "domain_count": [3.0, 0.0, 1.0],
            "metric/target_std": 0.03, **changes}


def metrics(values: dict | None = None, **changes) -> dict[str, float]:
    timings = {"interval_s": 2.0, "updates": 2, "samples_per_update": 8, "device_count": 1,
               "data_wait_s": 0.5, "epoch": 0.25, "lr": 1e-3, "ema_momentum": None,
               "domains": DOMAINS, "flops_per_sample": None, "peak_flops": None, **changes}
    return log_metrics(host() if values is None else values, **timings)


def test_loss_is_nan_when_no_update_was_applied_since_the_last_log():
    assert math.isnan(metrics(host(applied=0.0, loss=0.0))["loss"])
    assert metrics(host(applied=1.0, loss=0.0))["loss"] == 0.0  # a true zero loss stays


def test_a_domain_with_no_sample_since_the_last_log_has_no_loss():
    logged = metrics()
    assert logged["loss/heidelberg"] == 0.4 and logged["loss/zeiss"] == 0.6
    assert "loss/topcon" not in logged


def test_samples_per_s_counts_accumulation_and_every_device():
    # 3 updates of 4 micro-steps x 2 samples on each of 8 devices, in 1.5 s.
    logged = metrics(interval_s=1.5, updates=3, samples_per_update=4 * 2 * 8, device_count=8)
    assert logged["samples_per_s"] == pytest.approx(3 * 64 / 1.5)
    assert logged["samples_per_s_per_device"] == pytest.approx(3 * 64 / 1.5 / 8)
    assert logged["step_time_s"] == pytest.approx(0.5)
    assert logged["updates_since_log"] == 3.0


def test_host_values_and_model_metrics_pass_through():
    logged = metrics(lr=2e-4, epoch=1.5, ema_momentum=0.996)
    assert (logged["grad_norm"], logged["skipped_updates"], logged["metric/target_std"]) == (1.25, 0.0, 0.03)
    assert (logged["lr"], logged["epoch"], logged["ema_momentum"]) == (2e-4, 1.5, 0.996)
    assert "ema_momentum" not in metrics(ema_momentum=None)
    assert "domain_loss" not in logged and "applied" not in logged


def test_data_wait_share_is_clamped_to_one():
    assert metrics(interval_s=2.0, data_wait_s=0.5)["data_wait_share"] == pytest.approx(0.25)
    # Waits measured on the host can exceed a wall interval cut short by evaluation.
    assert metrics(interval_s=2.0, data_wait_s=3.0)["data_wait_share"] == 1.0


def test_a_zero_interval_divides_by_a_tiny_positive_time():
    logged = metrics(interval_s=0.0)
    assert math.isfinite(logged["samples_per_s"]) and logged["samples_per_s"] > 0


def test_mfu_with_a_known_peak_counts_every_device():
    # 1 GFLOP per sample at 300 samples/s on 2 devices of 1 TFLOP/s peak each.
    assert mfu(10**9, 300.0, 1e12, 2) == pytest.approx(0.15)
    logged = metrics(interval_s=1.0, updates=1, samples_per_update=300, device_count=2,
                     flops_per_sample=10**9, peak_flops=1e12)
    assert logged["mfu"] == pytest.approx(0.15)


def test_mfu_with_an_unknown_peak_or_unknown_flops():
    assert mfu(10**9, 300.0, None, 1) == UNKNOWN_PEAK == "unknown peak"  # the run summary shows this
    assert mfu(None, 300.0, 1e12, 1) is None
    assert mfu(0, 300.0, 1e12, 1) is None  # FLOPs counted as 0: unknown
    # The per-log metric is a float or left out, never a string.
    assert "mfu" not in metrics(flops_per_sample=10**9, peak_flops=None)
    assert "mfu" not in metrics(flops_per_sample=None, peak_flops=1e12)


def test_the_metrics_module_imports_without_torch():
    code = "import sys, octfw.engine.metrics; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
