"""The vjepa3d model: shapes, masking semantics, EMA, optimizer groups, sizes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from octfw.display.errors import UserError
from octfw.plugins.models.vjepa3d import PRESETS, VJEPA3DConfig, build
from octfw.models.health import embedding_std
from octfw.plugins.models.vjepa3d.model import masked_feature_loss
from octfw.registry import load_registry
from octfw.types import BuildContext, ModelOutput

TINY_IMAGE = (4, 32, 32)
TINY_PATCH = (2, 16, 16)  # 2 x 2 x 2 = 8 patches


def make_ctx(image_size=TINY_IMAGE, in_channels=1, patch_size=None) -> BuildContext:
    return BuildContext(
        recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
        image_size=image_size, patch_size=patch_size, in_channels=in_channels,
    )


def make_model(image_size=TINY_IMAGE, patch_size=TINY_PATCH, in_channels=1, **fields):
    fields.setdefault("preset", "tiny")
    config = VJEPA3DConfig(patch_size=patch_size, **fields)
    return build(config, make_ctx(image_size, in_channels))


def make_batch(model, batch_size=2, num_target=None, in_channels=1, seed=0):
    """Random views and a random fixed-count mask per sample (masked = target)."""
    gen = torch.Generator().manual_seed(seed)
    n = model.num_patches
    num_target = n // 2 if num_target is None else num_target
    perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(batch_size)])
    shape = (batch_size, in_channels, *model.context_encoder.image_size)
    return {
        "context": torch.randn(shape, generator=gen),
        "target": torch.randn(shape, generator=gen),
        "context_idx": perm[:, num_target:].contiguous(),
        "target_idx": perm[:, :num_target].contiguous(),
    }


def patch_slices(model, index: int) -> tuple[slice, slice, slice]:
    """Voxel slices of patch ``index`` (row-major over the patch grid)."""
    gd, gh, gw = model.grid_size
    pd, ph, pw = model.context_encoder.patch_size
    d, rest = divmod(index, gh * gw)
    h, w = divmod(rest, gw)
    return slice(d * pd, (d + 1) * pd), slice(h * ph, (h + 1) * ph), slice(w * pw, (w + 1) * pw)


# --- registration and config ---------------------------------------------------


def test_plugin_modules_import_without_torch():
    code = (
        "import sys, octfw.plugins.models.vjepa3d;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_vjepa3d_is_registered_with_its_config():
    registry = load_registry(builtins=["octfw.plugins.models.vjepa3d"], entry_points=[])
    component = registry.get("model", "vjepa3d")
    assert component.config is VJEPA3DConfig
    model = component.build(VJEPA3DConfig(preset="tiny", patch_size=TINY_PATCH), make_ctx())
    assert model.num_patches == 8


def test_explicit_fields_override_the_preset():
    arch = VJEPA3DConfig(preset="tiny", embed_dim=48, predictor_depth=3).architecture()
    assert arch.embed_dim == 48 and arch.predictor_depth == 3
    assert arch.depth == PRESETS["tiny"]["depth"]
    model = make_model(embed_dim=48, predictor_depth=3)
    assert model.context_encoder.embed_dim == 48
    assert len(model.predictor.blocks) == 3


def test_config_refuses_widths_the_heads_cannot_split():
    with pytest.raises(ValueError, match="embed_dim = 100 is not divisible by num_heads = 3"):
        VJEPA3DConfig(preset="tiny", embed_dim=100)
    with pytest.raises(ValueError, match="nmse"):
        VJEPA3DConfig(loss="cosine")
    with pytest.raises(ValueError, match="3 values"):
        VJEPA3DConfig(patch_size=(4, 16))


def test_factory_needs_an_image_size():
    with pytest.raises(UserError, match=r"patch_size = \[4, 16, 16\]"):
        build(VJEPA3DConfig(preset="tiny"), make_ctx(image_size=None))


def test_factory_refuses_an_image_size_not_divisible_by_the_patch():
    with pytest.raises(UserError) as info:
        build(VJEPA3DConfig(preset="tiny"), make_ctx(image_size=(16, 128, 120)))
    assert "[16, 128, 120]" in str(info.value) and "[4, 16, 16]" in str(info.value)


def test_small_preset_has_the_seeds_parameter_count():
    # 64 x 384 x 384 is the seeds' multi-domain input; counting needs no forward.
    model = build(VJEPA3DConfig(preset="small"), make_ctx(image_size=(64, 384, 384)))
    counts = model.count_parameters()
    assert abs(counts["trainable"] - 29.4e6) / 29.4e6 < 0.05, counts
    encoder = sum(p.numel() for p in model.context_encoder.parameters())
    assert counts["ema"] == encoder


# --- forward -------------------------------------------------------------------


@pytest.mark.parametrize(
    "image_size, patch_size, in_channels",
    [((4, 32, 32), (2, 16, 16), 1), ((6, 16, 24), (3, 8, 8), 1), ((8, 16, 16), (4, 4, 8), 2)],
)
def test_output_shapes(image_size, patch_size, in_channels):
    model = make_model(image_size, patch_size, in_channels)
    grid = tuple(s // p for s, p in zip(image_size, patch_size))
    assert model.grid_size == grid
    n = grid[0] * grid[1] * grid[2]
    batch = make_batch(model, batch_size=3, num_target=n // 3, in_channels=in_channels)
    out = model(batch)
    assert isinstance(out, ModelOutput)
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    assert out.per_sample_loss.shape == (3,)
    assert set(out.metrics) >= {"target_std", "pred_std"}
    assert all(v.shape == () for v in out.metrics.values())
    embed_dim = model.context_encoder.embed_dim
    predicted = model.predict(batch["context"], batch["context_idx"], batch["target_idx"])
    assert predicted.shape == (3, n // 3, embed_dim)
    assert model.embed(batch["target"]).shape == (3, n, embed_dim)
    assert model.encoder is model.target_encoder


def test_patch_tokens_are_in_row_major_grid_order():
    model = make_model((4, 16, 24), (2, 8, 8))  # grid 2 x 2 x 3
    embed = model.context_encoder.patch_embed
    volume = torch.zeros(1, 1, 4, 16, 24)
    base = embed(volume)
    index = 1 * 6 + 0 * 3 + 2  # d=1, h=0, w=2
    volume[(0, 0, *patch_slices(model, index))] = 1.0
    changed = (embed(volume) != base).any(dim=-1)[0]
    assert changed.nonzero().flatten().tolist() == [index]


def test_same_seed_gives_the_same_loss():
    losses = []
    for _ in range(2):
        torch.manual_seed(123)
        model = make_model()
        losses.append(model(make_batch(model)).loss)
    assert torch.equal(losses[0], losses[1])
    torch.manual_seed(124)
    model = make_model()
    assert not torch.equal(losses[0], model(make_batch(model)).loss)


def test_activation_checkpointing_gives_the_same_loss_and_gradients_and_keeps_less():
    """Recomputing each block in backward changes memory, not numbers (bitwise on the CPU)."""
    from octfw.diagnostics.memory import activation_bytes

    runs = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = make_model(image_size=(8, 64, 64), activation_checkpointing=checkpointing)
        batch = make_batch(model)
        loss = model(batch).loss
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
        runs[checkpointing] = (loss.detach(), grads, activation_bytes(model, batch))
    (loss_off, grads_off, kept_off), (loss_on, grads_on, kept_on) = runs[False], runs[True]
    assert torch.equal(loss_off, loss_on)
    assert grads_off.keys() == grads_on.keys()
    assert all(torch.equal(grads_off[name], grads_on[name]) for name in grads_off)
    assert kept_on < kept_off / 2
    checkpointed = [m.checkpoint_activations for m in model.modules() if hasattr(m, "checkpoint_activations")]
    # Context encoder and predictor blocks; the target encoder runs under no_grad.
    assert checkpointed.count(True) == PRESETS["tiny"]["depth"] + PRESETS["tiny"]["predictor_depth"]


def test_context_voxels_of_masked_patches_do_not_change_the_loss():
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(model)
    before = model(batch).loss
    changed = dict(batch, context=batch["context"].clone())
    for sample in range(2):
        for index in batch["target_idx"][sample].tolist():
            changed["context"][(sample, slice(None), *patch_slices(model, index))] += 5.0
    assert torch.equal(model(changed).loss, before)
    # The visible patches, by contrast, do matter.
    visible = batch["context_idx"][0, 0].item()
    changed["context"][(0, slice(None), *patch_slices(model, visible))] += 5.0
    assert not torch.equal(model(changed).loss, before)


def test_loss_depends_only_on_target_features_at_masked_positions():
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(model)
    before = model(batch).loss
    positions = {"idx": batch["context_idx"]}

    def overwrite(module, inputs, output):
        index = positions["idx"].unsqueeze(-1).expand(-1, -1, output.shape[-1])
        return output.scatter(1, index, torch.full_like(output, 1e3))

    handle = model.target_encoder.register_forward_hook(overwrite)
    try:
        assert torch.equal(model(batch).loss, before)  # unmasked positions: ignored
        positions["idx"] = batch["target_idx"][:, :1]
        assert not torch.equal(model(batch).loss, before)  # a masked position: used
    finally:
        handle.remove()


def test_no_gradient_reaches_the_target_encoder():
    torch.manual_seed(0)
    model = make_model()
    model(make_batch(model)).loss.backward()
    assert all(not p.requires_grad and p.grad is None for p in model.target_encoder.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable)


def test_loss_is_float32_under_bf16_autocast():
    torch.manual_seed(0)
    model = make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(make_batch(model))
    assert out.loss.dtype == torch.float32 and out.per_sample_loss.dtype == torch.float32
    assert torch.isfinite(out.loss)


def test_loss_config_selects_the_loss():
    torch.manual_seed(0)
    losses = {}
    for kind in ("l1", "mse", "nmse"):
        torch.manual_seed(0)
        model = make_model(loss=kind)
        losses[kind] = model(make_batch(model)).loss
    assert len({v.item() for v in losses.values()}) == 3


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_forward_and_ema_update_never_sync_with_the_host():
    torch.manual_seed(0)
    model = make_model()
    batch = make_batch(model)
    with RecordOps() as recorder:
        out = model(batch)
        out.loss.backward()
        model.ema_update(torch.tensor(0.99))
    # .item(), float(t) and `if t:` all go through _local_scalar_dense;
    # boolean-mask indexing goes through nonzero / masked_select.
    forbidden = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.item"}
    assert not recorder.ops & forbidden, recorder.ops & forbidden


# --- losses and metrics --------------------------------------------------------


def test_each_loss_is_zero_for_a_perfect_prediction():
    target = torch.randn(2, 5, 16)
    assert masked_feature_loss(target, target, "mse").abs().max() == 0
    layer_normed = F.layer_norm(target, (16,))
    assert masked_feature_loss(layer_normed, target, "l1").abs().max() < 1e-6
    # nmse ignores the scale of the prediction
    assert masked_feature_loss(3.0 * target, target, "nmse").abs().max() < 1e-6


def test_nmse_of_orthogonal_vectors_is_two_over_width():
    eye = torch.eye(8)
    predicted, target = eye[None, :4], eye[None, 4:]
    assert torch.allclose(masked_feature_loss(predicted, target, "nmse"), torch.tensor([2 / 8]))


def test_embedding_std_is_zero_for_collapsed_embeddings():
    collapsed = torch.randn(1, 1, 16).expand(3, 10, 16)
    assert embedding_std(collapsed) < 1e-6
    assert embedding_std(torch.randn(3, 10, 16)) > 0.1


# --- EMA and optimizer groups --------------------------------------------------


def _perturbed_model():
    torch.manual_seed(0)
    model = make_model()
    with torch.no_grad():
        for p in model.context_encoder.parameters():
            p.add_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("momentum", [1.0, torch.tensor(1.0)])
def test_ema_update_with_momentum_one_leaves_the_ema_bitwise_unchanged(momentum):
    model = _perturbed_model()
    before = [p.clone() for p in model.target_encoder.parameters()]
    model.ema_update(momentum)
    assert all(torch.equal(a, b) for a, b in zip(before, model.target_encoder.parameters()))


@pytest.mark.parametrize("momentum", [0.0, torch.tensor(0.0)])
def test_ema_update_with_momentum_zero_copies_the_online_encoder(momentum):
    model = _perturbed_model()
    model.ema_update(momentum)
    pairs = zip(model.target_encoder.parameters(), model.context_encoder.parameters())
    assert all(torch.equal(ema, online) for ema, online in pairs)


@pytest.mark.parametrize("momentum", [0.5, torch.tensor(0.5)])
def test_ema_update_with_momentum_half_goes_halfway(momentum):
    model = _perturbed_model()
    before = [p.clone() for p in model.target_encoder.parameters()]
    model.ema_update(momentum)
    for old, new, online in zip(before, model.target_encoder.parameters(),
                                model.context_encoder.parameters()):
        assert torch.allclose(new, 0.5 * (old + online), atol=1e-6)


def test_param_groups_split_decay_and_no_decay():
    model = make_model()
    decay, no_decay = model.param_groups(0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert decay["params"] and all(p.ndim >= 2 for p in decay["params"])
    assert no_decay["params"] and all(p.ndim < 2 for p in no_decay["params"])
    grouped = {id(p) for p in decay["params"]} | {id(p) for p in no_decay["params"]}
    assert len(grouped) == len(decay["params"]) + len(no_decay["params"])  # disjoint
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert grouped == trainable
    assert not grouped & {id(p) for p in model.target_encoder.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "predictor.mask_token" in no_decay_names
    assert "context_encoder.norm.weight" in no_decay_names
    assert "context_encoder.blocks.0.attn.qkv.bias" in no_decay_names
    torch.optim.AdamW(model.param_groups(0.05), lr=1e-4)  # accepted as is


# --- LayerNorm (written out on XLA) -------------------------------------------------


@pytest.mark.parametrize("shape, normalized", [((2, 7, 48), (48,)), ((3, 4, 5, 6), (5, 6))])
def test_written_out_layer_norm_matches_the_fused_kernel(shape, normalized):
    """What octfw's LayerNorm computes on XLA, run here on the CPU: output and
    every gradient as F.layer_norm's, with and without the affine part."""
    from octfw.models.vit3d import written_out_layer_norm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen) * 4.0 + 2.0
    weight = torch.rand(normalized, generator=gen) + 0.5
    bias = torch.randn(normalized, generator=gen)
    upstream = torch.randn(*shape, generator=gen)
    for affine in (True, False):
        results = []
        for norm in (F.layer_norm, written_out_layer_norm):
            inputs = [t.clone().requires_grad_() for t in ((x, weight, bias) if affine else (x,))]
            out = norm(inputs[0], normalized, *inputs[1:], eps=1e-6)
            out.backward(upstream)
            results.append([out, *(t.grad for t in inputs)])
        for mine, fused in zip(results[1], results[0]):
            torch.testing.assert_close(mine, fused, rtol=1e-5, atol=1e-5)


def test_written_out_layer_norm_computes_in_float32():
    from octfw.models.vit3d import written_out_layer_norm

    x = torch.randn(4, 64) * 3.0 + 100.0  # a large mean: cancellation in bf16 would show
    expected = F.layer_norm(x, (64,))
    out = written_out_layer_norm(x.bfloat16(), (64,))
    assert out.dtype == torch.bfloat16  # as F.layer_norm returns without weights
    # Only the input's and the result's bf16 rounding (within one bf16 step of the
    # fused kernel on the rounded input), not bf16 arithmetic: a mean of 100 held
    # in bf16 is off by up to 0.25, a twelfth of the std.
    reference = F.layer_norm(x.bfloat16().float(), (64,))
    torch.testing.assert_close(out.float(), reference, rtol=2 ** -8, atol=2 ** -8)
    assert (out.float() - expected).abs().max() < 0.2


def test_model_layer_norms_keep_nn_layer_norm_state_dicts():
    """Checkpoints written with nn.LayerNorm load into the model and back."""
    from torch import nn

    from octfw.models.vit3d import LayerNorm

    model = make_model()
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(type(m) is LayerNorm for m in norms)
    plain = nn.LayerNorm(32)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1.0, 1.0)
    norm = LayerNorm(32)
    norm.load_state_dict(plain.state_dict())
    assert list(norm.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 32)
    assert torch.equal(norm(x), plain(x))  # the fused kernel off XLA
    keys = model.state_dict().keys()
    assert "predictor.norm.weight" in keys and "context_encoder.norm.bias" in keys


def test_effective_rank_compiles_without_a_graph_break():
    """A graph break inside the forward made torch.compile recompile on every
    update step (engine.compile = true); fullgraph refuses any break."""
    from octfw.models.health import effective_rank

    torch._dynamo.reset()
    features = torch.randn(2, 40, 16)
    compiled = torch.compile(effective_rank, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(features), effective_rank(features))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(features).dtype == torch.float32


def test_the_preset_sizes_octfw_list_shows_are_the_models_parameter_counts():
    from octfw.plugins.models.vjepa3d.config import PRESET_PARAMETERS, PRESETS
    from octfw.plugins.models.vjepa3d.model import VJEPA3D

    for name, sizes in PRESETS.items():
        with torch.device("meta"):  # shapes only: 'giant' is a billion parameters
            model = VJEPA3D(image_size=(16, 64, 64), patch_size=(4, 16, 16), in_channels=1, **sizes)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        encoder = sum(p.numel() for p in model.encoder.parameters())
        assert (trainable, encoder) == PRESET_PARAMETERS[name], name


# --- V-JEPA's mask configurations, end to end ------------------------------------------------

MULTIBLOCK = ('transform.mask={generator="multiblock3d"}', "transform.image_size=[16, 64, 64]")


def test_each_mask_configuration_is_a_pair_the_run_reads_and_logs(write_recipe, tmp_path):
    """multiblock3d makes V-JEPA's short- and long-range pairs; the model reads both (its inputs
    follow the recipe's mask) and the run logs each pair's context and target counts."""
    import json

    from conftest import TINY_RECIPE
    from octfw.cli.main import main

    path = write_recipe(TINY_RECIPE)
    sets = [arg for value in (*MULTIBLOCK, f"run.output_dir={tmp_path / 'runs'}") for arg in ("--set", value)]
    assert main(["run", str(path), *sets]) == 0
    run_dir = next((tmp_path / "runs" / "recipe").iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = next(row for row in rows if "metric/mask/short/context_tokens" in row)
    short = (logged["metric/mask/short/context_tokens"], logged["metric/mask/short/target_tokens"])
    long = (logged["metric/mask/long/context_tokens"], logged["metric/mask/long/target_tokens"])
    assert sum(short) == sum(long) == 64 and short[0] > long[0] >= 7  # 4 x 4 x 4 patches


def test_the_model_averages_the_pairs_losses():
    from octfw.types import mask_keys

    torch.manual_seed(0)
    model = make_model()
    first, second = make_batch(model, seed=1), make_batch(model, seed=2)
    both = dict(first)
    for pair, batch in (("short", first), ("long", second)):
        context_key, target_key = mask_keys(pair)
        both[context_key], both[target_key] = batch["context_idx"], batch["target_idx"]
    single = [model(dict(first, context_idx=b["context_idx"], target_idx=b["target_idx"])).per_sample_loss
              for b in (first, second)]
    paired = VJEPA3D_with_pairs(model, ("short", "long"))(both)
    assert torch.allclose(paired.per_sample_loss, (single[0] + single[1]) / 2, atol=1e-6)
    assert set(VJEPA3D_with_pairs(model, ("short", "long")).inputs) == {
        "context", "target", "context_idx_short", "target_idx_short", "context_idx_long", "target_idx_long"}


def VJEPA3D_with_pairs(model, pairs):
    """``model``'s weights in a VJEPA3D that reads the mask configurations ``pairs``."""
    from octfw.types import mask_keys

    paired = build(VJEPA3DConfig(preset="tiny", patch_size=model.context_encoder.patch_size),
                   BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                                image_size=model.context_encoder.image_size,
                                patch_size=model.context_encoder.patch_size, mask_pairs=pairs))
    paired.load_state_dict(model.state_dict())
    assert paired.inputs[2:] == tuple(key for pair in pairs for key in mask_keys(pair))
    return paired


def test_octfw_check_refuses_a_mask_that_leaves_under_a_tenth_as_context(write_recipe, tmp_path, capsys):
    from conftest import TINY_RECIPE
    from octfw.cli.main import main

    path = write_recipe(TINY_RECIPE)
    code = main(["check", str(path), "--set", "transform.mask={generator=\"random\", ratio=0.95}",
                 "--set", "transform.image_size=[16, 64, 64]"])
    err = capsys.readouterr().err
    assert code == 2
    assert "leaves 3 of 64 patches as context (5%), fewer than 10%" in err and "Traceback" not in err


# --- V-JEPA 2.1's dense loss ---------------------------------------------------------------


def test_context_weights_fall_with_the_distance_to_the_mask():
    from octfw.plugins.models.vjepa3d.model import context_weights

    grid = (1, 1, 8)  # one row of 8 patches: the target is patch 0
    weights = context_weights(torch.arange(1, 8)[None], torch.tensor([[0]]), grid)
    assert torch.allclose(weights[0], torch.arange(1, 8).float().rsqrt())
    # Chunked over the batch: the same answer as one sample at a time.
    context, target = torch.tensor([[1, 2, 3], [0, 5, 6]]), torch.tensor([[0, 7], [7, 4]])
    both = context_weights(context, target, grid)
    each = torch.cat([context_weights(context[i:i + 1], target[i:i + 1], grid) for i in range(2)])
    assert torch.equal(both, each)


def test_the_dense_loss_predicts_several_depths_and_the_context_too():
    from octfw.plugins.models.vjepa3d.model import context_weights, masked_feature_loss, token_errors
    from octfw.models.vit3d import layer_norm

    torch.manual_seed(0)
    model = make_model(dense_levels=2, context_loss_weight=0.5)
    assert model.level_depths == (2, 4) and model.predictor.embed_out.out_features == 2 * 96
    batch = make_batch(model)
    out = model(batch)
    levels = model.target_encoder.levels(batch["target"], depths=(2, 4))
    assert torch.allclose(levels[-1], model.target_encoder(batch["target"]))  # the last is the output
    targets = torch.cat([layer_norm(level, level.shape[-1:]) for level in levels], dim=-1)
    visible = model.context_encoder(batch["context"], keep_idx=batch["context_idx"])
    predicted, on_context = model.predictor(visible, batch["context_idx"], batch["target_idx"], with_context=True)
    from octfw.models.vit3d import gather_tokens

    masked = masked_feature_loss(predicted, gather_tokens(targets, batch["target_idx"]), "l1")
    context = (token_errors(on_context, gather_tokens(targets, batch["context_idx"]), "l1")
               * context_weights(batch["context_idx"], batch["target_idx"], model.grid_size)).mean(dim=1)
    assert torch.allclose(out.per_sample_loss, masked + 0.5 * context, atol=1e-6)
    out.loss.backward()  # both losses reach the context encoder
    assert model.context_encoder.patch_embed.proj.weight.grad.abs().sum() > 0


def test_dense_levels_beyond_the_depth_are_refused():
    with pytest.raises(UserError, match="dense_levels = 5 exceeds the encoder's depth"):
        make_model(dense_levels=5)


# --- inputs and tokens that carry content --------------------------------------------------


def test_the_encoder_standardises_each_volume_on_its_visible_patches_only():
    from octfw.models.vit3d import ViT3DEncoder, standardise_volume, volume_statistics

    torch.manual_seed(0)
    volume = torch.rand(2, 1, 8, 32, 32) * 0.3 + 0.2
    whole = standardise_volume(volume, (4, 16, 16))
    assert torch.allclose(whole.mean(dim=(1, 2, 3, 4)), torch.zeros(2), atol=1e-5)
    assert torch.allclose(whole.std(dim=(1, 2, 3, 4), correction=0), torch.ones(2), atol=1e-4)
    assert torch.equal(standardise_volume(torch.zeros(1, 1, 8, 32, 32), (4, 16, 16)), torch.zeros(1, 1, 8, 32, 32))
    # Statistics of the kept patches only: brightening a dropped patch changes nothing.
    keep = torch.tensor([[0, 1, 2], [3, 4, 5]])
    brighter = volume.clone()
    brighter[:, :, 4:8, 16:32, 16:32] += 10.0  # patch 7 of the 2 x 2 x 2 grid
    enc = ViT3DEncoder((8, 32, 32), (4, 16, 16), 1, 96, 1, 3, 4.0, standardise_input=True)
    assert torch.equal(enc(volume, keep_idx=keep), enc(brighter, keep_idx=keep))
    assert enc.architecture()["standardise_input"] is True
    # Folded into the patch projection: the tokens of the standardised volume, without its copy.
    folded = enc.patch_embed(volume, volume_statistics(volume, (4, 16, 16), keep))
    explicit = enc.patch_embed(standardise_volume(volume, (4, 16, 16), keep))
    assert torch.allclose(folded, explicit, atol=1e-4)


def test_the_patch_projection_is_initialised_like_a_linear_layer():
    from octfw.models.vit3d import ViT3DEncoder

    torch.manual_seed(0)
    enc = ViT3DEncoder((8, 32, 32), (4, 16, 16), 1, 96, 1, 3, 4.0)
    weight = enc.patch_embed.proj.weight.reshape(96, -1)
    bound = (6.0 / (weight.shape[0] + weight.shape[1])) ** 0.5  # xavier-uniform
    assert weight.abs().max() <= bound and weight.std() > 0.8 * bound / 3 ** 0.5
    # Standardised input through it: the content of a token now outweighs its position.
    tokens = enc.patch_embed(torch.randn(4, 1, 8, 32, 32))
    assert tokens.norm(dim=-1).mean() > enc.pos_embed.norm(dim=-1).mean()


def test_an_encoder_exported_before_standardisation_loads_without_it():
    from octfw.exports.pretrained import encoder_from_config

    old = {"image_size": [8, 32, 32], "patch_size": [4, 16, 16], "in_channels": 1, "embed_dim": 96, "depth": 1,
           "num_heads": 3, "mlp_ratio": 4.0}
    assert encoder_from_config(old).standardise_input is False  # as it was trained
    assert encoder_from_config({**old, "standardise_input": True}).standardise_input is True


def test_octfw_check_checks_every_mask_configurations_indices(write_recipe, tmp_path, capsys):
    from conftest import TINY_RECIPE
    from octfw.cli.main import main

    path = write_recipe(TINY_RECIPE)
    assert main(["check", str(path), *[a for v in MULTIBLOCK for a in ("--set", v)]]) == 0
    out = capsys.readouterr().out
    assert "context_idx_short" in out and "target_idx_long" in out
