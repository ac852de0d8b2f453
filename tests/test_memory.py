"""The per-device memory estimate that ``octfw check`` reports (octfw.diagnostics.memory)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from octfw.diagnostics.device_memory import device_memory, device_memory_bytes
from octfw.diagnostics.memory import (
    BLOCK_TEMPORARIES,
    GIB,
    MemoryEstimate,
    batch_advice,
    estimate_memory,
    xla_attention_line,
    largest_batch,
    memory_report,
)
from octfw.types import BuildContext


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)

    def forward(self, batch):
        return self.b(torch.relu(self.a(batch["x"]))).square().mean()


def real_saved_bytes(model, batch) -> int:
    """What autograd really keeps for backward on the CPU (parameters and the batch,
    counted in parts of their own, excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {t.untyped_storage().data_ptr() for t in batch.values()}
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


def test_sharded_over_n_devices_a_device_holds_a_nth_of_the_state_plus_the_largest_block_gathered():
    """engine.parallelism = "fsdp": parameters, EMA, gradients and AdamW's moments split N ways;
    the largest transformer block whole twice (computing, and the next gathered ahead) plus its
    gradient; activations and the batch as replicated (each device trains its own samples)."""
    from octfw.models.vit3d import Block

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block(64, 4, 4.0) for _ in range(4))

        def forward(self, batch):
            x = batch["x"]
            for block in self.blocks:
                x = block(x)
            return x.square().mean()

    model, batch = Blocks(), {"x": torch.randn(2, 16, 64)}
    replicated, sharded = (estimate_memory(model, batch, shards=n).parts for n in (1, 4))
    for part in ("parameters", "gradients", "optimizer"):
        assert sharded[part] == replicated[part] // 4
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert sharded["gathered"] == block * (2 * 4 + 4) and replicated["gathered"] == 0
    assert sharded["activations"] == replicated["activations"] and sharded["batch"] == replicated["batch"]


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


def test_seeds_multi_domain_config_fits_a_tpu_v4_at_batch_1_but_not_at_16(monkeypatch):
    """The seeds' [64, 384, 384] volumes, 9,216 patches, the 29M model: per-device batch 1
    (what they ran on v4) fits in 32 GiB; 16 per device does not (8 did not either with
    XLA's own attention, before octfw's query-blocked attention)."""
    monkeypatch.delenv("OCTFW_DEVICE_MEMORY_GIB", raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v4-32")
    hbm, desc = device_memory("xla")
    assert hbm == 32 * GIB and desc == "TPU v4 HBM per device"
    model = seeds_model()
    one = estimate_memory(model, meta_batch(1), device="xla")
    sixteen = estimate_memory(model, meta_batch(16), device="xla")
    assert memory_report(one, hbm, desc)[1] is None
    line, warning = memory_report(sixteen, hbm, desc)
    assert warning and "exceeds 32 GiB (TPU v4 HBM per device)" in warning and "activations" in warning
    # Activations grow with the batch (all but a fixed-size metric); the model's own state does not.
    assert sixteen.parts["activations"] == pytest.approx(16 * one.parts["activations"], rel=0.05)
    assert sixteen.parts["optimizer"] == one.parts["optimizer"]


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


# --- activation checkpointing, the largest batch, and the estimate against a measured peak ---


def test_seeds_config_with_checkpointing_fits_many_more_samples_on_a_tpu_v4():
    """At 9,216 patches every transformer block keeps about a dozen [B, N, E] tensors;
    checkpointing keeps its input only, and recomputes one block at a time."""
    model = seeds_model()
    plain = largest_batch(model, meta_batch(1), 32 * GIB, device="xla")
    checkpointed = largest_batch(model, meta_batch(1), 32 * GIB, device="xla", checkpointing=True)
    assert plain >= 8 and checkpointed >= 2 * plain
    # The answer is the boundary: it fits, one more sample does not.
    for size, checkpointing in ((plain, False), (checkpointed, True)):
        assert estimate_memory(model, meta_batch(size), device="xla", checkpointing=checkpointing).total <= 32 * GIB
        assert estimate_memory(model, meta_batch(size + 1), device="xla",
                               checkpointing=checkpointing).total > 32 * GIB


def test_fused_and_blocked_attention_keep_no_n_by_n_matrix():
    """cpu and cuda run a fused kernel (flash / memory-efficient) that keeps a
    log-sum-exp per row; so does xla's query-blocked attention, plus one block's
    temporaries in its backward. XLA's own attention would keep the probabilities:
    at 9,216 patches most of the activations."""
    model = seeds_model()
    fused = estimate_memory(model, meta_batch(1), device="cuda").parts["activations"]
    blocked = estimate_memory(model, meta_batch(1), device="xla").parts["activations"]
    math = estimate_memory(model, meta_batch(1), device="xla", attention="math").parts["activations"]
    # One block of 512 queries' float32 scores over 9,216 keys, 6 heads (the encoder's), 6 times.
    assert blocked - fused == BLOCK_TEMPORARIES * 6 * 512 * 9216 * 4
    assert math > 5 * blocked
    # The predictor's attention probabilities alone: 5 heads x 9,216^2 fp32 per block.
    assert math - fused > 6 * 5 * 9216**2 * 4


def test_largest_batch_is_zero_when_one_sample_does_not_fit():
    assert largest_batch(seeds_model(), meta_batch(1), GIB // 2, device="xla") == 0


def test_batch_advice_names_the_batch_with_and_without_checkpointing():
    line = batch_advice(seeds_model(), meta_batch(1), 32 * GIB, "xla")
    assert re.fullmatch(r"fits {6}per-device batch up to \d+; \d+ with model.activation_checkpointing = true "
                        r"\(estimated for xla fp32, 85% of the device: 27.2 GiB\)", line), line


@pytest.mark.parametrize("text, size", [("32GiB", 32 * GIB), ("16 GB", 16 * 10**9), ("80g", 80 * 10**9),
                                         ("1.5TiB", int(1.5 * 1024**4)), ("512MiB", 512 * 1024**2)])
def test_parse_bytes(text, size):
    assert device_memory_bytes(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "32 parsecs", "-1GB", "0GiB"])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="is not a memory size"):
        device_memory_bytes(text)


def test_check_sizes_a_run_for_a_stated_device(tiny_recipe, capsys):
    from octfw.cli.main import main

    assert main(["check", str(tiny_recipe), "--device-kind", "xla", "--device-memory", "32GiB"]) == 0
    out = capsys.readouterr().out
    assert "of 32 GiB --device-memory" in out
    assert re.search(r"per-device batch up to \d+; \d+ with model.activation_checkpointing = true "
                     r"\(estimated for xla bf16, 85% of the device: 27.2 GiB\)", out), out
    assert "with XLA's own attention: activations" in out  # what its N x N probabilities would take, beside
    assert main(["check", str(tiny_recipe), "--device-memory", "lots"]) == 2
    assert "--device-memory 'lots' is not a memory size" in capsys.readouterr().err


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "accelerators"))
from memory_estimate import CONFIGS, measure_in_fresh_process  # noqa: E402


@pytest.fixture(scope="module")
def measured_steps() -> dict:
    """The engine's real update step on the CPU, each configuration in a fresh
    process (benchmarks/accelerators/memory_estimate.py: tiny and small at two sizes), two at
    a time: each measures its own process's peak."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CONFIGS, pool.map(lambda config: measure_in_fresh_process(*config), CONFIGS)))


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-{c[1]}-b{c[2]}-{'ckpt' if c[3] else 'plain'}")
def test_estimate_is_within_20_percent_of_the_measured_peak_of_an_update_step(measured_steps, config):
    step = measured_steps[config]
    assert 0.8 <= step["estimate"] / step["measured"] <= 1.2, step


@pytest.mark.slow
def test_checkpointing_lowers_the_measured_peak(measured_steps):
    plain = measured_steps[("tiny", "64,192,192", 2, False)]
    checkpointed = measured_steps[("tiny", "64,192,192", 2, True)]
    assert checkpointed["measured"] < 0.6 * plain["measured"], (plain, checkpointed)


def test_under_bf16_autocast_activations_are_counted_as_autograd_saves_them():
    """bf16 autocast saves matmul inputs (and the weights' bf16 copies) in 2 bytes: the estimate
    runs the forward on fake CPU tensors under the CPU's autocast and counts what it saves."""
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build

    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                       image_size=(16, 64, 64), patch_size=(4, 16, 16), mask_pairs={"": (6, 10)})
    model = build(VJEPA3DConfig(preset="tiny", patch_size=(4, 16, 16)), ctx)
    generator = torch.Generator().manual_seed(0)
    batch = {"context": torch.rand(2, 1, 16, 64, 64, generator=generator),
             "target": torch.rand(2, 1, 16, 64, 64, generator=generator),
             "context_idx": torch.stack([torch.randperm(64, generator=generator)[:6] for _ in range(2)]),
             "target_idx": torch.stack([torch.randperm(64, generator=generator)[:10] for _ in range(2)])}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = real_saved_bytes(model, batch)
    estimated = estimate_memory(model, batch, precision="bf16").parts["activations"]
    assert estimated == pytest.approx(real, rel=0.01)
    assert estimate_memory(model, batch).parts["activations"] != estimated  # fp32 counts other bytes


def test_seeds_config_under_bf16_keeps_about_half_the_activations_and_blocks_drop_the_n_by_n():
    model = seeds_model()
    fp32 = estimate_memory(model, meta_batch(1), device="cuda").parts["activations"]
    bf16 = estimate_memory(model, meta_batch(1), device="cuda", precision="bf16").parts["activations"]
    assert 0.45 < bf16 / fp32 < 0.6
    # xla: blocked attention keeps what a fused kernel keeps, plus one block's float32 temporaries;
    # XLA's own attention would keep the probabilities.
    xla = estimate_memory(model, meta_batch(1), device="xla", precision="bf16")
    own = estimate_memory(model, meta_batch(1), device="xla", precision="bf16", attention="math")
    assert xla.parts["activations"] == bf16 + BLOCK_TEMPORARIES * 6 * 512 * 9216 * 4
    assert own.parts["activations"] - bf16 > 6 * 5 * 9216**2 * 2
    line = xla_attention_line(model, meta_batch(1), xla, "bf16")
    assert line.startswith("          with XLA's own attention: activations") and "512 queries at a time" in line
