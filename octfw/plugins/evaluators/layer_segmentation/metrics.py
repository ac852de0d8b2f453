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
the true position, in rows of the prepared volume and in micrometres with the
volume's axial spacing (where known), averaged over A-scans and volumes. 95 %
intervals come from resampling whole patients; the difference of two networks
(:func:`segmentation_difference`) scores both on the same resamples (paired).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch
from monai.metrics import DiceMetric

from octfw.evaluation.metrics import bootstrap_weights

__all__ = ["mean_dice", "segmentation_counts", "per_volume", "segmentation_metrics", "volume_metrics",
           "segmentation_difference"]


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


def per_volume(predicted: np.ndarray, truth: np.ndarray, classes: int,
               axial_spacing_um: np.ndarray) -> dict[str, np.ndarray]:
    """What the metrics are made of, per test volume: ``dice`` ``[N, K]``, ``boundary_rows`` and
    ``boundary_um`` ``[N, K - 1]`` (the boundary error in rows of the prepared volume, and times
    each volume's axial spacing in µm: NaN where the spacing is not known)."""
    counts = segmentation_counts(predicted, truth, classes)
    spacing = np.asarray(axial_spacing_um, dtype=np.float64)[:, None]
    return {"dice": counts["dice"], "boundary_rows": counts["boundary"], "boundary_um": counts["boundary"] * spacing}


def _resampled(volumes: dict[str, np.ndarray], layer_keys: Sequence[str], weights: np.ndarray,
               prefix: str) -> dict[str, np.ndarray]:
    """``{metric: [B]}`` of one fit's per-volume values for each row of ``weights`` ``[B, N]``."""
    dice = _weighted_nanmean(volumes["dice"], weights)  # [B, K]
    out: dict[str, np.ndarray] = {}
    with warnings.catch_warnings():  # a row of NaN (nothing defined) gives NaN by design
        warnings.simplefilter("ignore", RuntimeWarning)
        out[f"{prefix}mean_dice"] = np.nanmean(dice[:, 1:], axis=1)
        errors = {unit: _weighted_nanmean(volumes[f"boundary_{unit}"], weights) for unit in ("um", "rows")}
        for unit, values in errors.items():
            out[f"{prefix}boundary_error_{unit}"] = np.nanmean(values, axis=1)
    for k, key in enumerate(layer_keys):
        out[f"{prefix}dice_{key}"] = dice[:, k]
    for unit, values in errors.items():
        for k in range(1, len(layer_keys)):
            out[f"{prefix}boundary_error_{unit}_{layer_keys[k - 1]}_{layer_keys[k]}"] = values[:, k - 1]
    return out


def _summarise(fits: Sequence[dict[str, np.ndarray]], layer_keys: Sequence[str], domains: Sequence[str],
               prefix: str, groups: Sequence[object] | None, bootstrap: int, seed: int,
               baseline: Sequence[dict[str, np.ndarray]] | None = None) -> dict[str, float]:
    """Each metric's mean over ``fits`` (per-volume values of fits on the same test volumes), minus
    that of ``baseline`` when given (fit ``f`` of both paired), with a 95 % interval over the same
    resamples of whole patients for all of them; overall and per domain (``/<domain>``)."""
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
        values: dict[str, list[np.ndarray]] = {}
        for f, fit in enumerate(fits):
            found = _resampled({k: v[keep] for k, v in fit.items()}, layer_keys, weights, prefix)
            if baseline is not None:
                other = _resampled({k: v[keep] for k, v in baseline[f].items()}, layer_keys, weights, prefix)
                found = {key: found[key] - other[key] for key in found}
            for key, value in found.items():
                values.setdefault(key, []).append(value)
        for key, per_fit in values.items():
            _estimate(key, np.mean(per_fit, axis=0), bootstrap, out, tail)
    return out


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
    over boundaries) and ``<prefix>boundary_error_um_<upper>_<lower>`` per boundary, the same in rows
    of the prepared volume (``boundary_error_rows``, ...); each with its patient-bootstrap 95 %
    interval (``_ci_low``/``_ci_high``) when ``bootstrap`` > 0, overall and per domain
    (``/<domain>``). ``axial_spacing_um`` is each volume's H spacing in µm (NaN: not known, the
    volume left out of the errors in µm)."""
    return volume_metrics(per_volume(predicted, truth, len(layer_keys), axial_spacing_um), layer_keys, domains,
                          prefix=prefix, groups=groups, bootstrap=bootstrap, seed=seed)


def volume_metrics(volumes: dict[str, np.ndarray], layer_keys: Sequence[str], domains: Sequence[str], *,
                   prefix: str = "", groups: Sequence[object] | None = None, bootstrap: int = 0,
                   seed: int = 0) -> dict[str, float]:
    """:func:`segmentation_metrics` from the :func:`per_volume` values."""
    return _summarise([volumes], layer_keys, domains, prefix, groups, bootstrap, seed)


def segmentation_difference(
    first: dict[str, np.ndarray],
    second: dict[str, np.ndarray],
    layer_keys: Sequence[str],
    domains: Sequence[str],
    *,
    prefix: str = "",
    groups: Sequence[object] | None = None,
    bootstrap: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """The metrics of :func:`segmentation_metrics`, ``first`` minus ``second`` (:func:`per_volume`
    values of two networks on the same test volumes), with a paired patient-bootstrap interval:
    each resample scored for both. Values ``[F, N, ...]`` hold ``F`` fits (the draws of ``octfw eval
    --shots``, fit ``f`` of both on the same labelled volumes): the difference is the mean over
    fits, every fit on the same resamples."""
    def fits(values: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        arrays = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
        stacked = {k: v if v.ndim == 3 else v[None] for k, v in arrays.items()}
        return [{k: v[f] for k, v in stacked.items()} for f in range(len(stacked["dice"]))]

    return _summarise(fits(first), layer_keys, domains, prefix, groups, bootstrap, seed, baseline=fits(second))
