"""Starting from published weights (``[model] init``): a V-JEPA 2 checkpoint made by the
reference's own modules (tests/fixtures/reference/vjepa2, written by
tools/parity/vjepa2_fixtures.py) loads into octfw's networks, which then compute what the
reference computed; the adaptations to OCT volumes do what they say; a checkpoint that
does not fit, or that would run code, is refused in one line."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from octfw.exports.pretrained import encoder_from_config
from octfw.display.errors import UserError
from octfw.models.published import FORMATS, InitTargets, initialise, register_format
from octfw.models.published.adapt import adapt_channels, inflate_kernel, resample_positions
from octfw.engine.optim import weight_decay_groups
from octfw.models.vit3d import ViT3DEncoder
from octfw.plugins.models.mae3d import MAE3DConfig
from octfw.plugins.models.mae3d import build as build_mae
from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build
from octfw.types import BuildContext, mask_keys

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "reference" / "vjepa2"
CHECKPOINT = FIXTURE / "checkpoint.pt"
META = json.loads((FIXTURE / "meta.json").read_text())
SIZES = META["sizes"]
IMAGE = (SIZES["num_frames"], SIZES["crop_size"], SIZES["crop_size"])
PATCH = (SIZES["tubelet_size"], SIZES["patch_size"], SIZES["patch_size"])
PAIRS = ("short", "long")
#: The fixture's network as a recipe states it: V-JEPA 2's positions and LayerNorm epsilon.
FIELDS = dict(embed_dim=SIZES["embed_dim"], depth=SIZES["depth"], num_heads=SIZES["num_heads"],
              predictor_embed_dim=SIZES["pred_embed_dim"], predictor_depth=SIZES["pred_depth"],
              predictor_num_heads=SIZES["pred_num_heads"], position="rope", norm_eps=1e-6,
              standardise_input=False,  # the reference standardises outside its network
              init_channels="sum")  # ... and its inputs come normalised: nothing to fold


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "tensors.safetensors"))


def ctx(image_size=IMAGE, in_channels=3, recipe_dir=REPO, apply_init=True) -> BuildContext:
    return BuildContext(recipe_dir=recipe_dir, cache_dir=Path("."), run_dir=None, seed=0, image_size=image_size,
                        in_channels=in_channels, mask_pairs=PAIRS, apply_init=apply_init)


def vjepa(init=str(CHECKPOINT), image_size=IMAGE, patch_size=PATCH, in_channels=3, **fields):
    config = VJEPA3DConfig(preset="tiny", patch_size=patch_size, init=init, **{**FIELDS, **fields})
    return build(config, ctx(image_size, in_channels)).eval()


def batch_of(reference: dict[str, torch.Tensor], clip: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    clip = reference["clip"] if clip is None else clip
    batch = {"context": clip, "target": clip}
    for j, pair in enumerate(PAIRS):
        context_key, target_key = mask_keys(pair)
        batch[context_key], batch[target_key] = reference[f"context_idx_{j}"], reference[f"target_idx_{j}"]
    return batch


# --- parity with the reference at its own input (no adaptation) -----------------------------------


def test_the_fixture_names_the_reference_commit_and_stays_small():
    assert META["reference"]["repo"] == "https://github.com/facebookresearch/vjepa2"
    assert len(META["reference"]["commit"]) == 40
    assert sum(p.stat().st_size for p in FIXTURE.iterdir()) < 2_000_000


def test_a_vjepa2_checkpoint_loads_with_nothing_adapted_at_the_references_own_input():
    model = vjepa()
    report = model.init_report
    assert report.format == "vjepa2" and not report.new
    # Only the predictor's mask token changes shape ([1, 1, W] -> [W]); the second clip length's is unused.
    assert list(report.adapted) == ["predictor.mask_token"]
    assert list(report.ignored) == ["predictor.mask_tokens.1"]
    assert len(report.loaded) == len(model.state_dict()) - 1


def test_encoders_give_the_reference_tokens(reference):
    model = vjepa()
    with torch.no_grad():
        target = model.target_encoder(reference["clip"])
        online = model.context_encoder(reference["clip"])
    # The EMA encoder is the checkpoint's target_encoder, the context encoder its encoder.
    assert (target - reference["target_tokens"]).abs().max() < 1e-5
    assert (online - reference["online_tokens"]).abs().max() < 1e-5
    assert (target - reference["online_tokens"]).abs().max() > 0.1


def test_the_context_encoder_on_each_mask_and_the_predictor_match_the_reference(reference):
    model = vjepa()
    with torch.no_grad():
        for j in range(len(PAIRS)):
            context_idx, target_idx = reference[f"context_idx_{j}"], reference[f"target_idx_{j}"]
            visible = model.context_encoder(reference["clip"], keep_idx=context_idx)
            assert (visible - reference[f"context_tokens_{j}"]).abs().max() < 1e-5
            # The reference sorts context and mask tokens by position; attention does not care
            # (the last float bits aside), and RoPE goes by the positions themselves.
            predicted = model.predictor(visible, context_idx, target_idx)
            assert (predicted - reference[f"predicted_{j}"]).abs().max() < 1e-5


def test_both_mask_configurations_take_the_first_mask_token_as_the_references_train_step_does(reference):
    """The reference's PredictorMultiSeqWrapper picks the mask token by clip length
    (``mask_index``: 0 for the one clip length), not by mask configuration: ``predicted_J`` is
    mask_tokens[0]'s for both configurations. ``predicted_J_mask_index_1`` is the predictor with
    its second token: octfw is far from it, and reaches it only with that token in its place, so
    a token per mask configuration fails here."""
    model = vjepa()
    second = torch.load(CHECKPOINT, weights_only=True)["predictor"]["module.backbone.mask_tokens.1"]

    def predictions() -> list[torch.Tensor]:
        with torch.no_grad():
            return [model.predictor(model.context_encoder(reference["clip"], keep_idx=reference[f"context_idx_{j}"]),
                                    reference[f"context_idx_{j}"], reference[f"target_idx_{j}"])
                    for j in range(len(PAIRS))]

    for j, predicted in enumerate(predictions()):
        assert (predicted - reference[f"predicted_{j}"]).abs().max() < 1e-5
        assert (predicted - reference[f"predicted_{j}_mask_index_1"]).abs().max() > 0.5
    with torch.no_grad():
        model.predictor.mask_token.copy_(second.reshape(-1))
    for j, predicted in enumerate(predictions()):
        assert (predicted - reference[f"predicted_{j}_mask_index_1"]).abs().max() < 1e-5


def test_the_loss_is_the_reference_train_loops(reference):
    model = vjepa()
    with torch.no_grad():
        loss = model(batch_of(reference)).loss
    assert abs(loss.item() - reference["loss"].item()) < 1e-5


def test_without_init_predictor_the_predictor_is_left_new():
    model = vjepa(init_predictor=False)
    report = model.init_report
    assert report.ignored == {"predictor": "model.init_predictor = false"}
    assert not any(key.startswith("predictor.") for key in report.loaded)


def test_a_predictor_of_another_size_is_left_new_with_its_reason():
    report = vjepa(predictor_depth=1).init_report
    reasons = {report.new[key] for key in report.new}
    assert all(key.startswith("predictor.") for key in report.new)
    assert reasons == {"the checkpoint's predictor is 32 wide, 2 deep (MLP 128), the recipe's 32 wide, 1 deep (MLP 128)"}


def test_mae3d_takes_the_target_encoder_vjepa_evaluates(reference):
    config = MAE3DConfig(preset="tiny", patch_size=PATCH, init=str(CHECKPOINT), embed_dim=48, depth=2, num_heads=3,
                         decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, position="rope", norm_eps=1e-6,
                         standardise_input=False, init_channels="sum")
    model = build_mae(config, ctx()).eval()
    with torch.no_grad():
        assert (model.encoder(reference["clip"]) - reference["target_tokens"]).abs().max() < 1e-5
    assert model.init_report.ignored["predictor"] == "mae3d has a pixel decoder, no predictor"
    assert sorted(model.init_report.loaded) == sorted(f"encoder.{key}" for key in model.encoder.state_dict())


# --- the adaptations ------------------------------------------------------------------------


def test_rgb_to_one_channel_gives_the_rgb_tokens_of_the_grey_volume_repeated(reference):
    grey_model, rgb_model = vjepa(in_channels=1), vjepa()
    adapted = grey_model.init_report.adapted
    assert adapted["context_encoder.patch_embed.proj.weight"] == "3 input channels summed into 1 (a grey volume as RGB)"
    grey = reference["clip"][:, :1]
    with torch.no_grad():
        tokens = grey_model.target_encoder(grey)
        expected = rgb_model.target_encoder(grey.repeat(1, 3, 1, 1, 1))
    assert (tokens - expected).abs().max() < 1e-5


def test_a_two_frame_tubelet_is_inflated_to_the_recipes_patch_keeping_its_response_to_flat_depth():
    model = vjepa(image_size=(16, 32, 32), patch_size=(4, 16, 16), in_channels=1)
    how = model.init_report.adapted["context_encoder.patch_embed.proj.weight"]
    assert "summed into 1" in how and "kernel [2, 16, 16] resampled to [4, 16, 16]" in how
    state = torch.load(CHECKPOINT, weights_only=True)["encoder"]
    source = state["module.backbone.patch_embed.proj.weight"].sum(dim=1, keepdim=True)
    kernel = model.context_encoder.patch_embed.proj.weight.detach()
    assert kernel.shape == (48, 1, 4, 16, 16)
    # A volume that does not change over depth: the 4-slice kernel answers as the 2-frame one did.
    plane = torch.randn(1, 1, 1, 16, 16)
    expected = F.conv3d(plane.expand(1, 1, 2, 16, 16), source).flatten()
    assert torch.allclose(F.conv3d(plane.expand(1, 1, 4, 16, 16), kernel).flatten(), expected, atol=1e-5)


def test_a_2d_kernel_is_inflated_i3d_style():
    kernel2d = torch.randn(8, 1, 16, 16)
    inflated, how = inflate_kernel(kernel2d, (4, 16, 16))
    assert inflated.shape == (8, 1, 4, 16, 16) and "I3D" in how
    plane = torch.randn(1, 1, 16, 16)
    assert torch.allclose(F.conv3d(plane[:, :, None].expand(1, 1, 4, 16, 16), inflated).flatten(),
                          F.conv2d(plane, kernel2d).flatten(), atol=1e-5)
    assert inflate_kernel(torch.randn(8, 1, 2, 16, 16), (2, 16, 16))[1] is None  # fits: untouched


def test_position_tables_are_resampled_to_the_recipes_grid():
    table = torch.randn(1, 4 * 2 * 2, 48)
    resampled, how = resample_positions(table, (4, 2, 2), (8, 6, 6))
    assert resampled.shape == (1, 8 * 6 * 6, 48) and "[4, 2, 2] resampled to [8, 6, 6]" in how
    constant = torch.ones(1, 16, 48) * 0.3
    assert torch.allclose(resample_positions(constant, (4, 2, 2), (8, 6, 6))[0], torch.full((1, 288, 48), 0.3))
    assert resample_positions(table, (4, 2, 2), (4, 2, 2)) == (table, None)


def test_a_learned_table_in_the_checkpoint_goes_into_a_learned_position_encoder(tmp_path):
    state = torch.load(CHECKPOINT, weights_only=True)
    table = torch.randn(1, 16, 48)
    for group in ("encoder", "target_encoder"):
        state[group]["module.backbone.pos_embed"] = table
    path = tmp_path / "vjepa1_style.pt"
    torch.save(state, path)
    model = vjepa(init=str(path), position="learned")
    assert torch.equal(model.target_encoder.pos_embed.detach(), table)
    assert "target_encoder.pos_embed" in model.init_report.loaded
    # The checkpoint's predictor was trained with RoPE: octfw's, with a table, starts new.
    assert set(model.init_report.new) == {f"predictor.{key}" for key in model.predictor.state_dict()}
    assert set(model.init_report.new.values()) == {"the recipe's predictor uses 'learned' positions, V-JEPA 2's are 'rope'"}


def test_the_rgb_channels_cannot_become_two():
    with pytest.raises(UserError, match="takes 3 input channels and the recipe's data has 2"):
        adapt_channels(torch.randn(4, 3, 2, 16, 16), 2)


# --- refusals ------------------------------------------------------------------------------


def test_a_checkpoint_of_another_width_is_refused_naming_both_sizes():
    with pytest.raises(UserError) as caught:
        build(VJEPA3DConfig(preset="tiny", patch_size=PATCH, init=str(CHECKPOINT), position="rope"), ctx())
    message = str(caught.value)
    assert "\n" not in message
    assert message == ("model.init: the checkpoint's encoder is 48 wide, 2 blocks deep (MLP 192) but [model] vjepa3d "
                       "preset 'tiny' is 96 wide, 4 blocks deep (MLP 384): choose the preset of the checkpoint's size "
                       "(large: ViT-L 1024/24, giant: ViT-g 1408/40) or set the sizes to match")


def test_sin_cos_positions_are_refused_for_rotary_weights():
    with pytest.raises(UserError, match="model.position = 'sincos' but V-JEPA 2 weights are trained with its rotary"):
        vjepa(position="sincos")


class Payload:
    """Unpickling this would run code: it writes a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran.txt"
    path = tmp_path / "evil.pt"
    with path.open("wb") as f:
        pickle.dump({"encoder": Payload(marker)}, f, protocol=2)
    with pytest.raises(UserError, match="cannot be loaded safely"):
        vjepa(init=str(path))
    assert not marker.exists()


def test_an_unknown_format_is_refused_with_its_first_keys(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"layer.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(UserError, match=r"not a checkpoint format octfw converts \(vjepa2.*\); its first keys: layer.weight"):
        vjepa(init=str(path))


def test_a_missing_file_that_is_no_hub_id_is_refused_without_asking_the_hub():
    with pytest.raises(UserError, match=r"model.init = './nothing.pt': no such file"):
        vjepa(init="./nothing.pt")
    # org/name-shaped, but a weight file's name: a missing path, not a repository to download.
    with pytest.raises(UserError, match=r"model.init = 'weights/vitl.pt': no such file"):
        vjepa(init="weights/vitl.pt")


def test_rotary_positions_with_heads_too_narrow_are_one_line():
    with pytest.raises(UserError, match=r"model.position = 'rope' needs attention heads of at least 6 channels"):
        vjepa(init=None, embed_dim=8, num_heads=2)


def test_a_resumed_run_does_not_read_init_its_checkpoint_restores_the_weights():
    config = VJEPA3DConfig(preset="tiny", patch_size=PATCH, init="./gone.pt", **FIELDS)
    model = build(config, ctx(apply_init=False))  # the file is gone: not read
    assert not hasattr(model, "init_report")
    with pytest.raises(UserError, match="no such file"):
        build(config, ctx(apply_init=True))


def test_a_flat_safetensors_file_of_the_same_keys_loads_the_same(tmp_path, reference):
    state = torch.load(CHECKPOINT, weights_only=True)
    flat = {f"{group}.{key}": tensor for group in ("encoder", "target_encoder", "predictor")
            for key, tensor in state[group].items()}
    path = tmp_path / "vjepa2.safetensors"
    save_file(flat, str(path))
    model = vjepa(init=str(path))
    with torch.no_grad():
        assert (model.target_encoder(reference["clip"]) - reference["target_tokens"]).abs().max() < 1e-5


def test_the_format_table_is_open_to_other_converters(tmp_path):
    module = tmp_path / "octfw_test_format.py"
    module.write_text(
        "NAME = 'marker'\n"
        "def detect(state):\n    return 'marker' in state\n"
        "def convert(state, targets, report):\n    report.notes.append('converted by the test format')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        register_format("marker", "octfw_test_format")
        path = tmp_path / "marker.safetensors"
        save_file({"marker": torch.zeros(1)}, str(path))
        encoder = ViT3DEncoder(IMAGE, PATCH, 1, 48, 1, 3, 4.0)
        report = initialise(str(path), InitTargets(online=encoder))
        assert report.format == "marker" and report.notes == ["converted by the test format"]
    finally:
        FORMATS.pop("marker", None)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("octfw_test_format", None)


# --- the encoder options a published network needs ----------------------------------------------


def test_rope_and_norm_eps_are_recorded_and_an_export_config_rebuilds_them(reference):
    encoder = vjepa().target_encoder
    config = encoder.architecture()
    assert config["position"] == "rope" and config["norm_eps"] == 1e-6
    rebuilt = encoder_from_config(config)
    rebuilt.load_state_dict(encoder.state_dict())
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(reference["clip"]), encoder(reference["clip"]))
    default = ViT3DEncoder(IMAGE, PATCH, 1, 48, 1, 3, 4.0).architecture()
    assert "position" not in default and "norm_eps" not in default  # exports of default encoders unchanged


def test_a_learned_table_is_a_saved_weight_and_rope_has_none():
    learned = ViT3DEncoder(IMAGE, PATCH, 1, 48, 1, 3, 4.0, position="learned")
    assert "pos_embed" in learned.state_dict() and learned.pos_embed.requires_grad
    decay, no_decay = weight_decay_groups(learned.parameters(), 0.05)
    assert any(p is learned.pos_embed for p in no_decay["params"])  # a table, not a weight: no decay
    assert not any(p is learned.pos_embed for p in decay["params"])
    rope = ViT3DEncoder(IMAGE, PATCH, 1, 48, 1, 3, 4.0, position="rope")
    assert "pos_embed" not in rope.state_dict() and not hasattr(rope, "pos_embed")
    with pytest.raises(ValueError, match="unknown position 'alibi'"):
        ViT3DEncoder(IMAGE, PATCH, 1, 48, 1, 3, 4.0, position="alibi")


# --- octfw check, end to end, from a Hub id in the local cache -----------------------------------


def hub_cache(root: Path) -> Path:
    """A Hugging Face cache holding the fixture as repository octfw-test/vjepa2-small (the
    layout huggingface_hub writes: refs/main names the snapshot)."""
    revision = "0" * 40
    repo = root / "models--octfw-test--vjepa2-small"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    shutil.copy(CHECKPOINT, snapshot / "vitl-small.pt")
    return root


def check(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    sizes = ["transform.image_size=[8,32,32]", "model.patch_size=[2,16,16]", "model.embed_dim=48", "model.depth=2",
             "model.num_heads=3", "model.predictor_embed_dim=32", "model.predictor_depth=2",
             "model.predictor_num_heads=2", "dataset.n_volumes=4", "engine.per_device_batch=2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache(tmp_path / "hub")),
           "OMP_NUM_THREADS": "1"}
    args = [a for s in (*sizes, *sets) for a in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "octfw.cli", "check", str(REPO / "recipes" / "quickstart.toml"),
                           *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_check_lists_what_a_hub_checkpoint_became_offline_from_the_cache(tmp_path):
    proc = check(tmp_path, 'model.init="octfw-test/vjepa2-small"', 'model.position="rope"', "model.norm_eps=1e-6")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("init "))
    assert "(vjepa2): 84 tensors loaded, 3 adapted, 0 left new, 1 checkpoint keys ignored" in summary
    assert "  adapted context_encoder.patch_embed.proj.weight: 3 input channels summed into 1 (a grey volume as RGB)" in lines
    assert "  adapted target_encoder.patch_embed.proj.weight: 3 input channels summed into 1 (a grey volume as RGB)" in lines
    assert "check passed" in lines


def test_check_refuses_a_checkpoint_that_does_not_fit_in_one_line_exit_2(tmp_path):
    proc = check(tmp_path, 'model.init="octfw-test/vjepa2-small"', 'model.position="rope"', "model.depth=3")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("octfw: error:")]
    assert errors == ["octfw: error: model.init: the checkpoint's encoder is 48 wide, 2 blocks deep (MLP 192) but "
                      "[model] vjepa3d preset 'tiny' is 48 wide, 3 blocks deep (MLP 192): choose the preset of the "
                      "checkpoint's size (large: ViT-L 1024/24, giant: ViT-g 1408/40) or set the sizes to match"]
    assert "Traceback" not in proc.stderr


def test_a_hub_id_missing_from_the_offline_cache_is_one_line(tmp_path):
    proc = check(tmp_path, 'model.init="octfw-test/not-cached"', 'model.position="rope"')
    assert proc.returncode == 2
    assert "not in the local Hugging Face cache" in proc.stderr and "Traceback" not in proc.stderr


# --- a run, and its resumption --------------------------------------------------------------


def test_a_resumed_run_takes_its_checkpoint_and_needs_the_init_file_no_more(tiny_recipe, tmp_path):
    from octfw.engine.trainer import train
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    weights = tiny_recipe.parent / "weights.pt"
    shutil.copy(CHECKPOINT, weights)
    overrides = ['model.init="weights.pt"', 'model.position="rope"', "model.norm_eps=1e-6", "model.patch_size=[2,16,16]",
                 "model.embed_dim=48", "model.depth=2", "model.num_heads=3", "model.predictor_embed_dim=32",
                 "model.predictor_depth=2", "model.predictor_num_heads=2", "engine.checkpoint_every_steps=2"]
    registry = load_registry()
    recipe = load_recipe(tiny_recipe, [*overrides, "run.max_steps=4"], registry)
    run_dir = create_run_dir(recipe, registry)
    assert train(recipe, registry, run_dir).update_steps == 4
    # Interrupted after its step-2 checkpoint, and the init file gone since.
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step_00000004.pt").unlink()
    (checkpoints / "latest").write_text("step_00000002.pt")
    weights.unlink()
    assert train(recipe, registry, run_dir, resume="auto").update_steps == 4
    # The run's exported encoder rebuilds with V-JEPA 2's positions and LayerNorms.
    from octfw import load_encoder

    exported = load_encoder(run_dir / "encoder")
    assert exported.encoder.position == "rope" and exported.encoder.norm_eps == 1e-6
    assert exported(torch.zeros(1, 1, 8, 32, 32)).shape == (1, 16, 48)


@pytest.mark.parametrize("preset, arch", [("large", "vit_large"), ("giant", "vit_giant_xformers")])
def test_the_large_and_giant_presets_take_the_published_networks_whole(preset, arch):
    """The published ViT-L and ViT-g (their state-dict shapes, recorded from the reference on
    the meta device) fill octfw's presets: every tensor has its place, none is left new."""
    from octfw.models.published import vjepa2
    from octfw.models.published.report import InitReport

    shapes = json.loads((FIXTURE / "published_shapes.json").read_text())[arch]
    config = VJEPA3DConfig(preset=preset, patch_size=(2, 16, 16), position="rope", norm_eps=1e-6)
    with torch.device("meta"):  # shapes only: 'giant' is a billion parameters
        model = build(config, ctx(image_size=(64, 256, 256)))
        state = {group: {key: torch.empty(shape) for key, shape in shapes[group].items()}
                 for group in ("encoder", "predictor")}
    assert model.context_encoder.num_heads == shapes["num_heads"]
    report = InitReport(source=arch, format="vjepa2")
    vjepa2.convert(state, InitTargets(online=model.context_encoder, ema=model.target_encoder, predictor=model.predictor,
                                      prefixes={"online": "context_encoder.", "ema": "target_encoder.",
                                                "predictor": "predictor."}), report)
    assert report.new == {}
    assert set(report.loaded) | set(report.adapted) == set(model.state_dict())
    assert set(report.ignored) == {f"predictor.mask_tokens.{i}" for i in range(1, 10)}


# --- V-JEPA 2.1 ---------------------------------------------------------------------------

FIXTURE_21 = REPO / "tests" / "fixtures" / "reference" / "vjepa2_1"
META_21 = json.loads((FIXTURE_21 / "meta.json").read_text())


def vjepa21(**fields):
    s = META_21["sizes"]
    config = VJEPA3DConfig(
        preset="tiny", patch_size=(s["tubelet_size"], s["patch_size"], s["patch_size"]),
        init=str(FIXTURE_21 / "checkpoint.pt"), embed_dim=s["embed_dim"], depth=s["depth"], num_heads=s["num_heads"],
        predictor_embed_dim=16, predictor_depth=1, predictor_num_heads=2, standardise_input=False,
        init_channels="sum", **{"position": "rope-interleaved", "rope_span": 16, "norm_eps": 1e-6, **fields})
    image = (s["num_frames"], s["crop_size"], s["crop_size"])
    return build(config, ctx(image_size=image)).eval()


def test_a_vjepa21_encoder_gives_the_reference_tokens_full_and_masked():
    reference = load_file(str(FIXTURE_21 / "tensors.safetensors"))
    model = vjepa21()
    assert model.init_report.format == "vjepa2.1"
    with torch.no_grad():
        # Not bit-equal: the modality embedding is folded into the patch bias (one rounding more).
        assert (model.target_encoder(reference["clip"]) - reference["ema_tokens"]).abs().max() < 1e-5
        assert (model.context_encoder(reference["clip"]) - reference["online_tokens"]).abs().max() < 1e-5
        kept = model.context_encoder(reference["clip"], keep_idx=reference["keep_idx"])
        assert (kept - reference["online_kept_tokens"]).abs().max() < 1e-5


def test_vjepa21_adaptations_and_what_is_left_are_named():
    report = vjepa21().init_report
    assert report.adapted["target_encoder.patch_embed.proj.bias"] == (
        "video_mod_embed added (V-JEPA 2.1 adds it to every patch token)")
    assert report.adapted["target_encoder.norm.weight"] == "norms_block.3.weight: the last hierarchical output's norm"
    assert report.ignored["ema_encoder.norms_block.0.weight"] == (
        "a norm of the intermediate levels V-JEPA 2.1's dense loss predicts")
    assert report.ignored["encoder.patch_embed_img.proj.weight"] == "for images (one frame), not volumes"
    assert {key.split(".")[0] for key in report.new} == {"predictor"}


def test_vjepa21_weights_need_its_rotary_positions_and_span():
    with pytest.raises(UserError, match="model.position = 'rope' but V-JEPA 2.1 weights are trained with its rotary"):
        vjepa21(position="rope")
    # Without the span the weights load, and the report says what differs from the reference.
    notes = vjepa21(rope_span=None).init_report.notes
    assert "model.rope_span = None, V-JEPA 2.1 stretched in-plane positions over 16 (interpolate_rope): set it to " \
           "compute what the reference computes" in notes


@pytest.mark.parametrize("preset, arch", [("large", "vit_large"), ("giant", "vit_giant_xformers")])
def test_the_large_and_giant_presets_take_the_published_vjepa21_encoders_whole(preset, arch):
    from octfw.models.published import vjepa2_1
    from octfw.models.published.report import InitReport

    shapes = json.loads((FIXTURE_21 / "published_shapes.json").read_text())[arch]
    config = VJEPA3DConfig(preset=preset, patch_size=(2, 16, 16), position="rope-interleaved", rope_span=16,
                           norm_eps=1e-6)
    with torch.device("meta"):
        model = build(config, ctx(image_size=(64, 384, 384)))
        state = {"ema_encoder": {key: torch.empty(shape) for key, shape in shapes["encoder"].items()}}
    assert model.context_encoder.num_heads == shapes["num_heads"]
    report = InitReport(source=arch, format="vjepa2.1")
    vjepa2_1.convert(state, InitTargets(online=model.context_encoder, ema=model.target_encoder,
                                        prefixes={"online": "context_encoder.", "ema": "target_encoder."}), report)
    assert report.new == {}
    encoders = {k for k in model.state_dict() if k.startswith(("context_encoder.", "target_encoder."))}
    assert set(report.loaded) | set(report.adapted) == encoders


# --- octfw eval: published weights as they are, continued, and random ------------------------------


def test_eval_compares_published_continued_and_random_side_by_side(tmp_path, capsys):
    """Issue #50 item 3: the recipe names the model it starts from (the published weights as they
    are), the run is that model continued, and one random baseline sits beside both. The random
    baseline is random: built without reading `[model] init` (it had been the published weights)."""
    from octfw.cli.main import main
    from octfw.engine.trainer import train
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    from conftest import TINY_RECIPE

    shutil.copy(CHECKPOINT, tmp_path / "weights.pt")
    model = ('[model]\nname = "vjepa3d"\npreset = "tiny"\npatch_size = [2, 16, 16]\ninit = "weights.pt"\n'
             'position = "rope"\nnorm_eps = 1e-6\nembed_dim = 48\ndepth = 2\nnum_heads = 3\n'
             'predictor_embed_dim = 32\npredictor_depth = 2\npredictor_num_heads = 2\n')
    text = TINY_RECIPE.replace('[model]\nname = "vjepa3d"\npreset = "tiny"\npatch_size = [4, 16, 16]\n', model)
    assert 'init = "weights.pt"' in text
    (tmp_path / "continue.toml").write_text(text, encoding="utf-8")
    registry = load_registry()
    recipe = load_recipe(tmp_path / "continue.toml", ["run.max_steps=2"], registry)
    run_dir = create_run_dir(recipe, registry)
    train(recipe, registry, run_dir)
    (tmp_path / "eval.toml").write_text(
        '[run]\nseed = 3\ndevice = "cpu"\n\n[[evaluator]]\nname = "knn"\nk = 3\nbootstrap = 50\n'
        'dataset = { name = "synthetic-oct", n_volumes = 16, labels = true, seed = 5 }\n', encoding="utf-8")
    sources = [str(tmp_path / "continue.toml"), str(run_dir)]
    assert main(["eval", *sources, "--names", "published,continued", "--recipe", str(tmp_path / "eval.toml"),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    scores = report["scores"]
    assert list(scores) == ["published", "continued", "random init"]
    assert report["locations"]["published"].endswith("continue.toml (update step 0)")
    assert report["locations"]["continued"].endswith("(update step 2)")
    auroc = {label: s["knn/auroc"] for label, s in scores.items()}
    for label in ("published", "continued"):
        difference = report["differences"][label]
        assert difference["knn/auroc"] == pytest.approx(auroc[label] - auroc["random init"])
        assert difference["knn/auroc_ci_low"] <= difference["knn/auroc"] <= difference["knn/auroc_ci_high"]

    # The baseline is random, the same for the recipe and its run, and not the weights it started from.
    from octfw.exports.checkpoint import find_checkpoint
    from octfw.evaluation.target import checkpoint_model, recipe_model

    start = recipe_model(tmp_path / "continue.toml", 3, registry)
    run = checkpoint_model(*find_checkpoint(run_dir, registry), 3, registry)
    published, random_start, random_run = (dict(m.named_parameters()) for m in
                                           (start.pretrained, start.random_init, run.random_init))
    name = "context_encoder.blocks.0.attn.qkv.weight"
    assert torch.equal(random_start[name], random_run[name])
    assert not torch.equal(published[name], random_run[name])
    assert torch.equal(published[name], build(VJEPA3DConfig(preset="tiny", patch_size=(2, 16, 16),
                                                             init=str(CHECKPOINT), **{**FIELDS, "standardise_input": True}),
                                              ctx((8, 32, 32), 1)).state_dict()[name])
    assert main(["eval", str(run_dir), "--recipe", str(tmp_path / "eval.toml"), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["random_init"]["knn/auroc"] == auroc["random init"]
    assert alone["pretrained"]["knn/auroc"] == auroc["continued"]

    assert main(["eval", *sources, "--recipe", str(tmp_path / "eval.toml")]) == 0
    table = capsys.readouterr().out
    assert "continue - random" in table and "random init" in table and "paired bootstrap" in table
    # --shots with both side by side: one random baseline, fitted once per draw, beside the two
    assert main(["eval", *sources, "--shots", "2", "--recipe", str(tmp_path / "eval.toml"),
                 "--png", str(tmp_path / "shots.png")]) == 0
    table = capsys.readouterr().out
    assert "fitted once per draw for all" in table and table.count("continue - random") >= 1
