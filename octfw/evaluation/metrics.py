"""Classification metrics on the host, overall and per domain, with bootstrap intervals.

Plain numpy on a few hundred to a few thousand predictions. A metric that is
undefined for a subset (AUROC or AUPRC where the subset holds one class only)
is left out rather than logged as NaN.

AUROC and AUPRC are computed from per-volume *weights*: all ones for the
point estimate, and the number of times a volume was drawn for a bootstrap
resample. One weighted formula then serves both, vectorised over the
resamples, and ties are handled exactly in each:

- AUROC is the Mann-Whitney statistic, P(score of a positive > score of a
  negative) with ties counted half.
- AUPRC is average precision: the precision at each distinct score threshold
  (from the highest down), weighted by the recall gained there. It is the
  step-wise area, not the trapezoid, which overstates the area between
  distant thresholds.

Two classes: the higher label is the positive one. More classes: the macro
average over classes of one-vs-rest AUROC and AUPRC, over the classes the
classifier knows that have both positives and negatives in the subset.

The bootstrap draws volumes with replacement, or whole patients when groups
are given (volumes of one patient are correlated, so resampling them one by
one would make the interval too narrow). The 95 % interval is the 2.5th and
97.5th percentile of the resampled values; resamples holding one class only
are dropped, and no interval is given when half of them or more are.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

__all__ = ["accuracy", "balanced_accuracy", "auroc", "auprc", "one_vs_rest", "bootstrap_weights",
           "classification_metrics", "paired_difference", "overlap_metrics",
           "overlap_difference"]


def accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    return float(np.mean(labels == predicted))


def balanced_accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    """Mean recall over the classes present in ``labels`` (chance = 1 / classes)."""
    recalls = [np.mean(predicted[labels == c] == c) for c in np.unique(labels)]
    return float(np.mean(recalls))


def _by_score(positive: np.ndarray, scores: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positive and negative weight at each distinct score, ascending: two ``[B, V]`` arrays."""
    _values, inverse = np.unique(scores, return_inverse=True)
    n_values = int(inverse.max()) + 1
    rows = weights.shape[0]
    # One bincount over all rows at once: row r's bins are offset by r x V.
    bins = (inverse[None, :] + n_values * np.arange(rows)[:, None]).ravel()

    def total(mask: np.ndarray) -> np.ndarray:
        return np.bincount(bins, weights=(weights * mask[None, :]).ravel(),
                           minlength=rows * n_values).reshape(rows, n_values)

    return total(positive), total(~positive)


def _weighted_auroc(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    n_pos, n_neg = pos.sum(axis=1), neg.sum(axis=1)
    negatives_below = np.cumsum(neg, axis=1) - neg
    u = (pos * (negatives_below + 0.5 * neg)).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        area = u / (n_pos * n_neg)
    return np.where((n_pos > 0) & (n_neg > 0), area, np.nan)


def _weighted_auprc(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    n_pos, n_neg = pos.sum(axis=1), neg.sum(axis=1)
    pos_down, neg_down = pos[:, ::-1], neg[:, ::-1]  # thresholds from the highest score down
    true_pos, false_pos = np.cumsum(pos_down, axis=1), np.cumsum(neg_down, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(true_pos > 0, true_pos / (true_pos + false_pos), 0.0)
        area = (pos_down * precision).sum(axis=1) / n_pos
    # Like AUROC, undefined with one class: with no negative it is 1 whatever the scores.
    return np.where((n_pos > 0) & (n_neg > 0), area, np.nan)


def _single(value: np.ndarray) -> float | None:
    return None if np.isnan(value[0]) else float(value[0])


def auroc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Area under the ROC curve for binary ``labels`` (1 = positive) and scores of
    the positive class; tied scores count half. None when only one class is present."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    return _single(_weighted_auroc(*_by_score(labels == 1, scores, np.ones((1, len(labels))))))


def auprc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Average precision for binary ``labels`` (1 = positive) and scores of the
    positive class. None when only one class is present."""
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float64)
    return _single(_weighted_auprc(*_by_score(labels == 1, scores, np.ones((1, len(labels))))))


def one_vs_rest(labels: np.ndarray, probabilities: np.ndarray, classes: np.ndarray,
                weights: np.ndarray) -> dict[str, np.ndarray]:
    """``{"auroc": [B], "auprc": [B]}`` for each row of ``weights`` (``[B, N]``).

    Two classes: the higher one is positive. More: the macro average over the
    classes that have positives and negatives in the unweighted subset; a
    weighted row that loses one of them is NaN, so every value averages the
    same classes. All NaN when no class qualifies.
    """
    if len(classes) == 2:
        pos, neg = _by_score(labels == classes[1], probabilities[:, 1], weights)
        return {"auroc": _weighted_auroc(pos, neg), "auprc": _weighted_auprc(pos, neg)}
    areas: dict[str, list[np.ndarray]] = {"auroc": [], "auprc": []}
    for column, label in enumerate(classes):
        positive = labels == label
        if positive.all() or not positive.any():
            continue
        pos, neg = _by_score(positive, probabilities[:, column], weights)
        areas["auroc"].append(_weighted_auroc(pos, neg))
        areas["auprc"].append(_weighted_auprc(pos, neg))
    rows = weights.shape[0]
    # np.mean over classes keeps a NaN: a resample missing one class is dropped whole.
    return {key: np.mean(values, axis=0) if values else np.full(rows, np.nan) for key, values in areas.items()}


def bootstrap_weights(n: int, resamples: int, rng: np.random.Generator,
                      groups: Sequence[object] | None = None) -> np.ndarray:
    """``[resamples, n]`` draw counts: volumes, or whole groups (patients), with replacement."""
    if groups is None:
        return rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)
    _keys, group_of = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)
    n_groups = int(group_of.max()) + 1
    drawn = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=resamples)
    return drawn[:, group_of].astype(np.float64)


def _metrics(labels: np.ndarray, probabilities: np.ndarray, classes: np.ndarray,
             groups: Sequence[object] | None, resamples: int, rng: np.random.Generator) -> dict[str, float]:
    predicted = classes[np.argmax(probabilities, axis=1)]
    out = {"accuracy": accuracy(labels, predicted), "balanced_accuracy": balanced_accuracy(labels, predicted)}
    if len(classes) < 2:
        return out
    weights = _point_and_resamples(len(labels), resamples, rng, groups)
    for key, values in one_vs_rest(labels, probabilities, classes, weights).items():
        out.update(_estimate(key, values, resamples))
    return out


def _point_and_resamples(n: int, resamples: int, rng: np.random.Generator,
                         groups: Sequence[object] | None) -> np.ndarray:
    """``[1 + resamples, n]`` weights: every volume once (the point estimate), then the bootstrap draws."""
    weights = np.ones((1, n))
    if resamples > 0:
        weights = np.concatenate([weights, bootstrap_weights(n, resamples, rng, groups)])
    return weights


def _estimate(key: str, values: np.ndarray, resamples: int) -> dict[str, float]:
    """``key`` (the point estimate ``values[0]``) and, when more than half the resamples have a
    value, ``key_ci_low`` / ``key_ci_high`` (their 2.5 and 97.5 percentiles); nothing for NaN."""
    if np.isnan(values[0]):
        return {}
    out = {key: float(values[0])}
    resampled = values[1:]
    if resamples > 0 and np.count_nonzero(~np.isnan(resampled)) > resamples / 2:
        low, high = np.nanpercentile(resampled, [2.5, 97.5])
        out[f"{key}_ci_low"], out[f"{key}_ci_high"] = float(low), float(high)
    return out


def _weighted_accuracies(labels: np.ndarray, probabilities: np.ndarray, classes: np.ndarray,
                         weights: np.ndarray) -> dict[str, np.ndarray]:
    """``{"accuracy": [B], "balanced_accuracy": [B]}`` for each row of ``weights`` (``[B, N]``):
    the weighted share of volumes predicted right, and the mean over the classes a row holds of
    their weighted recall (:func:`balanced_accuracy` for all-one weights)."""
    correct = (classes[np.argmax(probabilities, axis=1)] == labels).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        recalls = []
        for label in np.unique(labels):
            members = (labels == label).astype(np.float64)
            held = weights @ members
            recalls.append(np.where(held > 0, (weights @ (correct * members)) / held, np.nan))
        with warnings.catch_warnings():  # a row holding none of a class leaves it out
            warnings.simplefilter("ignore", RuntimeWarning)
            balanced = np.nanmean(np.stack(recalls), axis=0)
        return {"accuracy": (weights @ correct) / weights.sum(axis=1), "balanced_accuracy": balanced}


def paired_difference(labels: np.ndarray, first: np.ndarray, second: np.ndarray, classes: np.ndarray, *,
                      groups: Sequence[object] | None = None, bootstrap: int = 0, seed: int = 0) -> dict[str, float]:
    """``accuracy``, ``balanced_accuracy``, ``auroc`` and ``auprc`` of ``first`` minus those of
    ``second`` (two models' test probabilities ``[N, K]`` on the same volumes), with ``_ci_low`` /
    ``_ci_high``: the 95 % interval of the difference over ``bootstrap`` resamples (whole
    ``groups``, patients, when given), each drawn once and scored for both models (a paired
    bootstrap: what the two share cancels, so the interval is that of the gain, not of two
    separate estimates).

    ``first`` and ``second`` may hold several fits each, ``[F, N, K]`` (the draws of ``octfw eval
    --shots``, fit ``f`` of both on the same train volumes): the difference is then the mean over
    fits, every fit scored on the same resamples, so the interval is that of the mean gain over
    test patients (not over the choice of the train volumes)."""
    if len(classes) < 2:
        return {}
    labels = np.asarray(labels)
    firsts, seconds = (np.asarray(p, dtype=np.float64) for p in (first, second))
    if firsts.ndim == 2:
        firsts, seconds = firsts[None], seconds[None]
    group_array = None if groups is None else np.asarray([str(g) for g in groups])
    weights = _point_and_resamples(len(labels), bootstrap, np.random.default_rng(seed), group_array)
    gains: dict[str, list[np.ndarray]] = {}
    for a_probabilities, b_probabilities in zip(firsts, seconds):
        a = {**_weighted_accuracies(labels, a_probabilities, classes, weights),
             **one_vs_rest(labels, a_probabilities, classes, weights)}
        b = {**_weighted_accuracies(labels, b_probabilities, classes, weights),
             **one_vs_rest(labels, b_probabilities, classes, weights)}
        for key in a:
            gains.setdefault(key, []).append(a[key] - b[key])
    out: dict[str, float] = {}
    for key, values in gains.items():
        out.update(_estimate(key, np.mean(values, axis=0), bootstrap))
    return out


def classification_metrics(
    labels: np.ndarray,
    probabilities: np.ndarray,
    classes: np.ndarray,
    domains: Sequence[str],
    *,
    groups: Sequence[object] | None = None,
    bootstrap: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """``accuracy``, ``balanced_accuracy``, ``auroc`` and ``auprc`` (with
    ``<metric>_ci_low`` / ``_ci_high`` when ``bootstrap`` > 0), then the same
    per domain as ``accuracy/<domain>``.

    ``probabilities`` is ``[N, K]`` over ``classes`` (sorted labels seen in
    training); the prediction is the most probable class, ties to the lower
    one. ``groups`` (one key per volume, e.g. a patient) makes the bootstrap
    draw whole groups. The resamples come from a generator seeded with
    ``seed``, overall first, then per domain in sorted order: the same inputs
    give the same intervals.
    """
    labels = np.asarray(labels)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    domains = np.asarray(list(domains))
    group_array = None if groups is None else np.asarray([str(g) for g in groups])
    rng = np.random.default_rng(seed)
    out = _metrics(labels, probabilities, classes, group_array, bootstrap, rng)
    for domain in sorted(set(domains.tolist())):
        keep = domains == domain
        subset_groups = None if group_array is None else group_array[keep]
        for key, value in _metrics(labels[keep], probabilities[keep], classes, subset_groups, bootstrap,
                                   rng).items():
            out[f"{key}/{domain}"] = value
    return out


def _overlaps(intersection: np.ndarray, predicted: np.ndarray, target: np.ndarray,
              weights: np.ndarray) -> dict[str, np.ndarray]:
    """Pooled Dice and IoU for each row of ``weights`` (``[B, N]``): NaN where nothing is
    predicted or true in the row (the overlap of two empty sets is undefined)."""
    inter, pred, true = (weights @ np.asarray(a, dtype=np.float64) for a in (intersection, predicted, target))
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = np.where(pred + true > 0, 2 * inter / (pred + true), np.nan)
        iou = np.where(pred + true - inter > 0, inter / (pred + true - inter), np.nan)
    return {"dice": dice, "iou": iou}


def overlap_metrics(
    intersection: Sequence[float],
    predicted: Sequence[float],
    target: Sequence[float],
    domains: Sequence[str],
    *,
    prefix: str = "",
    groups: Sequence[object] | None = None,
    bootstrap: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """``<prefix>dice`` and ``<prefix>iou`` of a segmentation, pooled over volumes, with
    ``_ci_low`` / ``_ci_high`` when ``bootstrap`` > 0, then the same per domain
    (``<prefix>dice/<domain>``).

    Per volume: the count of voxels (or tokens) both predicted and true, predicted,
    and true. Pooled means summed over the volumes before the ratio, 2 sum(I) /
    (sum(P) + sum(T)), so a volume without the finding counts through its false
    positives, and an all-background prediction scores 0. ``groups`` (one key per
    volume, e.g. its patient) makes the bootstrap draw whole patients; the resamples
    come from a generator seeded with ``seed``, overall first, then per domain in
    sorted order. A value is left out where it is undefined (nothing predicted and
    nothing true).
    """
    arrays = [np.asarray(a, dtype=np.float64) for a in (intersection, predicted, target)]
    domain_array = np.asarray(list(domains))
    group_array = None if groups is None else np.asarray([str(g) for g in groups])
    rng = np.random.default_rng(seed)
    out: dict[str, float] = {}
    subsets = [("", np.ones(len(arrays[0]), dtype=bool))]
    subsets += [(f"/{d}", domain_array == d) for d in sorted(set(domain_array.tolist()))]
    for tail, keep in subsets:
        weights = _point_and_resamples(int(keep.sum()), bootstrap, rng,
                                       None if group_array is None else group_array[keep])
        for key, values in _overlaps(*(a[keep] for a in arrays), weights).items():
            for name, value in _estimate(f"{prefix}{key}", values, bootstrap).items():
                out[f"{name}{tail}"] = value
    return out


def overlap_difference(
    first: np.ndarray,
    second: np.ndarray,
    domains: Sequence[str],
    *,
    prefix: str = "",
    groups: Sequence[object] | None = None,
    bootstrap: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """``<prefix>dice`` and ``<prefix>iou`` (:func:`overlap_metrics`) of ``first`` minus ``second``,
    two networks' per-volume counts ``[N, 3]`` (both, predicted, true) on the same test volumes,
    with a paired interval: each resample (whole ``groups`` when given; the resamples
    :func:`overlap_metrics` draws for the same ``seed``) scored for both; overall and per domain.
    ``[F, N, 3]`` counts hold ``F`` paired fits (``octfw eval --shots`` draws): the mean over fits."""
    a, b = (np.asarray(x, dtype=np.float64) for x in (first, second))
    if a.ndim == 2:
        a, b = a[None], b[None]
    domain_array = np.asarray(list(domains))
    group_array = None if groups is None else np.asarray([str(g) for g in groups])
    rng = np.random.default_rng(seed)
    out: dict[str, float] = {}
    subsets = [("", np.ones(a.shape[1], dtype=bool))]
    subsets += [(f"/{d}", domain_array == d) for d in sorted(set(domain_array.tolist()))]
    for tail, keep in subsets:
        weights = _point_and_resamples(int(keep.sum()), bootstrap, rng,
                                       None if group_array is None else group_array[keep])
        gains: dict[str, list[np.ndarray]] = {}
        for fit_a, fit_b in zip(a, b):
            mine, theirs = (_overlaps(*counts[keep].T, weights) for counts in (fit_a, fit_b))
            for key in mine:
                gains.setdefault(key, []).append(mine[key] - theirs[key])
        for key, values in gains.items():
            for name, value in _estimate(f"{prefix}{key}", np.mean(values, axis=0), bootstrap).items():
                out[f"{name}{tail}"] = value
    return out
