"""Layer segmentation's metrics: Dice per layer, mean Dice and boundary error, with patient-bootstrap intervals.

Metrics (:func:`segmentation_counts`, :func:`segmentation_metrics`): Dice per
layer per volume (MONAI's ``DiceMetric``), averaged over volumes (nnU-Net's
convention; a layer absent from both prediction and truth of a volume leaves
that volume out of the layer's mean, which neither of MONAI's ``ignore_empty``
choices does); the mean Dice over the layers after the first (label 0, the
vitreous, is background and left out, as nnU-Net leaves out its background);
the boundary error: for the boundary above layer ``b`` and each A-scan (a
column along H), the boundary's position is the number of voxels labelled
below ``b`` (for layers ordered top to bottom, the first row of ``b`` or a
deeper layer), and the error is the absolute difference of the predicted and
the true position, in micrometres with the volume's axial spacing, averaged
over A-scans and volumes. 95 % intervals come from resampling whole patients.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch
from monai.metrics import DiceMetric

from octfw.evaluation.metrics import bootstrap_weights

__all__ = ["mean_dice", "segmentation_counts", "segmentation_metrics"]


def mean_dice(dice: np.ndarray) -> float:
    """Mean over the foreground layers of each layer's mean over volumes (``dice`` ``[N, K]``);
    a layer undefined in every volume is left out, and 0 when all are."""
    with warnings.catch_warnings():  # an all-NaN column is a layer nowhere: left out by design
        warnings.simplefilter("ignore", RuntimeWarning)
        value = np.nanmean(np.nanmean(dice[:, 1:], axis=0))
    return 0.0 if np.isnan(value) else float(value)


def _dice_per_layer(predicted: np.ndarray, truth: np.ndarray, classes: int) -> np.ndarray:
    """``[N, K]`` Dice of each layer in each volume by MONAI's ``DiceMetric`` on the label maps,
    NaN where the layer is neither predicted nor true. MONAI scores such a layer 1
    (``ignore_empty=False``) or leaves out every layer absent from the truth, even where it is
    predicted (``ignore_empty=True``); here, as in nnU-Net, a layer predicted where it is absent
    scores 0 and one absent from both is left out."""
    metric = DiceMetric(include_background=True, reduction="none", ignore_empty=False, num_classes=classes)
    as_maps = [torch.from_numpy(np.ascontiguousarray(a))[:, None] for a in (predicted, truth)]
    dice = metric(*as_maps).double().numpy()
    n = predicted.shape[0]
    for label in range(classes):
        present = ((predicted == label) | (truth == label)).reshape(n, -1).any(1)
        dice[~present, label] = np.nan
    return dice


def segmentation_counts(predicted: np.ndarray, truth: np.ndarray, classes: int) -> dict[str, np.ndarray]:
    """Per volume of ``predicted`` and ``truth`` (int ``[N, D, H, W]``): ``dice`` ``[N, K]`` (NaN
    where a layer is neither predicted nor true) and ``boundary`` ``[N, K - 1]``, the mean absolute
    difference (in voxels along H, per A-scan) of the boundary above layers 1 .. K-1."""
    n = predicted.shape[0]
    dice = _dice_per_layer(predicted, truth, classes)
    boundary = np.zeros((n, max(classes - 1, 0)))
    for label in range(1, classes):  # the boundary above `label`: voxels of each A-scan (D, W column) above it
        above_predicted = (predicted < label).sum(axis=2)
        above_true = (truth < label).sum(axis=2)
        boundary[:, label - 1] = np.abs(above_predicted - above_true).reshape(n, -1).mean(1)
    return {"dice": dice, "boundary": boundary}


def _weighted_nanmean(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``weights`` ``[B, N]`` over ``values`` ``[N, K]`` -> ``[B, K]``, NaN entries left out."""
    valid = ~np.isnan(values)
    total = weights @ valid.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (weights @ np.where(valid, values, 0.0)) / total, np.nan)


def _estimate(key: str, values: np.ndarray, resamples: int, out: dict[str, float], tail: str) -> None:
    if np.isnan(values[0]):
        return
    out[f"{key}{tail}"] = float(values[0])
    rest = values[1:]
    if resamples > 0 and np.count_nonzero(~np.isnan(rest)) > resamples / 2:
        low, high = np.nanpercentile(rest, [2.5, 97.5])
        out[f"{key}_ci_low{tail}"], out[f"{key}_ci_high{tail}"] = float(low), float(high)


def segmentation_metrics(
    predicted: np.ndarray,
    truth: np.ndarray,
    layer_keys: Sequence[str],
    axial_spacing_um: np.ndarray,
    domains: Sequence[str],
    *,
    prefix: str = "",
    groups: Sequence[object] | None = None,
    bootstrap: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """``<prefix>mean_dice``, ``<prefix>dice_<layer>`` per layer, ``<prefix>boundary_error_um`` (mean
    over boundaries) and ``<prefix>boundary_error_um_<upper>_<lower>`` per boundary; each with its
    patient-bootstrap 95 % interval (``_ci_low``/``_ci_high``) when ``bootstrap`` > 0, overall and
    per domain (``/<domain>``). ``axial_spacing_um`` is each volume's H spacing in µm."""
    counts = segmentation_counts(predicted, truth, len(layer_keys))
    boundary_um = counts["boundary"] * np.asarray(axial_spacing_um, dtype=np.float64)[:, None]
    domain_array = np.asarray(list(domains))
    group_array = None if groups is None else np.asarray([str(g) for g in groups])
    rng = np.random.default_rng(seed)
    out: dict[str, float] = {}
    subsets = [("", np.ones(len(domain_array), dtype=bool))]
    subsets += [(f"/{d}", domain_array == d) for d in sorted(set(domain_array.tolist()))]
    for tail, keep in subsets:
        weights = np.ones((1, int(keep.sum())))
        if bootstrap > 0:
            weights = np.concatenate([weights, bootstrap_weights(int(keep.sum()), bootstrap, rng,
                                                                 None if group_array is None else group_array[keep])])
        dice = _weighted_nanmean(counts["dice"][keep], weights)  # [B, K]
        errors = _weighted_nanmean(boundary_um[keep], weights)  # [B, K - 1]
        with warnings.catch_warnings():  # a row of NaN (nothing defined) gives NaN by design
            warnings.simplefilter("ignore", RuntimeWarning)
            _estimate(f"{prefix}mean_dice", np.nanmean(dice[:, 1:], axis=1), bootstrap, out, tail)
            _estimate(f"{prefix}boundary_error_um", np.nanmean(errors, axis=1), bootstrap, out, tail)
        for k, key in enumerate(layer_keys):
            _estimate(f"{prefix}dice_{key}", dice[:, k], bootstrap, out, tail)
        for k in range(1, len(layer_keys)):
            _estimate(f"{prefix}boundary_error_um_{layer_keys[k - 1]}_{layer_keys[k]}", errors[:, k - 1],
                      bootstrap, out, tail)
    return out

