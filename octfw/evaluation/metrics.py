"""Classification metrics on the host, overall and per domain.

Plain numpy on a few hundred predictions. A metric that is undefined for a
subset (AUROC where the subset holds one class only) is left out rather than
logged as NaN.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["accuracy", "balanced_accuracy", "auroc", "classification_metrics"]


def accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    return float(np.mean(labels == predicted))


def balanced_accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    """Mean recall over the classes present in ``labels`` (chance = 1 / classes)."""
    recalls = [np.mean(predicted[labels == c] == c) for c in np.unique(labels)]
    return float(np.mean(recalls))


def auroc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Area under the ROC curve for binary ``labels`` (1 = positive) and scores of
    the positive class: the Mann-Whitney U statistic with tied scores counted
    half. None when only one class is present."""
    positive = labels == 1
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    _values, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    # 1-based rank of each distinct score, averaged over its ties.
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0
    ranks = average_rank[inverse]
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _metrics(labels: np.ndarray, probabilities: np.ndarray, classes: np.ndarray) -> dict[str, float]:
    predicted = classes[np.argmax(probabilities, axis=1)]
    out = {"accuracy": accuracy(labels, predicted), "balanced_accuracy": balanced_accuracy(labels, predicted)}
    if len(classes) == 2 and classes[1] == 1:
        area = auroc(labels, probabilities[:, 1])
        if area is not None:
            out["auroc"] = area
    return out


def classification_metrics(
    labels: np.ndarray, probabilities: np.ndarray, classes: np.ndarray, domains: Sequence[str]
) -> dict[str, float]:
    """``accuracy``, ``balanced_accuracy`` and (binary 0/1 labels) ``auroc``, then
    the same per domain as ``accuracy/<domain>``.

    ``probabilities`` is ``[N, K]`` over ``classes`` (sorted labels seen in
    training); the prediction is the most probable class, ties to the lower one.
    """
    labels = np.asarray(labels)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    domains = np.asarray(list(domains))
    out = _metrics(labels, probabilities, classes)
    for domain in sorted(set(domains.tolist())):
        keep = domains == domain
        for key, value in _metrics(labels[keep], probabilities[keep], classes).items():
            out[f"{key}/{domain}"] = value
    return out
