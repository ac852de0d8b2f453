"""The input published weights expect (``model.init_channels``): folding the published RGB
normalisation into the patch projection gives, from grey [0, 1] intensities, the tokens the
published network gives for that image repeated in R, G and B and normalised as it was
trained; the sum rule does not, and the load report says so in one line; a head count that
cannot be the published encoder's is refused.

The published networks here are the references' small random ones
(tests/fixtures/reference/*, their parity with the reference code is tested elsewhere),
loaded as they are into a 3-channel recipe (``init_channels = "sum"`` keeps the kernel as
published). The normalisations are the references' loaders' (facts, not octfw's table):
ImageNet's for V-JEPA 2 and 2.1 (``app/vjepa/transforms.py``), VideoMAE (``datasets.py``)
and RETFound (timm's ``IMAGENET_DEFAULT_MEAN``/``STD``); 0.45 / 0.225 for MAE-ST
(``util/kinetics.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from octfw.display.errors import UserError
from octfw.models.published.adapt import fold_normalisation
from octfw.models.vit3d import ViT3DEncoder
from octfw.plugins.models.mae3d import MAE3DConfig
from octfw.plugins.models.mae3d import build as build_mae
from octfw.types import BuildContext

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "reference"
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
KINETICS = ((0.45, 0.45, 0.45), (0.225, 0.225, 0.225))


def _sizes(name: str) -> dict:
    return json.loads((FIXTURES / name / "meta.json").read_text())["sizes"]


V2, V21 = _sizes("vjepa2"), _sizes("vjepa2_1")
#: name -> (checkpoint, normalisation, image (frames, h, w), patch, recipe fields)
SOURCES = {
    "vjepa2": ("vjepa2/checkpoint.pt", IMAGENET, (V2["num_frames"], V2["crop_size"], V2["crop_size"]),
               (V2["tubelet_size"], V2["patch_size"], V2["patch_size"]),
               dict(embed_dim=V2["embed_dim"], depth=V2["depth"], num_heads=V2["num_heads"], position="rope")),
    "vjepa2.1": ("vjepa2_1/checkpoint.pt", IMAGENET, (V21["num_frames"], V21["crop_size"], V21["crop_size"]),
                 (V21["tubelet_size"], V21["patch_size"], V21["patch_size"]),
                 dict(embed_dim=V21["embed_dim"], depth=V21["depth"], num_heads=V21["num_heads"],
                      position="rope-interleaved", rope_span=16)),
    "videomae": ("videomae/checkpoint.pt", IMAGENET, (16, 8, 8), (2, 4, 4),
                 dict(embed_dim=16, depth=2, num_heads=2, position="learned")),
    "mae-st": ("mae_st/checkpoint.pt", KINETICS, (4, 8, 8), (2, 4, 4),
               dict(embed_dim=16, depth=2, num_heads=2, position="learned")),
    "retfound": ("retfound/checkpoint.pt", IMAGENET, (1, 16, 16), (1, 4, 4),
                 dict(embed_dim=16, depth=2, num_heads=2, position="learned")),
}
#: Folded one-channel tokens against the published network's on the normalised grey image
#: (float32, CPU): measured 7.0e-6 at most over the five sources (V-JEPA 2.1's 12 blocks; the
#: MAE family's 2 blocks 1.0e-6); the bound leaves room for other CPUs' last bits. The sum
#: rule is 0.5 to 4.4 off on the same images.
FOLD_BOUND = 2e-5


def encoder(name: str, in_channels: int, **fields):
    path, _, image, patch, sizes = SOURCES[name]
    config = MAE3DConfig(preset="tiny", patch_size=patch, init=str(FIXTURES / path), norm_eps=1e-6, mlp_ratio=4.0,
                         decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, **{**sizes, **fields})
    ctx = BuildContext(recipe_dir=REPO, cache_dir=Path("."), run_dir=None, seed=0, image_size=image,
                       in_channels=in_channels, mask_pairs=("a",))
    model = build_mae(config, ctx).eval()
    return model.encoder, model.init_report


def grey_volumes(name: str) -> torch.Tensor:
    """Two grey volumes of [0, 1] intensities, smooth and with detail, as a transform gives them."""
    image = SOURCES[name][2]
    generator = torch.Generator().manual_seed(3)
    coarse = torch.rand(2, 1, *(max(1, n // 4) for n in image), generator=generator)
    smooth = F.interpolate(coarse, size=image, mode="trilinear", align_corners=False)
    return (0.7 * smooth + 0.3 * torch.rand(2, 1, *image, generator=generator)).clamp(0, 1)


def published_tokens(name: str, grey: torch.Tensor) -> torch.Tensor:
    """The published network's tokens for ``grey`` repeated in R, G and B and normalised as it trained."""
    mean, std = (torch.tensor(v)[None, :, None, None, None] for v in SOURCES[name][1])
    rgb, _ = encoder(name, 3, init_channels="sum", standardise_input=False)
    with torch.no_grad():
        return rgb((grey.expand(-1, 3, -1, -1, -1) - mean) / std)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_fold_gives_one_channel_the_published_tokens_of_the_normalised_grey_image(name):
    grey = grey_volumes(name)
    expected = published_tokens(name, grey)
    folded, report = encoder(name, 1, standardise_input=False)  # init_channels "auto": the fold
    with torch.no_grad():
        assert (folded(grey) - expected).abs().max() < FOLD_BOUND
    how = report.adapted["encoder.patch_embed.proj.weight"]
    assert how.startswith("ImageNet's normalisation folded in (W_c / std_c); 3 input channels summed into 1" if
                          SOURCES[name][1] == IMAGENET else "MAE-ST's normalisation folded in (W_c / std_c); ")
    assert report.adapted["encoder.patch_embed.proj.bias"].startswith(
        ("ImageNet's" if SOURCES[name][1] == IMAGENET else "MAE-ST's")
        + " normalisation folded in (b - sum_c mean_c / std_c * sum W_c)")
    assert not [note for note in report.notes if note.startswith("input:")]  # the input is the published one


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_sum_rule_gives_other_tokens_and_the_report_names_both_normalisations(name):
    grey = grey_volumes(name)
    expected = published_tokens(name, grey)
    family = {"vjepa2": "V-JEPA 2", "vjepa2.1": "V-JEPA 2.1", "videomae": "VideoMAE", "mae-st": "MAE-ST",
              "retfound": "RETFound (MAE)"}[name]
    mean, std = (list(v) for v in SOURCES[name][1])
    for fields, recipe in ((dict(standardise_input=True), "standardises each volume (standardise_input = true)"),
                           (dict(standardise_input=False, init_channels="sum"),
                            "takes the intensities as they come (standardise_input = false, init_channels = \"sum\")")):
        summed, report = encoder(name, 1, **fields)  # standardise_input = true: "auto" sums
        with torch.no_grad():
            assert (summed(grey) - expected).abs().max() > 1e-3
        assert report.adapted["encoder.patch_embed.proj.weight"].startswith("3 input channels summed into 1")
        lines = [line for line in report.lines() if "input:" in line]
        assert lines == [f"  note    input: {family} was trained on "
                         f"{'ImageNet' if mean[0] == 0.485 else 'MAE-ST'}'s mean {mean} and std {std} per RGB "
                         f"channel; the recipe {recipe}, so its tokens are not the published model's for the same "
                         "image (init_channels = \"fold\" with standardise_input = false gives them from [0, 1] "
                         "intensities)"]


def test_folding_a_projection_is_projecting_the_normalised_input():
    kernel, bias = torch.randn(8, 3, 2, 4, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    volume = torch.rand(2, 3, 4, 8, 8, dtype=torch.float64)
    mean, std = IMAGENET
    normalised = (volume - torch.tensor(mean, dtype=torch.float64)[None, :, None, None, None]) / torch.tensor(
        std, dtype=torch.float64)[None, :, None, None, None]
    folded, shifted = fold_normalisation(kernel, bias, mean, std)
    assert folded.dtype == kernel.dtype and shifted.dtype == bias.dtype
    assert torch.allclose(F.conv3d(volume, folded, shifted, stride=(2, 4, 4)),
                          F.conv3d(normalised, kernel, bias, stride=(2, 4, 4)), atol=1e-12)


def test_an_explicit_fold_with_per_volume_standardisation_is_refused_in_one_line():
    with pytest.raises(UserError) as caught:
        encoder("vjepa2", 1, init_channels="fold", standardise_input=True)
    assert str(caught.value) == (
        "model.init_channels = \"fold\" folds V-JEPA 2's normalisation of [0, 1] intensities into the patch "
        "projection, but model.standardise_input = true standardises each volume first: set "
        "model.standardise_input = false (or init_channels = \"sum\")")


def test_init_channels_takes_only_its_choices():
    with pytest.raises(ValueError, match="must be one of 'auto', 'sum', 'fold', got 'imagenet'"):
        MAE3DConfig(preset="tiny", init_channels="imagenet")


# --- heads -----------------------------------------------------------------------------------------------


def videomae_small(path: Path) -> Path:
    """A VideoMAE pretraining checkpoint of the published ViT-S's width (384; 1 block, narrow MLP)."""
    network = ViT3DEncoder((16, 32, 32), (2, 16, 16), 3, 384, 1, 6, 0.25)
    state = {}
    for key, tensor in network.state_dict().items():
        if key.endswith("attn.qkv.bias"):
            q, _, v = tensor.chunk(3)
            state["encoder." + key.replace("qkv.bias", "q_bias")] = q
            state["encoder." + key.replace("qkv.bias", "v_bias")] = v
        else:
            state["encoder." + key] = tensor
    state["encoder_to_decoder.weight"] = torch.zeros(8, 384)
    torch.save({"model": state}, path)
    return path


def small(init: Path, **fields):
    config = MAE3DConfig(preset="small", patch_size=(2, 16, 16), init=str(init), depth=1, mlp_ratio=0.25,
                         position="learned", norm_eps=1e-6, **fields)
    ctx = BuildContext(recipe_dir=REPO, cache_dir=Path("."), run_dir=None, seed=0, image_size=(16, 32, 32),
                       in_channels=1, mask_pairs=("a",))
    return build_mae(config, ctx)


def test_a_head_count_the_published_encoder_cannot_have_is_refused_in_one_line(tmp_path):
    path = videomae_small(tmp_path / "videomae_s.pth")
    assert "6 attention heads, from the recipe" in " ".join(small(path).init_report.notes)  # the preset's 6
    with pytest.raises(UserError) as caught:
        small(path, num_heads=8)
    assert str(caught.value) == ("model.init: model.num_heads = 8, but VideoMAE's published 384-wide encoders have "
                                 "6 attention heads (a checkpoint does not record them): set model.num_heads = 6")


def test_check_refuses_a_wrong_head_count_with_exit_2(tmp_path):
    path = videomae_small(tmp_path / "videomae_s.pth")
    sets = ["transform.image_size=[16,32,32]", "model.patch_size=[2,16,16]", "model.embed_dim=384", "model.depth=1",
            "model.num_heads=12", "model.mlp_ratio=0.25", "dataset.n_volumes=4", "engine.per_device_batch=2",
            'model.position="learned"', "model.norm_eps=1e-6", f'model.init="{path}"']
    proc = subprocess.run([sys.executable, "-m", "octfw.cli", "check", str(REPO / "recipes" / "quickstart.toml"),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("octfw: error:")] == [
        "octfw: error: model.init: model.num_heads = 12, but VideoMAE's published 384-wide encoders have 6 attention "
        "heads (a checkpoint does not record them): set model.num_heads = 6"]
    assert "Traceback" not in proc.stderr
