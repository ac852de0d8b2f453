"""The mae3d model: patch order, the masked pixel loss, gradients, training, XLA, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import octfw
from octfw.plugins.models.mae3d import MAE3DConfig, build
from octfw.plugins.models.mae3d.model import NORM_PIX_EPS, masked_pixel_loss, patchify
from octfw.models.vit3d import PatchEmbed3D, ViT3DEncoder
from octfw.registry import load_registry
from octfw.types import BuildContext, ModelOutput

from conftest import TINY_RECIPE

ROOT = Path(__file__).resolve().parents[1]
TINY_IMAGE = (4, 32, 32)
TINY_PATCH = (2, 16, 16)  # 2 x 2 x 2 = 8 patches


def make_ctx(image_size=TINY_IMAGE, in_channels=1) -> BuildContext:
    return BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                        image_size=image_size, in_channels=in_channels)


def make_model(image_size=TINY_IMAGE, patch_size=TINY_PATCH, in_channels=1, **fields):
    fields.setdefault("preset", "tiny")
    return build(MAE3DConfig(patch_size=patch_size, **fields), make_ctx(image_size, in_channels))


def make_batch(model, batch_size=2, num_target=None, in_channels=1, seed=0):
    """Random views and a random fixed-count mask per sample (masked = target)."""
    gen = torch.Generator().manual_seed(seed)
    n = model.num_patches
    num_target = n // 2 if num_target is None else num_target
    perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(batch_size)])
    shape = (batch_size, in_channels, *model.encoder.image_size)
    return {
        "context": torch.randn(shape, generator=gen),
        "target": torch.randn(shape, generator=gen),
        "context_idx": perm[:, num_target:].contiguous(),
        "target_idx": perm[:, :num_target].contiguous(),
    }


def numbered_patches(image_size, patch_size, in_channels=1) -> torch.Tensor:
    """``[1, C, D, H, W]`` whose patch k (row-major over the grid) holds the value k."""
    grid = [s // p for s, p in zip(image_size, patch_size)]
    numbers = torch.arange(grid[0] * grid[1] * grid[2], dtype=torch.float32).reshape(grid)
    for axis, patch in enumerate(patch_size):
        numbers = numbers.repeat_interleave(patch, dim=axis)
    return numbers.expand(1, in_channels, *image_size).clone()


def patch_marks(batch, idx_key, num_patches=8):
    """``[B, N]`` bool: True at the patches ``batch[idx_key]`` lists."""
    marks = torch.zeros(batch[idx_key].shape[0], num_patches, dtype=torch.bool)
    return marks.scatter_(1, batch[idx_key], True)


# --- registration and config ---------------------------------------------------


def test_plugin_modules_import_without_torch():
    code = "import sys, octfw.plugins.models.mae3d; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_mae3d_is_registered_with_its_config():
    registry = load_registry(builtins=["octfw.plugins.models.mae3d"], entry_points=[])
    component = registry.get("model", "mae3d")
    assert component.config is MAE3DConfig
    model = component.build(MAE3DConfig(preset="tiny", patch_size=TINY_PATCH), make_ctx())
    assert model.num_patches == 8 and isinstance(model.encoder, ViT3DEncoder)


def test_presets_share_vjepa3d_encoders_and_fields_override_them():
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig

    for preset in ("tiny", "small", "base", "large", "giant"):
        mae, vjepa = MAE3DConfig(preset=preset).architecture(), VJEPA3DConfig(preset=preset).architecture()
        assert (mae.embed_dim, mae.depth, mae.num_heads, mae.mlp_ratio) == (
            vjepa.embed_dim, vjepa.depth, vjepa.num_heads, vjepa.mlp_ratio)
    arch = MAE3DConfig(preset="tiny", decoder_depth=3, decoder_embed_dim=32).architecture()
    assert (arch.decoder_depth, arch.decoder_embed_dim, arch.decoder_num_heads) == (3, 32, 2)
    with pytest.raises(ValueError, match="decoder_embed_dim = 30 is not divisible by decoder_num_heads = 4"):
        MAE3DConfig(preset="tiny", decoder_embed_dim=30, decoder_num_heads=4)


def test_the_preset_sizes_octfw_list_shows_are_the_models_parameter_counts():
    from octfw.plugins.models.mae3d.config import PRESET_PARAMETERS, PRESETS
    from octfw.plugins.models.mae3d.model import MAE3D

    for name, sizes in PRESETS.items():
        with torch.device("meta"):  # shapes only: 'giant' is a billion parameters
            model = MAE3D(image_size=(16, 64, 64), patch_size=(4, 16, 16), in_channels=1, **sizes)
        encoder = sum(p.numel() for p in model.encoder.parameters())
        assert (model.count_parameters()["trainable"], encoder) == PRESET_PARAMETERS[name], name
        assert model.count_parameters()["ema"] == 0


# --- patches and the loss --------------------------------------------------------


@pytest.mark.parametrize("image_size, patch_size, in_channels",
                         [((4, 32, 32), (2, 16, 16), 1), ((6, 16, 24), (3, 8, 8), 1), ((8, 16, 16), (4, 4, 8), 2)])
def test_patchify_follows_the_patch_embedding_order(image_size, patch_size, in_channels):
    volume = numbered_patches(image_size, patch_size, in_channels)
    patches = patchify(volume, patch_size)
    n = patches.shape[1]
    assert patches.shape == (1, n, patch_size[0] * patch_size[1] * patch_size[2] * in_channels)
    assert torch.equal(patches[0], torch.arange(n, dtype=torch.float32)[:, None].expand_as(patches[0]))
    # The patch embedding's token k sums patch k (weights one, no bias): the same order.
    embed = PatchEmbed3D(patch_size, in_channels, 1)
    torch.nn.init.ones_(embed.proj.weight)
    torch.nn.init.zeros_(embed.proj.bias)
    with torch.no_grad():
        assert torch.allclose(embed(volume)[0, :, 0], patches[0].sum(dim=-1))


def test_patchify_keeps_each_patch_s_voxels_channel_last():
    volume = torch.randn(2, 2, 4, 8, 8)
    patches = patchify(volume, (2, 4, 4))  # grid 2 x 2 x 2
    d, h, w = 1, 0, 1
    k = d * 4 + h * 2 + w
    expected = volume[1, :, 2:4, 0:4, 4:8].permute(1, 2, 3, 0).reshape(-1)
    assert torch.equal(patches[1, k], expected)


def test_loss_is_zero_for_a_perfect_reconstruction():
    model = make_model()
    batch = make_batch(model)
    target = model.target_patches(batch["target"], batch["target_idx"])
    normalised = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + NORM_PIX_EPS).sqrt()
    assert torch.allclose(masked_pixel_loss(normalised, target, True), torch.zeros(2), atol=1e-10)
    assert torch.equal(masked_pixel_loss(target, target, False), torch.zeros(2))
    # Through the model: a decoder that returns the truth gives a zero loss.
    model.decoder.forward = lambda tokens, context_idx, target_idx: normalised
    with torch.no_grad():
        out = model(batch)
    assert isinstance(out, ModelOutput) and float(out.loss) < 1e-10


def test_norm_pix_loss_ignores_each_patch_s_brightness_and_contrast():
    target = torch.randn(2, 3, 64)
    predicted = torch.randn(2, 3, 64)
    rescaled = target * 3.0 + torch.randn(2, 3, 1)  # per-patch contrast and brightness
    on = masked_pixel_loss(predicted, target, True)
    assert torch.allclose(masked_pixel_loss(predicted, rescaled, True), on, atol=1e-5)
    off = masked_pixel_loss(predicted, target, False)
    assert not torch.allclose(masked_pixel_loss(predicted, rescaled, False), off)
    assert torch.allclose(off, (predicted - target).square().mean(dim=(1, 2)))
    assert not torch.allclose(on, off)


def test_norm_pix_loss_config_selects_the_target():
    batch = make_batch(make_model())
    losses = {}
    for norm in (True, False):
        torch.manual_seed(0)
        model = make_model(norm_pix_loss=norm)
        batch_scaled = dict(batch, target=batch["target"] * 10.0)
        with torch.no_grad():
            losses[norm] = (float(model(batch).loss), float(model(batch_scaled).loss))
    assert losses[True][0] == pytest.approx(losses[True][1], rel=1e-4)  # normalised: scale-free
    assert losses[False][1] > 10 * losses[False][0]


def test_loss_ignores_visible_patches_of_the_target_and_masked_patches_of_the_context():
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(model)
    base = model(batch)
    for key, idx_key in (("target", "context_idx"), ("context", "target_idx")):
        changed = dict(batch)
        noise = patchify(torch.randn_like(batch[key]), TINY_PATCH)
        marks = patch_marks(batch, idx_key)
        # Noise in the marked patches only, put back into the volume's layout.
        edited = patchify(batch[key].clone(), TINY_PATCH)
        edited[marks] = noise[marks]
        gd, gh, gw = model.grid_size
        pd, ph, pw = TINY_PATCH
        volume = edited.reshape(2, gd, gh, gw, pd, ph, pw, 1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        changed[key] = volume.reshape(batch[key].shape)
        assert not torch.equal(changed[key], batch[key])
        assert torch.equal(model(changed).per_sample_loss, base.per_sample_loss), key


def test_gradients_reach_encoder_and_decoder_but_not_visible_target_voxels():
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(model)
    batch["context"].requires_grad_(True)
    batch["target"].requires_grad_(True)
    model(batch).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    target_grad = patchify(batch["target"].grad, TINY_PATCH)
    context_grad = patchify(batch["context"].grad, TINY_PATCH)
    visible = patch_marks(batch, "context_idx")
    assert target_grad[visible].abs().max() == 0 and target_grad[~visible].abs().max() > 0
    assert context_grad[~visible].abs().max() == 0 and context_grad[visible].abs().max() > 0


def test_outputs_metrics_and_embeddings():
    model = make_model(in_channels=2)
    batch = make_batch(model, batch_size=3, num_target=3, in_channels=2)
    out = model(batch)
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    assert out.per_sample_loss.shape == (3,) and out.per_sample_loss.dtype == torch.float32
    assert set(out.metrics) == {"target_std", "pred_std", "effective_rank", "effective_rank_max",
                                "position_share", "mask/context_tokens", "mask/target_tokens"}
    assert float(out.metrics["mask/target_tokens"]) == 3.0
    assert 0.0 <= float(out.metrics["position_share"]) <= 1.0
    assert out.health_gram.shape[0] == out.health_gram.shape[1] <= model.encoder.embed_dim  # min(K, E)
    assert all(v.shape == () and torch.isfinite(v) for v in out.metrics.values())
    visible, predicted = model.reconstruct(batch["context"], batch["context_idx"], batch["target_idx"])
    assert predicted.shape == (3, 3, 2 * 16 * 16 * 2)
    assert visible.shape == (3, 5, model.encoder.embed_dim)
    tokens = model.embed(batch["target"])
    assert tokens.shape == (3, 8, model.encoder.embed_dim) and not tokens.requires_grad
    assert not hasattr(model, "ema_update")


def test_loss_is_float32_under_bf16_autocast():
    model = make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(make_batch(model))
    assert out.loss.dtype == torch.float32 and out.per_sample_loss.dtype == torch.float32


def test_param_groups_leave_biases_norms_and_the_mask_token_undecayed():
    model = make_model()
    decay, no_decay = model.param_groups(0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert any(p is model.decoder.mask_token for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_a_few_steps_on_a_fixed_batch_lower_the_loss():
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(model)
    optimizer = torch.optim.AdamW(model.param_groups(0.0), lr=1e-3)
    losses = []
    for _ in range(30):
        out = model(batch)
        losses.append(float(out.loss.detach()))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.7 * losses[0], losses


# --- the engine, export and XLA ---------------------------------------------------


MAE_RECIPE = TINY_RECIPE.replace('name = "vjepa3d"', 'name = "mae3d"').replace(
    'image_size = [8, 32, 32]', 'image_size = [8, 32, 32]\nmask = { generator = "random", ratio = 0.75 }')


def test_engine_trains_checkpoints_and_exports_the_encoder(write_recipe, tmp_path):
    recipe = octfw.load_recipe(write_recipe(MAE_RECIPE, "mae.toml"),
                               ["run.max_steps=3", "engine.checkpoint_every_steps=2"])
    result = octfw.train(recipe)
    assert result.summary["update_steps"] == 3 and result.summary["stopped"] is None
    assert result.checkpoint is not None and Path(result.checkpoint).name == "step_00000003.pt"
    assert (result.run_dir / "encoder").is_dir()
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("metric/effective_rank" in row and "metric/target_std" in row for row in rows)

    # The exported encoder computes what the checkpoint's model.encoder computes.
    state = torch.load(result.checkpoint, map_location="cpu", weights_only=False)
    model = build(MAE3DConfig(preset="tiny", patch_size=(4, 16, 16)), make_ctx((8, 32, 32)))
    model.load_state_dict(state["model"])
    volume = torch.randn(2, 1, 8, 32, 32)
    expected = model.embed(volume)
    for encoder in (octfw.load_encoder(octfw.export(result.run_dir, tmp_path / "encoder.pt")),
                    octfw.load_encoder(result.run_dir / "encoder")):
        with torch.no_grad():
            assert torch.allclose(encoder(volume), expected, atol=1e-6)


XLA_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    from octfw.engine.optim import GatedAdamW
    from octfw.plugins.models.mae3d import MAE3DConfig, build
    from octfw.types import BuildContext

    STEPS, BATCH, IMAGE, PATCH = 5, 2, (8, 32, 32), (4, 8, 8)

    def compilations():
        data = met.metric_data("CompileTime")
        return data[0] if data else 0

    def random_batch(n_target):
        n = model.num_patches
        perm = torch.stack([torch.randperm(n) for _ in range(BATCH)])
        batch = {"context": torch.randn(BATCH, 1, *IMAGE), "target": torch.randn(BATCH, 1, *IMAGE),
                 "context_idx": perm[:, n_target:].contiguous(), "target_idx": perm[:, :n_target].contiguous()}
        return {k: v.to(device) for k, v in batch.items()}

    torch.manual_seed(0)
    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0, image_size=IMAGE)
    device = torch_xla.device()
    model = build(MAE3DConfig(preset="tiny", patch_size=PATCH), ctx).to(device)
    optimizer = GatedAdamW(model.param_groups(0.05), lr=1e-3, betas=(0.9, 0.95))
    n_target = int(0.75 * model.num_patches)
    per_step = []
    for step in range(STEPS):
        out = model(random_batch(n_target))
        out.loss.backward()
        optimizer.step(torch.isfinite(out.loss))
        optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
        per_step.append(compilations())
    metrics = {k: float(v.cpu()) for k, v in out.metrics.items()}
    print(json.dumps({"per_step": per_step, "counters": met.counter_names(),
                      "loss": float(out.loss.detach().cpu()), "metrics": metrics}))
""")


def test_training_step_on_xla_compiles_once_and_never_syncs(tmp_path):
    pytest.importorskip("torch_xla")  # imported in the subprocess only: it patches torch process-wide
    script = tmp_path / "step.py"
    script.write_text(XLA_SCRIPT, encoding="utf-8")
    env = {**os.environ, "PJRT_DEVICE": "CPU",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    per_step = run["per_step"]
    assert 1 <= per_step[1] <= 2 and per_step[-1] == per_step[1], per_step
    assert not [c for c in run["counters"] if c.startswith("aten::")], run["counters"]
    values = [run["loss"], *run["metrics"].values()]
    assert all(v == v and abs(v) < float("inf") for v in values), run
    assert set(run["metrics"]) == {"target_std", "pred_std", "effective_rank", "effective_rank_max",
                                   "position_share", "mask/context_tokens", "mask/target_tokens"}
