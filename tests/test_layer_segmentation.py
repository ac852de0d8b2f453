"""The layer-segmentation evaluator: its metrics against hand-computed cases, its decoders' shapes,
what trains when frozen, last-k or whole, an easy layered task learnt on a tiny CPU budget, the
cross-vendor split and one-line option errors.

The layered volumes are built here (horizontal bands with a ripple, an intensity per layer) and
served by a small dataset written in this file that implements the dataset protocols the
evaluator reads (``LayeredDataset``, ``PatientDataset``); the transform is the real oct-standard.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_xla_script
from octfw.display.errors import RecipeError, UserError
from octfw.models.vit3d import ViT3DEncoder
from octfw.plugins.evaluators.layer_segmentation import LayerSegmentationConfig
from octfw.plugins.evaluators.layer_segmentation.algorithm import (
    LinearDecoder,
    SegmentationNetwork,
    UNETRDecoder,
    frozen_part,
    segmentation_groups,
    segmentation_loss,
    tap_depths,
    validation_steps,
)
from octfw.plugins.evaluators.layer_segmentation.metrics import segmentation_counts, segmentation_metrics
from octfw.plugins.evaluators.layer_segmentation.evaluator import (
    LayerSegmentationEvaluator,
    axial_spacing_um,
    layer_keys,
)
from octfw.plugins.transforms.oct_standard import OCTStandardConfig
from octfw.plugins.transforms.oct_standard.transform import OCTStandardTransform
from octfw.recipe import load_recipe
from octfw.types import LayeredDataset, PatientDataset, Provenance, Sample

from conftest import TINY_RECIPE

IMAGE, PATCH = (8, 32, 32), (4, 16, 16)
NAMES = ("vitreous", "NFL", "GCL+IPL", "choroid")
SPACING = (0.1, 0.0039, 0.01)  # mm: 3.9 µm along H
_INTENSITY = (0.05, 0.9, 0.35, 0.6)


def layered_volume(seed: int, shape: tuple[int, int, int] = IMAGE) -> tuple[np.ndarray, np.ndarray]:
    """(float32 volume, uint8 labels) ``[D, H, W]``: four horizontal bands whose boundaries ripple
    along W and D and sit a few rows higher or lower per volume; an intensity per band plus noise."""
    rng = np.random.default_rng(seed)
    d, h, w = shape
    z, x = np.meshgrid(np.arange(d), np.arange(w), indexing="ij")
    shift = rng.uniform(-3, 3)
    ripple = 1.5 * np.sin(2 * np.pi * x / w + rng.uniform(0, 2 * np.pi)) + 0.5 * np.sin(2 * np.pi * z / d)
    tops = [h * 0.25, h * 0.45, h * 0.65]
    rows = np.arange(h)[None, :, None]
    labels = np.zeros(shape, dtype=np.uint8)
    for top in tops:
        labels += (rows >= (top + shift + ripple)[:, None, :]).astype(np.uint8)
    volume = np.asarray(_INTENSITY, dtype=np.float32)[labels] + rng.normal(0, 0.08, shape).astype(np.float32)
    return volume, labels


class ToyLayers:
    """A dataset of :func:`layered_volume` volumes with their labels, one patient per pair of volumes:
    both scanned by one vendor, or with ``eyes_span_vendors`` each eye by the next vendor (patient
    ``p``'s volumes ``2p`` and ``2p + 1`` on ``domains[0]`` and ``domains[1]``)."""

    def __init__(self, n: int, domains: tuple[str, ...] = ("heidelberg",), shape: tuple[int, int, int] = IMAGE,
                 eyes_span_vendors: bool = False):
        self.items = [layered_volume(i, shape) for i in range(n)]
        self.domains = [domains[(i if eyes_span_vendors else i // 2) % len(domains)] for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def load(self, index: int) -> Sample:
        volume = self.items[index][0]
        return Sample(volume, Provenance(f"toy/{index}", self.domains[index], SPACING, volume.shape))

    def domain(self, index: int) -> str:
        return self.domains[index]

    def patient(self, index: int) -> str:
        return f"p{index // 2}"

    def layers_source(self, index: int) -> str:
        return f"toy/{index}.layers"

    def layer_names(self, index: int) -> tuple[str, ...]:
        return NAMES

    def layers(self, index: int) -> np.ndarray:
        return self.items[index][1]


def _transform(image=IMAGE) -> OCTStandardTransform:
    return OCTStandardTransform(OCTStandardConfig(image_size=image, percentiles=(0.0, 100.0)), PATCH)


def _encoder(depth: int = 4, patch=PATCH, seed: int = 0) -> ViT3DEncoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ViT3DEncoder(IMAGE, patch, 1, 24, depth, 2, 2.0).eval()


def _evaluator(dataset, **options) -> LayerSegmentationEvaluator:
    """The evaluator on ``dataset``, trained for ``epochs`` alone unless ``min_steps`` is given (the
    default floor of 1000 steps is for real cohorts, not for these toy bands)."""
    config = LayerSegmentationConfig(dataset={"name": "toy"}, **{"min_steps": 0, "bootstrap": 0, **options})
    grid = tuple(i // p for i, p in zip(IMAGE, PATCH))
    return LayerSegmentationEvaluator(config, dataset, None, _transform(), PATCH, grid)


def test_the_toy_dataset_implements_the_protocols_the_evaluator_reads():
    assert isinstance(ToyLayers(2), LayeredDataset) and isinstance(ToyLayers(2), PatientDataset)


# --- metrics ---------------------------------------------------------------

def test_a_perfect_prediction_scores_dice_1_and_no_boundary_error():
    _, labels = layered_volume(0)
    truth = labels[None].astype(np.int64)
    metrics = segmentation_metrics(truth, truth, layer_keys(NAMES), np.array([3.9]), ["heidelberg"])
    assert metrics["mean_dice"] == 1.0 and metrics["dice_gcl_ipl"] == 1.0 and metrics["dice_vitreous"] == 1.0
    assert metrics["boundary_error_um"] == 0.0 and metrics["boundary_error_um_nfl_gcl_ipl"] == 0.0
    assert metrics["mean_dice/heidelberg"] == 1.0


def test_a_one_row_shift_is_one_axial_spacing_of_boundary_error_in_micrometres():
    _, labels = layered_volume(0)
    truth = labels[None].astype(np.int64)
    shifted = np.concatenate([np.zeros_like(truth[:, :, :1]), truth[:, :, :-1]], axis=2)  # one row deeper
    metrics = segmentation_metrics(shifted, truth, layer_keys(NAMES), np.array([3.9]), ["heidelberg"])
    for upper, lower in (("vitreous", "nfl"), ("nfl", "gcl_ipl"), ("gcl_ipl", "choroid")):
        assert metrics[f"boundary_error_um_{upper}_{lower}"] == pytest.approx(3.9)
    assert metrics["boundary_error_um"] == pytest.approx(3.9)


def test_dice_per_layer_and_the_mean_leave_out_the_background():
    # One A-scan of 4 voxels: truth 0 0 1 1, prediction 0 1 1 1.
    truth = np.array([0, 0, 1, 1]).reshape(1, 1, 4, 1)
    predicted = np.array([0, 1, 1, 1]).reshape(1, 1, 4, 1)
    counts = segmentation_counts(predicted, truth, 2)
    assert counts["dice"][0].tolist() == pytest.approx([2 / 3, 0.8])
    metrics = segmentation_metrics(predicted, truth, ["vitreous", "nfl"], np.array([2.0]), ["x"])
    assert metrics["dice_vitreous"] == pytest.approx(2 / 3) and metrics["mean_dice"] == pytest.approx(0.8)
    assert metrics["boundary_error_um"] == pytest.approx(2.0)  # 1 row at 2 µm


def _shifted_down(labels: np.ndarray, rows: int) -> np.ndarray:
    """``labels`` ``[D, H, W]`` predicted ``rows`` rows too deep (vitreous above, the bottom cut)."""
    return np.concatenate([np.zeros_like(labels[:, :rows]), labels[:, :labels.shape[1] - rows]], 1)


def test_intervals_resample_whole_patients_not_volumes():
    # 6 patients of 8 volumes each: every volume of a patient is predicted alike (the same number
    # of rows too deep, 0 to 5 by patient), so a patient's 8 volumes carry one value between them.
    # Resampling patients draws 6 values; resampling volumes would draw 48 as if independent, and
    # its interval would be about sqrt(8) = 2.8 times narrower.
    patients, per_patient = 6, 8
    truths = np.stack([layered_volume(i)[1].astype(np.int64) for i in range(patients * per_patient)])
    predictions = np.stack([_shifted_down(t, i // per_patient) for i, t in enumerate(truths)])
    groups = [f"p{i // per_patient}" for i in range(len(truths))]
    keys, spacing, domains = layer_keys(NAMES), np.full(len(truths), 3.9), ["a"] * len(truths)
    by_patient = segmentation_metrics(predictions, truths, keys, spacing, domains, groups=groups, bootstrap=2000)
    by_volume = segmentation_metrics(predictions, truths, keys, spacing, domains, bootstrap=2000)

    def width(metrics: dict, key: str) -> float:
        return metrics[f"{key}_ci_high"] - metrics[f"{key}_ci_low"]

    for key in ("mean_dice", "boundary_error_um"):
        assert by_patient[f"{key}_ci_low"] <= by_patient[key] <= by_patient[f"{key}_ci_high"]
        assert width(by_patient, key) > 2 * width(by_volume, key)
    # The patient-level interval is that of the mean of 6 patients' values, resampled here apart.
    per_volume = segmentation_counts(predictions, truths, len(NAMES))["boundary"].mean(1) * 3.9
    patient_values = per_volume[::per_patient]
    assert np.allclose(per_volume.reshape(patients, per_patient), patient_values[:, None])
    means = np.random.default_rng(1).choice(patient_values, (4000, patients)).mean(1)
    expected = np.percentile(means, 97.5) - np.percentile(means, 2.5)
    assert width(by_patient, "boundary_error_um") == pytest.approx(expected, rel=0.15)


def test_boundary_errors_are_in_rows_always_and_in_micrometres_only_where_the_spacing_is_given():
    _, labels = layered_volume(0)
    truths = np.stack([labels, labels]).astype(np.int64)
    shifted = np.stack([_shifted_down(labels, 1), _shifted_down(labels, 2)]).astype(np.int64)
    keys = layer_keys(NAMES)
    both = segmentation_metrics(shifted, truths, keys, np.array([3.9, 7.6]), ["heidelberg", "topcon"])
    assert both["boundary_error_rows"] == pytest.approx(1.5) and both["boundary_error_rows_nfl_gcl_ipl"] == 1.5
    assert both["boundary_error_um/heidelberg"] == pytest.approx(3.9)
    assert both["boundary_error_um/topcon"] == pytest.approx(2 * 7.6)  # 2 rows 7.6 µm apart
    one = segmentation_metrics(shifted, truths, keys, np.array([3.9, np.nan]), ["heidelberg", "topcon"])
    assert one["boundary_error_um"] == pytest.approx(3.9)  # the volume of unknown spacing is left out
    assert "boundary_error_um/topcon" not in one and one["boundary_error_rows/topcon"] == pytest.approx(2.0)


def test_a_volume_whose_dataset_gives_no_axial_spacing_has_none_and_the_report_says_rows():
    from octfw.evaluation.reporting import boundary_legend

    volume = ToyLayers(1).load(0)
    defaulted = Sample(volume.volume, Provenance("toy/0", "topcon", (0.1, 1.0, 0.01), volume.volume.shape))
    assert np.isnan(axial_spacing_um(_transform(), defaulted))  # 1 mm: what a header without spacing reads
    evaluator = _evaluator(ToyLayers(12, domains=("heidelberg", "topcon")))
    split = evaluator.describe_test_split()
    assert split["row_spacing_um"] == {"heidelberg": pytest.approx(3.9), "topcon": pytest.approx(3.9)}
    (line,) = boundary_legend({"layer-segmentation": {"row_spacing_um": {"heidelberg": 3.9, "topcon": None}}},
                              ["layer-segmentation/boundary_error_um_nfl_gcl_ipl"])
    assert "3.90 µm (heidelberg)" in line and "topcon: no axial spacing given, so in rows only" in line


def test_two_networks_differ_by_a_paired_patient_bootstrap_and_fits_average_over_draws():
    dataset = ToyLayers(16)
    evaluator = _evaluator(dataset, epochs=2, bootstrap=200)
    scores, kept = [], []
    for seed in (0, 1):
        scores.append(evaluator.score(evaluator.encode(_encoder(depth=2, seed=seed), "cpu")))
        kept.append(evaluator.last_test_probabilities)
    difference = evaluator.difference(kept[0], kept[1])
    for key in ("mean_dice", "boundary_error_um", "boundary_error_rows", "dice_nfl"):
        assert difference[key] == pytest.approx(scores[0][key] - scores[1][key])
        assert difference[f"{key}_ci_low"] <= difference[key] <= difference[f"{key}_ci_high"]
    itself = evaluator.difference(kept[0], kept[0])
    assert itself["mean_dice"] == itself["mean_dice_ci_low"] == itself["mean_dice_ci_high"] == 0.0
    # Two draws of each (stacked): the mean of the two draws' differences, on the same resamples.
    stacked = evaluator.difference(*({k: np.stack([a[k], b[k]]) for k in a} for a, b in
                                     ((kept[0], kept[1]), (kept[1], kept[1]))))
    assert stacked["mean_dice"] == pytest.approx(difference["mean_dice"] / 2)
    # Whole patients: the toy's patients have two volumes; resampling them is what the interval says.
    from octfw.plugins.evaluators.layer_segmentation.metrics import segmentation_difference

    test = evaluator.split()[1]
    by_volume = segmentation_difference(kept[0], kept[1], layer_keys(NAMES), test.domains, bootstrap=200,
                                        seed=0)
    by_patient = segmentation_difference(kept[0], kept[1], layer_keys(NAMES), test.domains, groups=test.groups,
                                         bootstrap=200, seed=0)
    assert difference["mean_dice_ci_low"] == by_patient["mean_dice_ci_low"] != by_volume["mean_dice_ci_low"]


def test_dice_per_layer_is_monais_but_a_layer_absent_from_prediction_and_truth_is_left_out():
    # MONAI's DiceMetric scores a layer absent from both 1 (ignore_empty=False) or leaves out any
    # layer absent from the truth (True); nnU-Net's convention leaves out the first and scores a
    # layer predicted where there is none 0. Checked against the formula on random label maps.
    rng = np.random.default_rng(0)
    truth, predicted = rng.integers(0, 4, (2, 3, 2, 5, 6))
    truth[0][truth[0] == 3] = 2
    predicted[0][predicted[0] == 3] = 1  # layer 3 nowhere in volume 0
    truth[1][truth[1] == 2] = 1  # layer 2 predicted in volume 1, absent from its truth
    expected = np.full((3, 4), np.nan)
    for n in range(3):
        for k in range(4):
            p, t = predicted[n] == k, truth[n] == k
            if p.any() or t.any():
                expected[n, k] = 2 * (p & t).sum() / (p.sum() + t.sum())
    dice = segmentation_counts(predicted, truth, 4)["dice"]
    assert np.isnan(dice[0, 3]) and dice[1, 2] == 0.0
    np.testing.assert_allclose(dice, expected, rtol=1e-6)  # NaN where expected is NaN


def test_the_loss_is_monais_dice_ce_equal_to_cross_entropy_plus_a_batch_soft_dice_smoothed_by_1():
    # The compound loss the evaluator wrote by hand before MONAI's DiceCELoss replaced it: the
    # soft Dice of every layer over the whole batch (not per volume), +1 above and below, averaged
    # over layers, plus the voxels' mean cross-entropy. A layer absent from the batch scores its
    # smoothing's 1 - 1 / (sum of its probabilities + 1).
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 2, 5, 6, generator=generator)
    labels = torch.randint(0, 3, (3, 2, 5, 6), generator=generator)  # layer 3 absent
    labels[0] = 0  # one volume all background: a per-volume Dice would differ

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(x, 1)
        truth = torch.nn.functional.one_hot(labels, 4).movedim(-1, 1).float()
        dims = (0, 2, 3, 4)
        dice = (2 * (probabilities * truth).sum(dims) + 1) / (probabilities.sum(dims) + truth.sum(dims) + 1)
        return torch.nn.functional.cross_entropy(x, labels) + 1 - dice.mean()

    values, gradients = [], []
    for loss in (by_hand, lambda x: segmentation_loss()(x, labels[:, None])):
        x = logits.clone().requires_grad_(True)
        value = loss(x)
        value.backward()
        values.append(value.item())
        gradients.append(x.grad)
    assert values[1] == pytest.approx(values[0], abs=1e-6)
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-7, rtol=1e-5)


def test_the_unetr_decoders_monai_blocks_compute_convolution_affine_instance_norm_and_relu():
    # The decoder's stem and fuse are MONAI's Convolution, UnetBasicBlock and UnetOutBlock; with
    # their weights, the decoder computes what it did when written with torch's layers: each
    # 3x3x3 convolution (with its bias; MONAI's have none, which instance norm cancels) then an
    # instance norm with a learned scale and shift, then ReLU, and a 1x1x1 convolution to logits.
    grid = tuple(i // p for i, p in zip(IMAGE, PATCH))
    torch.manual_seed(0)
    decoder = UNETRDecoder(24, 2, 4, PATCH, grid, 1, 8)
    with torch.no_grad():  # scales and shifts away from 1 and 0, so that they show
        for name, param in decoder.named_parameters():
            param.add_(0.3 * torch.randn_like(param))
    taps = [torch.randn(2, 8, 24), torch.randn(2, 8, 24)]
    volumes = torch.randn(2, 1, *IMAGE)
    F = torch.nn.functional

    def block(x: torch.Tensor, conv: torch.nn.Module, norm: torch.nn.Module) -> torch.Tensor:
        x = F.conv3d(x, conv.weight, torch.full((conv.weight.shape[0],), 0.7), padding=1)
        return F.relu(F.instance_norm(x, weight=norm.weight, bias=norm.bias, eps=1e-5))

    with torch.no_grad():
        normed = [decoder.norms[0](taps[0]), taps[1]]
        maps = [up(t.transpose(1, 2).reshape(2, 24, *grid)) for up, t in zip(decoder.up, normed)]
        stem = F.relu(F.instance_norm(F.conv3d(volumes, decoder.stem.conv.weight, decoder.stem.conv.bias, padding=1),
                                      weight=decoder.stem.adn.N.weight, bias=decoder.stem.adn.N.bias, eps=1e-5))
        fuse, out = decoder.fuse
        assert all(norm.affine for norm in (decoder.stem.adn.N, fuse.norm1, fuse.norm2))
        x = block(torch.cat([stem, *maps], 1), fuse.conv1.conv, fuse.norm1)
        x = block(x, fuse.conv2.conv, fuse.norm2)
        expected = F.conv3d(x, out.conv.conv.weight, out.conv.conv.bias)
        assert tuple(expected.shape) == (2, 4, *IMAGE)
        torch.testing.assert_close(decoder(taps, volumes), expected, atol=1e-5, rtol=1e-5)


def test_the_axial_spacing_is_measured_through_the_transform():
    sample = ToyLayers(1, shape=(8, 64, 32)).load(0)
    assert axial_spacing_um(_transform((8, 64, 32)), sample) == pytest.approx(3.9, rel=1e-6)
    assert axial_spacing_um(_transform((8, 32, 32)), sample) == pytest.approx(7.8 * 63 / 62, rel=0.03)
    cropped = OCTStandardTransform(OCTStandardConfig(image_size=(8, 32, 32), fit="crop_pad"), PATCH)
    assert axial_spacing_um(cropped, sample) == pytest.approx(3.9, rel=1e-6)  # cropping keeps the spacing
    resampled = OCTStandardTransform(OCTStandardConfig(image_size=(8, 32, 32), fit="crop_pad",
                                                       target_spacing=(0.1, 0.0078, 0.01)), PATCH)
    assert axial_spacing_um(resampled, sample) == pytest.approx(7.8, rel=0.02)


# --- decoders and what trains ---------------------------------------------------

@pytest.mark.parametrize("patch", [(4, 16, 16), (2, 8, 8), (8, 4, 4)])
@pytest.mark.parametrize("kind", ["unetr", "linear"])
def test_the_decoder_predicts_every_voxel_of_the_grid(patch, kind):
    encoder = _encoder(depth=4, patch=patch)
    grid = tuple(i // p for i, p in zip(IMAGE, patch))
    taps = tap_depths(4, 4 if kind == "unetr" else 1)
    decoder = UNETRDecoder(24, len(taps), 5, patch, grid, 1, 8) if kind == "unetr" else LinearDecoder(24, 5, patch, grid)
    volumes = torch.randn(2, 1, *IMAGE)
    with torch.no_grad():
        frozen, tokens = frozen_part(encoder, 4, taps, volumes)
        logits = SegmentationNetwork(decoder, None, 0, taps)(volumes, frozen, tokens)
    assert tuple(logits.shape) == (2, 5, *IMAGE)


def test_taps_are_evenly_spaced_blocks_ending_at_the_last():
    assert tap_depths(12, 4) == [3, 6, 9, 12] and tap_depths(4, 4) == [1, 2, 3, 4] and tap_depths(2, 4) == [1, 2]
    assert tap_depths(12, 1) == [12]


@pytest.mark.parametrize("blocks, trained_blocks, patch_embed", [(0, [], False), (1, [3], False),
                                                                  ("all", [0, 1, 2, 3], True)])
def test_frozen_last_k_and_all_train_what_they_should_with_decayed_rates(blocks, trained_blocks, patch_embed):
    encoder = _encoder(depth=4)
    grid = tuple(i // p for i, p in zip(IMAGE, PATCH))
    decoder = UNETRDecoder(24, 4, 4, PATCH, grid, 1, 8)
    network = SegmentationNetwork(decoder, None if blocks == 0 else encoder, blocks, tap_depths(4, 4))
    groups = segmentation_groups(network, 1.0, 0.5, 0.05)
    names = {name for group in groups for name in group["names"]}
    blocks_seen = sorted({int(n.split(".")[2]) for n in names if n.startswith("encoder.blocks.")})
    assert blocks_seen == trained_blocks
    assert any(n.startswith("encoder.patch_embed.") for n in names) == patch_embed
    assert any(n.startswith("decoder.") for n in names)
    assert any(n.startswith("encoder.norm.") for n in names) == (blocks != 0)
    for name, param in network.named_parameters():
        assert param.requires_grad == (name in names)
    for group in groups:
        for name in group["names"]:
            expected = 5 if name.startswith("encoder.patch_embed.") else \
                4 - int(name.split(".")[2]) if name.startswith("encoder.blocks.") else 0
            assert group["exponent"] == expected and group["lr_scale"] == 0.5 ** expected


def test_last_k_runs_the_frozen_blocks_once_and_matches_the_whole_forward():
    encoder = _encoder(depth=4)
    grid = tuple(i // p for i, p in zip(IMAGE, PATCH))
    taps = tap_depths(4, 4)
    decoder = UNETRDecoder(24, 4, 4, PATCH, grid, 1, 8)
    volumes = torch.randn(2, 1, *IMAGE)
    with torch.no_grad():
        whole = SegmentationNetwork(decoder, None, 0, taps)(volumes, *frozen_part(encoder, 4, taps, volumes))
        last_two = SegmentationNetwork(decoder, encoder, 2, taps)(volumes, *frozen_part(encoder, 2, taps, volumes))
        every = SegmentationNetwork(decoder, encoder, "all", taps)(volumes, *frozen_part(encoder, 0, taps, volumes))
    assert torch.allclose(whole, last_two, atol=1e-5) and torch.allclose(whole, every, atol=1e-5)


# --- the evaluator ---------------------------------------------------------

def test_a_random_frozen_encoder_with_the_unetr_decoder_segments_easy_layers():
    evaluator = _evaluator(ToyLayers(16), epochs=8, fit_batch_size=4)
    metrics = evaluator.score(evaluator.encode(_encoder(depth=2), "cpu"))
    # Measured (CPU, 6 labelled volumes, 8 epochs of 2 steps, 3 s): mean Dice 0.951, boundary error
    # 1.8 µm (0.46 rows). A random encoder: the bands are read mostly through the decoder's skip
    # from the volume, as UNETR's is. The 2 validation volumes, labelled too, chose the step.
    assert metrics["mean_dice"] > 0.85 and metrics["boundary_error_um"] < 6.0
    assert metrics["labelled_volumes"] == 6 and metrics["validation_volumes"] == 2 and metrics["steps"] == 16
    assert metrics["selected_step"] in validation_steps(16, 10)


def test_validation_is_evenly_spaced_over_the_fit_and_always_after_its_last_step():
    assert validation_steps(1000, 10) == set(range(100, 1001, 100))
    assert validation_steps(16, 10) == {2, 4, 5, 7, 8, 10, 12, 13, 15, 16}
    assert validation_steps(3, 10) == {1, 2, 3}
    assert validation_steps(7, 1) == {7}


def test_one_labelled_volume_trains_min_steps_not_one_step_per_epoch_and_learns_more():
    # An epoch of one volume is one update: 8 epochs alone leave the decoder barely trained. The
    # floor gives it the updates a fit on many volumes gets. Measured (CPU, the linear decoder, the
    # slower of the two to train): mean Dice 0.31 after 8 steps, 0.63 after 120.
    dataset = ToyLayers(16)
    encoder = _encoder(depth=2)
    scores = {}
    for min_steps in (0, 120):
        evaluator = _evaluator(dataset, epochs=8, min_steps=min_steps, decoder="linear")
        encoded = evaluator.encode(encoder, "cpu")
        scores[min_steps] = evaluator.score(encoded, evaluator.fit_positions()[:1])
    assert scores[0]["steps"] == 8 and scores[120]["steps"] == 120
    assert scores[120]["mean_dice"] > scores[0]["mean_dice"] + 0.2


def test_the_evaluator_fine_tunes_the_last_blocks_and_refuses_more_blocks_than_the_encoder_has():
    dataset = ToyLayers(8)
    frozen = _evaluator(dataset, epochs=1)
    last = _evaluator(dataset, epochs=1, blocks=1)
    encoder = _encoder(depth=2)
    trained = [e.score(e.encode(encoder, "cpu"))["trained_parameters"] for e in (frozen, last)]
    block = sum(p.numel() for p in encoder.blocks[1].parameters()) + sum(p.numel() for p in encoder.norm.parameters())
    assert trained[1] - trained[0] == block
    with pytest.raises(UserError, match="blocks = 3, but the encoder has 2 blocks"):
        _evaluator(dataset, blocks=3).encode(encoder, "cpu")


def test_train_domains_trains_on_one_vendor_and_tests_across_the_others():
    dataset = ToyLayers(16, domains=("heidelberg", "topcon"))
    evaluator = _evaluator(dataset, train_domains=["heidelberg"], epochs=2)
    train, test = evaluator.split()
    assert set(train.domains) == {"heidelberg"}
    assert test.domains.count("topcon") == 8 and 0 < test.domains.count("heidelberg") < 8
    assert not set(train.groups) & set(test.groups)
    metrics = evaluator.score(evaluator.encode(_encoder(depth=2), "cpu"))
    for key in ("in_vendor_mean_dice", "cross_vendor_mean_dice", "mean_dice/topcon", "cross_vendor_boundary_error_um"):
        assert key in metrics


def test_another_vendors_scan_of_a_training_patient_is_left_out_of_the_test_split():
    # Every patient has one eye on each vendor: half the patients' heidelberg scans train, and
    # their topcon scans (the anatomy the decoder was trained on) must be tested nowhere.
    dataset = ToyLayers(16, domains=("heidelberg", "topcon"), eyes_span_vendors=True)
    evaluator = _evaluator(dataset, train_domains=["heidelberg"])
    train, test = evaluator.split()
    assert set(train.domains) == {"heidelberg"} and len(set(train.groups)) == 4
    assert not set(train.groups) & set(test.groups)
    # The other 4 patients are tested on both eyes; nothing else is tested.
    assert sorted(test.domains) == ["heidelberg"] * 4 + ["topcon"] * 4
    assert len(set(test.groups)) == 4
    assert {g for g, d in zip(test.groups, test.domains) if d == "topcon"} == \
        {g for g, d in zip(test.groups, test.domains) if d == "heidelberg"}


def test_an_evaluator_built_with_a_test_dataset_sharing_patients_refuses_to_split():
    config = LayerSegmentationConfig(dataset={"name": "toy"}, test_dataset={"name": "toy"})
    grid = tuple(i // p for i, p in zip(IMAGE, PATCH))
    evaluator = LayerSegmentationEvaluator(config, ToyLayers(8), ToyLayers(6), _transform(), PATCH, grid)
    with pytest.raises(UserError, match="test_dataset shares 3 patients with dataset: 6 test volumes") as info:
        evaluator.split()
    assert "\n" not in str(info.value) and "p0" not in str(info.value)


def test_train_domains_naming_no_vendor_of_the_dataset_is_refused_in_one_line():
    evaluator = _evaluator(ToyLayers(8, domains=("heidelberg", "topcon")), train_domains=["zeiss"])
    with pytest.raises(UserError, match=r"train_domains \['zeiss'\] not among the dataset's vendors"):
        evaluator.split()


def test_shots_draw_labelled_volumes_not_volumes_per_class():
    from octfw.evaluation.shots import label_efficiency

    evaluator = _evaluator(ToyLayers(16), epochs=1)
    encoded = evaluator.encode(_encoder(depth=2), "cpu")
    results = label_efficiency(evaluator, encoded, [1, 3], 2, 0)
    assert [[run["labelled_volumes"] for run in runs] for _, runs in results] == [[1.0, 1.0], [3.0, 3.0]]


@pytest.mark.parametrize("option, key", [('decoder = "unet"', "decoder"), ("blocks = -1", "blocks"),
                                         ("train_domains = []", "train_domains"), ("taps = 0", "taps"),
                                         ("min_steps = -1", "min_steps"), ("validations = 0", "validations")])
def test_a_bad_option_is_a_recipe_error_naming_its_key(write_recipe, registry, option, key):
    path = write_recipe(TINY_RECIPE + '\n[[evaluator]]\nname = "layer-segmentation"\n'
                        f'dataset = {{ name = "synthetic-oct" }}\n{option}\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(path, (), registry)
    assert len(info.value.problems) == 1 and key in info.value.problems[0]
    assert "\n" not in info.value.problems[0]


def _export(folder) -> str:
    """A random depth-2 encoder at the toy geometry, exported as ``octfw eval`` reads it."""
    from octfw.exports.formats import encoder_info
    from octfw.exports.writing import write_export

    encoder = _encoder(depth=2)
    recipe = {"transform": {"name": "oct-standard", "image_size": list(IMAGE)}, "model": {"name": "vjepa3d"}}
    export = folder / "encoder.pt"
    write_export("octfw", export, encoder, encoder_info(encoder.architecture(), recipe, "hand-made", 0, {}))
    return str(export)


def test_octfw_eval_shots_on_synthetic_oct_layers_across_vendors_writes_table_csv_and_png(tmp_path, capsys):
    import csv
    import json
    import textwrap

    import attrs

    from octfw.cli.main import main
    from octfw.evaluation.label_efficiency import ShotsReport, format_shots

    export = _export(tmp_path)
    eval_recipe = tmp_path / "eval.toml"
    eval_recipe.write_text(textwrap.dedent("""
        [run]
        device = "cpu"

        [[evaluator]]
        name = "layer-segmentation"
        dataset = { name = "synthetic-oct", n_volumes = 18, seed = 5 }
        train_domains = ["heidelberg"]
        epochs = 2
        min_steps = 0
        bootstrap = 20
    """), encoding="utf-8")
    png = tmp_path / "shots.png"
    assert main(["eval", export, "--recipe", str(eval_recipe), "--shots", "1,2", "--draws", "2",
                 "--png", str(png), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report["csv"] == str(png.with_suffix(".csv"))
    with png.with_suffix(".csv").open(encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f)]
    wanted = ("in_vendor_mean_dice", "cross_vendor_mean_dice", "labelled_volumes", "validation_volumes")
    found = {(r["encoder"], r["shots"], r["metric"]): r for r in rows if r["metric"] in wanted}
    assert set(found) == {(e, s, m) for e in ("pretrained", "random_init") for s in ("1", "2") for m in wanted}
    assert [float(found[("pretrained", s, "labelled_volumes")]["mean"]) for s in ("1", "2")] == [1.0, 2.0]
    assert any(r["metric"].startswith("boundary_error_um_vitreous_nfl") for r in rows)
    # Every labelled volume is counted beside the shots: the k trained on and the whole validation
    # split, which chose the decoder's network at every k (CSV, JSON, table).
    validation = float(found[("pretrained", "1", "validation_volumes")]["mean"])
    assert validation >= 1
    for row in rows + report["rows"]:
        assert float(row["training_volumes"]) == float(row["shots"])
        assert float(row["validation_volumes"]) == validation
    table = format_shots(ShotsReport(**{f.name: report[f.name] for f in attrs.fields(ShotsReport)}))
    assert f"2 + {validation:g} val" in table and "labelled  the training volumes drawn + the validation split (val)" in table
    # k counts volumes here, not volumes per class; the report says what it tested on and the rows'
    # spacing its boundary errors in µm rest on, per vendor; every draw is a row with its difference.
    assert "per class" not in table and "layer-segmentation: " in table.splitlines()[4]
    assert "boundary_error_um counts rows of the prepared volume times their spacing" in table
    assert set(report["test_split"]["layer-segmentation"]["row_spacing_um"]) == {"heidelberg", "topcon", "zeiss"}
    paired = [r for r in report["draw_rows"] if r["metric"] == "cross_vendor_mean_dice" and r["encoder"] == "pretrained"]
    assert len(paired) == 4 and all(r["difference_ci_low"] <= r["difference"] <= r["difference_ci_high"] for r in paired)


def test_a_test_dataset_sharing_patients_with_the_dataset_is_refused_in_one_line(tmp_path, capsys):
    # Two phantom cohorts of one seed share their first patients (the key is seed and patient).
    import textwrap

    from octfw.cli.main import main

    eval_recipe = tmp_path / "eval.toml"
    eval_recipe.write_text(textwrap.dedent(f"""
        [run]
        device = "cpu"
        cache_dir = "{tmp_path / 'cache'}"

        [[evaluator]]
        name = "layer-segmentation"
        dataset = {{ name = "phantom-oct", family = "held-out", n_volumes = 4, seed = 1 }}
        test_dataset = {{ name = "phantom-oct", family = "held-out", n_volumes = 6, seed = 1 }}
    """), encoding="utf-8")
    assert main(["eval", _export(tmp_path), "--recipe", str(eval_recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "evaluator layer-segmentation: test_dataset shares 2 patients with dataset: 4 test volumes" in err
    assert err.count(" and ") == 2 and "s1-p0000" not in err  # a file of each side per patient, no key


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/accelerator_suite.sh "
                    "on a GPU machine)")
def test_the_evaluator_fine_tunes_on_a_cuda_encoder_as_on_the_cpu():
    # The frozen part, the decoder and the last block train on the encoder's device; the same fit on
    # the CPU and the GPU agrees to the nondeterminism of cuDNN's convolutions.
    dataset = ToyLayers(16)

    def fit(device: str) -> dict[str, float]:
        evaluator = _evaluator(dataset, epochs=8, fit_batch_size=4, blocks=1)
        return evaluator.score(evaluator.encode(_encoder(depth=2).to(device), device))

    scores = {device: fit(device) for device in ("cpu", "cuda")}
    assert scores["cuda"]["mean_dice"] > 0.85
    assert abs(scores["cuda"]["mean_dice"] - scores["cpu"]["mean_dice"]) < 0.03
    assert scores["cuda"]["trained_parameters"] == scores["cpu"]["trained_parameters"]


def test_on_an_xla_device_the_volumes_stay_on_the_host_and_go_to_the_device_a_batch_at_a_time():
    # torch_xla's CPU device, in a subprocess (importing torch_xla patches torch for the process):
    # the encoder and the fit run there, the encoded volumes, taps and labels stay on the host (a
    # cohort at the seeds' size would not fit on a device: 38 MB a volume), and the fit scores as
    # on the CPU.
    result = run_xla_script("layer_segmentation_fit.py")
    assert result["where"] == {"inputs": ["cpu"], "encoder": "xla"}
    assert result["selected_step"]["xla"] == result["selected_step"]["cpu"]
    assert abs(result["mean_dice"]["xla"] - result["mean_dice"]["cpu"]) < 1e-3
