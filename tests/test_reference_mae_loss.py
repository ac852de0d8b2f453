"""octfw's MAE loss against facebookresearch/mae and mae_st on the same tensors
(tests/fixtures/reference/mae_loss.{json,safetensors}, from tools/parity/mae_loss.py).

Patch orders, mapped explicitly: the reference's patch ``k`` is octfw's token
``k``; both count patches row-major over (t, h, w) (an image is one frame:
octfw's D = 1, patch depth 1), and within a patch MAE's values run over
(u, p, q, c), octfw's over (pd, ph, pw, C): the same order. MAE's mask marks
removed patches with 1; octfw takes their indices, sorted, as ``target_idx``.
MAE averages over every removed patch of the batch, octfw per sample and
then over the samples: equal because every sample removes the same number
of patches (octfw's fixed counts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from octfw.models.vit3d import gather_tokens
from octfw.plugins.models.mae3d.model import masked_pixel_loss, patchify

FIXTURES = Path(__file__).parent / "fixtures" / "reference"
RECORDED = json.loads((FIXTURES / "mae_loss.json").read_text())
TENSORS = load_file(str(FIXTURES / "mae_loss.safetensors"))
#: name -> (octfw's [B, C, D, H, W] volume from the reference's input, octfw's patch size)
LAYOUTS = {
    "image": (lambda imgs: imgs.unsqueeze(2), (1, 4, 4)),  # [N, C, H, W] -> one depth slice
    "video": (lambda imgs: imgs, (2, 4, 4)),                # [N, C, T, H, W], tubelet 2
}


def octfw_loss(name: str, norm_pix_loss: bool) -> torch.Tensor:
    to_volume, patch_size = LAYOUTS[name]
    volume = to_volume(TENSORS[f"{name}/imgs"])
    predicted_all = TENSORS[f"{name}/pred"]
    removed = TENSORS[f"{name}/mask"].reshape(volume.shape[0], -1)  # video: [N * t, h * w] -> [N, L]
    target_idx = torch.stack([torch.nonzero(row).squeeze(1) for row in removed])  # sorted, same count
    target = gather_tokens(patchify(volume, patch_size), target_idx)
    predicted = gather_tokens(predicted_all, target_idx)
    return masked_pixel_loss(predicted, target, norm_pix_loss).mean()


def test_the_fixture_names_both_references_and_their_commits():
    assert set(RECORDED["references"]) == {"mae", "mae_st"}
    assert all(len(ref["commit"]) == 40 for ref in RECORDED["references"].values())
    for name in LAYOUTS:
        assert TENSORS[f"{name}/imgs"].dtype == torch.float32
        removed = TENSORS[f"{name}/mask"].reshape(2, -1).sum(dim=1)
        assert removed[0] == removed[1] > 0  # the same count per sample, as octfw's masks


@pytest.mark.parametrize("norm_pix_loss", [False, True])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_masked_pixel_loss_equals_mae_within_1e5_in_float32(name, norm_pix_loss):
    reference = RECORDED["losses"][f"{name}/norm_pix_loss={norm_pix_loss}"]
    assert float(octfw_loss(name, norm_pix_loss)) == pytest.approx(reference, abs=1e-5)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_normalised_and_raw_targets_give_different_losses(name):
    # So each comparison above pins its own target: the two differ by far more than 1e-5.
    losses = RECORDED["losses"]
    assert abs(losses[f"{name}/norm_pix_loss=True"] - losses[f"{name}/norm_pix_loss=False"]) > 1e-2


def test_a_patch_order_other_than_mae_s_is_told_apart():
    # The loss sees the order: octfw's patches with (h, w) swapped miss the reference by far.
    volume = TENSORS["image/imgs"].unsqueeze(2).transpose(-1, -2)
    removed = TENSORS["image/mask"]
    target_idx = torch.stack([torch.nonzero(row).squeeze(1) for row in removed])
    swapped = masked_pixel_loss(gather_tokens(TENSORS["image/pred"], target_idx),
                                gather_tokens(patchify(volume, (1, 4, 4)), target_idx), True).mean()
    assert abs(float(swapped) - RECORDED["losses"]["image/norm_pix_loss=True"]) > 1e-3
