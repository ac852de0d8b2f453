"""The per-device memory estimate that ``octfw check`` reports (octfw.tools.memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from octfw.tools.memory import GIB, MemoryEstimate, device_memory, estimate_memory, memory_report
from octfw.types import BuildContext


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)

    def forward(self, batch):
        return self.b(torch.relu(self.a(batch["x"]))).square().mean()


def real_saved_bytes(model, batch) -> int:
    """What autograd really keeps for backward on the CPU (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    return sum(saved.values())


def test_parameter_gradient_and_adamw_parts_are_exact():
    model, batch = MLP(), {"x": torch.randn(4, 64)}
    trainable = (64 * 256 + 256 + 256 * 8 + 8) * 4
    parts = estimate_memory(model, batch).parts
    assert parts["parameters"] == parts["gradients"] == trainable
    assert parts["optimizer"] == 2 * trainable
    assert parts["ema"] == (8 * 8 + 8) * 4 and parts["batch"] == 4 * 64 * 4


def test_activations_measured_on_meta_equal_what_autograd_saves():
    model, batch = MLP(), {"x": torch.randn(16, 64)}
    assert estimate_memory(model, batch).parts["activations"] == real_saved_bytes(model, batch)


def seeds_model():
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build

    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                       image_size=(64, 384, 384), patch_size=(4, 16, 16))
    return build(VJEPA3DConfig(preset="small", patch_size=(4, 16, 16)), ctx)


def meta_batch(b: int, patches: int = 9216, ratio: float = 0.6) -> dict:
    target = int(ratio * patches)
    volume = torch.empty(b, 1, 64, 384, 384, device="meta")
    return {"context": volume, "target": volume,
            "context_idx": torch.empty(b, patches - target, dtype=torch.long, device="meta"),
            "target_idx": torch.empty(b, target, dtype=torch.long, device="meta")}


def test_seeds_multi_domain_config_fits_a_tpu_v4_at_batch_1_but_not_at_8(monkeypatch):
    """The seeds' [64, 384, 384] volumes, 9,216 patches, the 29M model: per-device batch 1
    (what they ran on v4) fits in 32 GiB; 8 per device does not."""
    monkeypatch.delenv("OCTFW_DEVICE_MEMORY_GIB", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v4-32")
    hbm, desc = device_memory("xla")
    assert hbm == 32 * GIB and desc == "TPU v4 HBM per device"
    model = seeds_model()
    one = estimate_memory(model, meta_batch(1))
    eight = estimate_memory(model, meta_batch(8))
    assert memory_report(one, hbm, desc)[1] is None
    line, warning = memory_report(eight, hbm, desc)
    assert warning and "exceeds 32 GiB (TPU v4 HBM per device)" in warning and "activations" in warning
    # Activations grow with the batch (all but a fixed-size metric); the model's own state does not.
    assert eight.parts["activations"] == pytest.approx(8 * one.parts["activations"], rel=0.05)
    assert eight.parts["optimizer"] == one.parts["optimizer"]


def test_device_memory_sources(monkeypatch):
    monkeypatch.delenv("OCTFW_DEVICE_MEMORY_GIB", raising=False)
    ram, desc = device_memory("cpu")
    assert ram and ram > 0 and desc == "available RAM"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert device_memory("xla")[1] == "available RAM"  # torch_xla on the CPU
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v9x-8")
    size, desc = device_memory("xla")
    assert size is None and "unknown generation" in desc
    monkeypatch.setenv("OCTFW_DEVICE_MEMORY_GIB", "1.5")
    assert device_memory("cuda") == (int(1.5 * GIB), "OCTFW_DEVICE_MEMORY_GIB")


def test_report_without_a_known_device_memory_says_so_and_never_warns():
    estimate = MemoryEstimate({"parameters": 10 * GIB})
    line, warning = memory_report(estimate, None, "TPU of unknown generation (v9x-8)")
    assert warning is None and "device memory unknown" in line
