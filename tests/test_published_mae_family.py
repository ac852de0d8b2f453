"""Starting from MAE-family weights (``[model] init``): VideoMAE, MAE-ST and RETFound
checkpoints made by the references' own modules (tests/fixtures/reference/{videomae,mae_st,
retfound}, written by tools/parity/mae_family_fixtures.py) load into octfw's encoder, which
then computes the reference's tokens at the reference's own input; RETFound inflated to a
one-channel volume keeps a depth-constant volume's tokens equal to the 2D network's on its
slice; a checkpoint that does not fit is refused in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from octfw.display.errors import UserError
from octfw.models.published import FORMATS, InitTargets, converter
from octfw.models.published.report import InitReport
from octfw.models.published.videomae import sinusoid_table
from octfw.plugins.models.mae3d import MAE3DConfig
from octfw.plugins.models.mae3d import build as build_mae
from octfw.plugins.models.vjepa3d import VJEPA3DConfig
from octfw.plugins.models.vjepa3d import build as build_vjepa
from octfw.types import BuildContext

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "reference"
SOURCES = {"videomae": "https://github.com/MCG-NJU/VideoMAE",
           "mae_st": "https://github.com/facebookresearch/mae_st",
           "retfound": "https://github.com/rmaphoh/RETFound_MAE"}
#: The fixtures' networks as a recipe states them: 16 wide, 2 blocks, 2 heads, MLP 64, the
#: references' LayerNorm epsilon, a learned position table.
FIELDS = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=4.0, position="learned", norm_eps=1e-6,
              standardise_input=False,  # the references standardise outside their networks
              init_channels="sum")  # ... and their inputs come normalised: nothing to fold
#: The references' own inputs: (frames, height, width) and patch.
VIDEOMAE = ((16, 8, 8), (2, 4, 4))
VIDEOMAE_FINETUNED = ((4, 8, 8), (2, 4, 4))
MAE_ST = ((4, 8, 8), (2, 4, 4))
RETFOUND_2D = ((1, 16, 16), (1, 4, 4))
#: octfw's tokens against the reference's (float32, CPU; measured 0 to 7.2e-7).
BOUND = 1e-5


def tensors(source: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / source / "tensors.safetensors"))


def mae(init: str | Path, image_size, patch_size, in_channels=3, **fields):
    config = MAE3DConfig(preset="tiny", patch_size=patch_size, init=str(init), **{**FIELDS, **fields})
    ctx = BuildContext(recipe_dir=REPO, cache_dir=Path("."), run_dir=None, seed=0, image_size=image_size,
                       in_channels=in_channels, mask_pairs=("a",))
    return build_mae(config, ctx).eval()


def tokens_of(model, volume: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.encoder(volume)


# --- the fixtures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_each_fixture_names_its_reference_commit_and_stays_small(source):
    meta = json.loads((FIXTURES / source / "meta.json").read_text())
    assert meta["reference"]["repo"] == SOURCES[source]
    assert re.fullmatch(r"[0-9a-f]{40}", meta["reference"]["commit"])
    assert sum(p.stat().st_size for p in (FIXTURES / source).iterdir()) < 200_000


def test_each_checkpoint_is_recognised_by_exactly_its_own_converter():
    files = {"videomae": ["videomae/checkpoint.pt", "videomae/finetuned.pt"], "mae-st": ["mae_st/checkpoint.pt"],
             "retfound": ["retfound/checkpoint.pt"], "vjepa2": ["vjepa2/checkpoint.pt"]}
    for expected, paths in files.items():
        for path in paths:
            state = torch.load(FIXTURES / path, weights_only=True)
            assert [name for name in FORMATS if converter(name).detect(state)] == [expected], path
    # VideoMAE's pretraining state re-saved flat (no "model" wrapper) is still VideoMAE's, not V-JEPA 2's.
    flat = torch.load(FIXTURES / "videomae" / "checkpoint.pt", weights_only=True)["model"]
    assert [name for name in FORMATS if converter(name).detect(flat)] == ["videomae"]


# --- VideoMAE ----------------------------------------------------------------------------------------


def test_a_videomae_pretraining_checkpoint_gives_the_reference_encoders_tokens():
    reference = tensors("videomae")
    model = mae(FIXTURES / "videomae" / "checkpoint.pt", *VIDEOMAE)
    report = model.init_report
    assert report.format == "videomae" and not report.new
    assert set(report.adapted) == {"encoder.pos_embed", "encoder.blocks.0.attn.qkv.bias",
                                   "encoder.blocks.1.attn.qkv.bias"}
    assert "mask_token" in report.ignored and "encoder_to_decoder.weight" in report.ignored
    assert all(k == "mask_token" or k.startswith(("decoder.", "encoder_to_decoder.")) for k in report.ignored)
    assert (tokens_of(model, reference["clip"]) - reference["tokens"]).abs().max() < BOUND


def test_a_finetuned_videomae_module_checkpoint_folds_its_layer_scales_and_gives_its_tokens():
    reference = tensors("videomae")
    model = mae(FIXTURES / "videomae" / "finetuned.pt", *VIDEOMAE_FINETUNED)
    report = model.init_report
    assert not report.new and set(report.ignored) == {"head.weight", "head.bias"}
    assert "layer scale gamma_2 folded in" in report.adapted["encoder.blocks.1.mlp.fc2.weight"]
    assert (tokens_of(model, reference["short_clip"]) - reference["finetuned_tokens"]).abs().max() < BOUND


def test_a_finetuned_videomae_with_mean_pooling_has_no_norm_and_octfws_is_left_new(tmp_path):
    state = torch.load(FIXTURES / "videomae" / "finetuned.pt", weights_only=True)["module"]
    state = {k: v for k, v in state.items() if not k.startswith("norm.")}
    state["fc_norm.weight"], state["fc_norm.bias"] = torch.ones(16), torch.zeros(16)
    torch.save({"module": state}, tmp_path / "mean_pooled.pth")
    report = mae(tmp_path / "mean_pooled.pth", *VIDEOMAE_FINETUNED).init_report
    assert report.new == {"encoder.norm.weight": "not in the checkpoint's network",
                          "encoder.norm.bias": "not in the checkpoint's network"}
    assert report.ignored["fc_norm.weight"].startswith("normalises the mean-pooled token")


def hugging_face_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fine-tuned VideoMAE state dict under transformers' names, as its
    convert_videomae_to_pytorch.py writes them (VideoMAEForVideoClassification)."""
    out = {}
    for key, tensor in state.items():
        block = re.match(r"^blocks\.(\d+)\.(.*)$", key)
        if key.startswith("patch_embed.proj."):
            out["videomae.embeddings.patch_embeddings.projection." + key.rsplit(".", 1)[1]] = tensor
        elif key.startswith("norm."):
            out["videomae.layernorm." + key.rsplit(".", 1)[1]] = tensor
        elif key.startswith("head."):
            out["classifier." + key.rsplit(".", 1)[1]] = tensor
        elif block:
            layer, rest = f"videomae.encoder.layer.{block.group(1)}.", block.group(2)
            if rest == "attn.qkv.weight":
                for name, part in zip(("query", "key", "value"), tensor.chunk(3)):
                    out[f"{layer}attention.attention.{name}.weight"] = part
                continue
            for old, new in (("attn.q_bias", "attention.attention.q_bias"),
                             ("attn.v_bias", "attention.attention.v_bias"),
                             ("attn.proj.", "attention.output.dense."), ("norm1.", "layernorm_before."),
                             ("norm2.", "layernorm_after."), ("mlp.fc1.", "intermediate.dense."),
                             ("mlp.fc2.", "output.dense.")):
                rest = rest.replace(old, new)
            out[layer + rest] = tensor
    return out


# "videomae.": VideoMAEForPreTraining and ...ForVideoClassification; "": VideoMAEModel saved alone.
@pytest.mark.parametrize("prefix", ["videomae.", ""])
def test_a_videomae_under_hugging_face_names_loads_the_same(tmp_path, prefix):
    reference = tensors("videomae")
    state = torch.load(FIXTURES / "videomae" / "checkpoint.pt", weights_only=True)["model"]
    encoder = {k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")}
    renamed = {k.removeprefix("videomae."): v for k, v in hugging_face_names(encoder).items()}
    path = tmp_path / "model.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in renamed.items()}, str(path))
    model = mae(path, *VIDEOMAE)
    assert model.init_report.format == "videomae" and not model.init_report.new
    assert (tokens_of(model, reference["clip"]) - reference["tokens"]).abs().max() < BOUND


def test_videomaes_table_is_its_sinusoid_over_the_token_index():
    table = sinusoid_table(5, 6)[0].double()
    n, j = 3, 4  # channel 4 is even: a sine of 3 / 10000 ** (4 / 6)
    assert abs(table[n, j] - torch.sin(torch.tensor(n / 10000 ** (4 / 6)))) < 1e-6
    assert abs(table[n, j + 1] - torch.cos(torch.tensor(n / 10000 ** (4 / 6)))) < 1e-6


# --- MAE-ST ------------------------------------------------------------------------------------------


def test_an_mae_st_checkpoint_gives_the_tokens_of_the_reference_without_its_cls_token():
    reference = tensors("mae_st")
    model = mae(FIXTURES / "mae_st" / "checkpoint.pt", *MAE_ST)
    report = model.init_report
    assert report.format == "mae-st" and not report.new
    assert {"cls_token", "pos_embed_class"} <= set(report.ignored)
    assert "added into one table" in report.adapted["encoder.pos_embed"]
    ours = tokens_of(model, reference["clip"])
    assert (ours - reference["tokens"]).abs().max() < BOUND
    # The reference's own patch tokens attended to its cls token: octfw's differ from them (0.019).
    assert (ours - reference["tokens_with_cls"]).abs().max() > 1e-3


def test_an_mae_st_checkpoint_with_one_table_and_a_cls_row_loads_the_same(tmp_path):
    reference = tensors("mae_st")
    state = torch.load(FIXTURES / "mae_st" / "checkpoint.pt", weights_only=True)["model_state"]
    spatial, temporal = state.pop("pos_embed_spatial"), state.pop("pos_embed_temporal")
    table = spatial.repeat(1, temporal.shape[1], 1) + temporal.repeat_interleave(spatial.shape[1], dim=1)
    state["pos_embed"] = torch.cat([state.pop("pos_embed_class"), table], dim=1)
    torch.save({"model": state}, tmp_path / "one_table.pth")
    model = mae(tmp_path / "one_table.pth", *MAE_ST)
    assert model.init_report.adapted["encoder.pos_embed"] == "pos_embed without its cls row"
    assert (tokens_of(model, reference["clip"]) - reference["tokens"]).abs().max() < BOUND


# --- RETFound ----------------------------------------------------------------------------------------


def test_retfound_gives_the_patch_tokens_of_timms_vit_without_its_cls_token():
    reference = tensors("retfound")
    model = mae(FIXTURES / "retfound" / "checkpoint.pt", *RETFOUND_2D)
    report = model.init_report
    assert report.format == "retfound" and not report.new and list(report.ignored) == ["cls_token"]
    assert list(report.adapted) == ["encoder.pos_embed"]  # its cls row dropped, nothing else
    ours = tokens_of(model, reference["image"][:, :, None])
    assert (ours - reference["tokens"]).abs().max() < BOUND
    # RETFound's own patch tokens (its cls token first, dropped here) attended to the cls token (0.025).
    assert (ours - reference["tokens_with_cls"][:, 1:]).abs().max() > 1e-3


def test_mae_decoder_keys_in_a_flat_file_are_ignored_and_the_encoder_loads_the_same(tmp_path):
    reference = tensors("retfound")
    state = torch.load(FIXTURES / "retfound" / "checkpoint.pt", weights_only=True)["model"]
    state = {**state, "mask_token": torch.zeros(1, 1, 8), "decoder_embed.weight": torch.zeros(8, 16)}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "flat.safetensors"))
    model = mae(tmp_path / "flat.safetensors", *RETFOUND_2D)
    assert {"mask_token", "decoder_embed.weight"} <= set(model.init_report.ignored)
    assert (tokens_of(model, reference["image"][:, :, None]) - reference["tokens"]).abs().max() < BOUND


@pytest.mark.parametrize("patch_depth", [1, 2, 4])
def test_inflated_retfound_gives_a_depth_constant_volume_the_2d_tokens_of_its_slice(patch_depth):
    reference = tensors("retfound")
    slices = 4 * patch_depth
    model = mae(FIXTURES / "retfound" / "checkpoint.pt", (slices, 16, 16), (patch_depth, 4, 4), in_channels=1)
    volume = reference["grey_image"][:, :, None].expand(-1, -1, slices, -1, -1)  # [B, 1, D, H, W]
    ours = tokens_of(model, volume).reshape(2, 4, 16, 16)  # [B, depth of the grid, in-plane patches, E]
    assert (ours - reference["grey_tokens"][:, None]).abs().max() < BOUND


def test_retfound_on_a_one_channel_oct_sized_volume_builds_with_its_adaptations_named():
    model = mae(FIXTURES / "retfound" / "checkpoint.pt", (16, 128, 128), (4, 16, 16), in_channels=1)
    report = model.init_report
    assert not report.new
    assert report.adapted["encoder.patch_embed.proj.weight"] == (
        "3 input channels summed into 1 (a grey volume as RGB); kernel [1, 4, 4] repeated over 4 slices and "
        "divided by 4 (I3D), resized in-plane to [16, 16]")
    assert report.adapted["encoder.pos_embed"] == ("the 2D table without its cls row; resampled from 4 x 4 to "
                                                   "8 x 8 (bilinear); repeated over the 4 slices of the grid")
    table = model.encoder.pos_embed.detach().reshape(4, 64, 16)
    assert torch.equal(table[0], table[3])
    volume = torch.randn(1, 1, 16, 128, 128)
    out = tokens_of(model, volume)
    assert out.shape == (1, 4 * 8 * 8, 16) and torch.isfinite(out).all()


def test_a_vjepa_recipe_takes_retfound_into_both_encoders_and_leaves_its_predictor_new():
    config = VJEPA3DConfig(preset="tiny", patch_size=(2, 4, 4), init=str(FIXTURES / "retfound" / "checkpoint.pt"),
                           **FIELDS)
    ctx = BuildContext(recipe_dir=REPO, cache_dir=Path("."), run_dir=None, seed=0, image_size=(8, 16, 16),
                       in_channels=1, mask_pairs=("short", "long"))
    model = build_vjepa(config, ctx)
    report = model.init_report
    assert "context_encoder.blocks.0.attn.qkv.weight" in report.loaded
    assert "target_encoder.blocks.0.attn.qkv.weight" in report.loaded
    reasons = {reason for key, reason in report.new.items()}
    assert all(key.startswith("predictor.") for key in report.new) and report.new
    assert reasons == {"RETFound (MAE) checkpoints carry a pixel decoder, not a V-JEPA predictor"}
    assert torch.equal(model.context_encoder.pos_embed, model.target_encoder.pos_embed)


# --- the published sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize("source, fixture, group, preset", [
    ("videomae", "videomae", "model", "base"), ("videomae", "videomae", "model", "large"),
    ("mae-st", "mae_st", "model_state", "base"), ("mae-st", "mae_st", "model_state", "large"),
    ("retfound", "retfound", "model", "large"),
])
def test_the_presets_take_the_published_networks_whole_at_the_seeds_oct_geometry(source, fixture, group, preset):
    """The published ViT-B / ViT-L (their state-dict shapes, recorded from the reference's own
    model functions on the meta device) fill octfw's preset in a one-channel recipe at the
    seeds' volume and patch: every tensor has its place, none is left new."""
    shapes = json.loads((FIXTURES / fixture / "published_shapes.json").read_text())[preset]
    config = MAE3DConfig(preset=preset, patch_size=(4, 16, 16), position="learned", norm_eps=1e-6)
    ctx = BuildContext(recipe_dir=REPO, cache_dir=Path("."), run_dir=None, seed=0, image_size=(64, 384, 384),
                       in_channels=1, mask_pairs=("a",))
    with torch.device("meta"):  # shapes only
        model = build_mae(config, ctx)
        state = {group: {key: torch.empty(shape) for key, shape in shapes.items()}}
    assert [name for name in FORMATS if converter(name).detect(state)] == [source]
    report = InitReport(source=preset, format=source)
    converter(source).convert(state, InitTargets(online=model.encoder, prefixes={"online": "encoder."}), report)
    assert report.new == {}
    assert set(report.loaded) | set(report.adapted) == {f"encoder.{key}" for key in model.encoder.state_dict()}
    inflation = ("kernel [1, 16, 16] repeated over 4 slices and divided by 4 (I3D)" if source == "retfound"
                 else "kernel [2, 16, 16] resampled to [4, 16, 16] (trilinear) and rescaled to keep its sum")
    kernel = report.adapted["encoder.patch_embed.proj.weight"]
    assert kernel == f"3 input channels summed into 1 (a grey volume as RGB); {inflation}"


# --- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("source, path, geometry", [
    ("videomae", "videomae/checkpoint.pt", VIDEOMAE),
    ("mae-st", "mae_st/checkpoint.pt", MAE_ST),
    ("retfound", "retfound/checkpoint.pt", RETFOUND_2D),
])
def test_a_checkpoint_of_another_width_or_depth_is_refused_in_one_line_naming_both(source, path, geometry):
    for fields, recipe in ((dict(embed_dim=32), "32 wide, 2 blocks deep (MLP 128)"),
                           (dict(depth=3), "16 wide, 3 blocks deep (MLP 64)")):
        with pytest.raises(UserError) as caught:
            mae(FIXTURES / path, *geometry, **fields)
        message = str(caught.value)
        assert "\n" not in message
        assert "is 16 wide, 2 blocks deep (MLP 64)" in message and recipe in message


@pytest.mark.parametrize("position", ["sincos", "rope"])
def test_mae_family_weights_need_a_learned_position_table(position):
    with pytest.raises(UserError, match=rf"model.position = '{position}' but RETFound \(MAE\) weights come with a "
                                        r"position table added to the tokens: set model.position = \"learned\""):
        mae(FIXTURES / "retfound" / "checkpoint.pt", *RETFOUND_2D, position=position)


def test_the_rgb_kernel_cannot_become_two_channels():
    with pytest.raises(UserError, match="takes 3 input channels and the recipe's data has 2"):
        mae(FIXTURES / "videomae" / "checkpoint.pt", *VIDEOMAE, in_channels=2)


def test_check_prints_what_a_retfound_checkpoint_became_in_a_one_channel_vjepa_recipe(tmp_path):
    sets = ["transform.image_size=[8,32,32]", "model.patch_size=[2,8,8]", "model.embed_dim=16", "model.depth=2",
            "model.num_heads=2", "dataset.n_volumes=4", "engine.per_device_batch=2", 'model.position="learned"',
            "model.norm_eps=1e-6", f'model.init="{FIXTURES / "retfound" / "checkpoint.pt"}"']
    proc = subprocess.run([sys.executable, "-m", "octfw.cli", "check", str(REPO / "recipes" / "quickstart.toml"),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    summary = next(line for line in lines if line.startswith("init "))
    assert summary.endswith("(retfound): 54 tensors loaded, 4 adapted, 32 left new, 1 checkpoint keys ignored")
    new = [line for line in lines if line.startswith("  new ")]
    assert len(new) == 1
    assert new[0].endswith(": RETFound (MAE) checkpoints carry a pixel decoder, not a V-JEPA predictor")
    assert new[0].startswith("  new     predictor.")
    assert ("  adapted context_encoder.patch_embed.proj.weight: 3 input channels summed into 1 (a grey volume as "
            "RGB); kernel [1, 4, 4] repeated over 2 slices and divided by 2 (I3D), resized in-plane to [8, 8]") in lines
    assert ("  ignored cls_token: octfw has no cls token: its encoder returns the patch tokens, which its evaluations "
            "pool") in lines
    assert "check passed" in lines
