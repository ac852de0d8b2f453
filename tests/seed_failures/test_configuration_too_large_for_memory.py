"""Seed failure: the smoke test ([32, 192, 192], global batch 8) ran the TPU
workers out of memory; it surfaced as ``BrokenProcessPool`` and was fixed by
shrinking the config by trial.

``octfw check`` estimates the per-device memory of a training step
(parameters, EMA, gradients, AdamW state, activations
measured on meta tensors) and warns, before the run, when it exceeds the
device's memory. ``OCTFW_DEVICE_MEMORY_GIB`` stands for a device smaller than
this machine."""

from seedkit import cli, write_tiny


def test_check_warns_when_the_estimate_exceeds_the_device_memory(tmp_path, monkeypatch, capsys):
    recipe = write_tiny(tmp_path)
    monkeypatch.setenv("OCTFW_DEVICE_MEMORY_GIB", "0.005")  # ~5 MiB: below the tiny model's ~20 MiB
    code, out, _ = cli(capsys, "check", recipe)
    assert code == 0  # a warning, not a refusal: estimates are estimates
    warning = next(line for line in out.splitlines() if line.startswith("warning: estimated memory"))
    assert "exceeds" in warning and "OCTFW_DEVICE_MEMORY_GIB" in warning
    assert "engine.per_device_batch" in warning
    assert out.index(warning) < out.index("check passed")


def test_check_reports_the_estimate_without_warning_when_it_fits(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("OCTFW_DEVICE_MEMORY_GIB", raising=False)
    recipe = write_tiny(tmp_path)
    code, out, _ = cli(capsys, "check", recipe)
    assert code == 0
    line = next(line for line in out.splitlines() if line.startswith("memory"))
    for part in ("parameters", "ema", "gradients", "optimizer", "activations", "available RAM"):
        assert part in line
    assert "warning: estimated memory" not in out
