"""k-nearest neighbours by cosine similarity, for probing frozen features.

Features are centred on the train split's mean before the cosine: mean-pooled
transformer features share a large common direction which would otherwise
dominate every similarity. Neighbours are ranked with a stable sort, so ties
resolve by train order and the result is deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["knn_probabilities"]


def knn_probabilities(
    train_features: torch.Tensor,
    train_targets: torch.Tensor,
    test_features: torch.Tensor,
    n_classes: int,
    *,
    k: int = 10,
    weighting: str = "similarity",
    temperature: float = 0.07,
) -> torch.Tensor:
    """``[M, K]`` vote shares of each test sample's ``k`` nearest train samples.

    ``weighting``: ``"uniform"`` (one vote each) or ``"similarity"`` (a vote
    weighs ``exp(cosine / temperature)``).
    """
    if weighting not in ("uniform", "similarity"):
        raise ValueError(f"weighting must be 'uniform' or 'similarity', got {weighting!r}")
    mean = train_features.float().mean(dim=0)
    train = F.normalize(train_features.float() - mean, dim=1)
    test = F.normalize(test_features.float() - mean, dim=1)
    similarity = test @ train.T  # [M, N]
    k = min(k, train.shape[0])
    nearest = torch.sort(similarity, dim=1, descending=True, stable=True).indices[:, :k]
    near_similarity = similarity.gather(1, nearest)
    near_targets = train_targets.to(device=similarity.device, dtype=torch.long)[nearest]
    if weighting == "uniform":
        weights = torch.ones_like(near_similarity)
    else:
        weights = torch.exp((near_similarity - 1.0) / temperature)  # shifted by the max cosine: no overflow
    votes = torch.zeros(test.shape[0], n_classes, device=similarity.device)
    votes.scatter_add_(1, near_targets, weights)
    return votes / votes.sum(dim=1, keepdim=True)
