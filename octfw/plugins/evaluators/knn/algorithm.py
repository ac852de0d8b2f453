"""k-nearest neighbours by cosine similarity, for probing frozen features.

Features are centred on the train split's mean before the cosine: mean-pooled
transformer features share a large common direction which would otherwise
dominate every similarity. Neighbours are ranked with a stable sort, so ties
resolve by train order and the result is deterministic.

On tokens (:func:`knn_token_probabilities`) each token position is centred on
its train mean and each token normalised before they are concatenated, so the
cosine of two volumes is the mean of their tokens' cosines: every region
counts the same, however large its raw tokens. On the phantom cysts with a
random encoder this read 0.58-0.61 balanced accuracy at k 5-20, against
0.56-0.57 for the raw concatenation and 0.46-0.48 for the mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["knn_probabilities", "knn_token_probabilities"]


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
    mean = train_features.float().mean(dim=0)
    train = F.normalize(train_features.float() - mean, dim=1)
    test = F.normalize(test_features.float() - mean, dim=1)
    return _vote(test @ train.T, train_targets, n_classes, k, weighting, temperature)


def knn_token_probabilities(
    train_tokens: torch.Tensor,
    train_targets: torch.Tensor,
    test_tokens: torch.Tensor,
    n_classes: int,
    *,
    k: int = 10,
    weighting: str = "similarity",
    temperature: float = 0.07,
) -> torch.Tensor:
    """:func:`knn_probabilities` of ``[N, T, E]`` tokens: the cosine of two volumes is the mean
    cosine of their tokens at the same position, each centred on the train mean of its position."""
    mean = train_tokens.float().mean(dim=0)
    positions = train_tokens.shape[1]

    def unit(tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(tokens.float() - mean, dim=2).flatten(1) / positions ** 0.5

    return _vote(unit(test_tokens) @ unit(train_tokens).T, train_targets, n_classes, k, weighting, temperature)


def _vote(similarity: torch.Tensor, train_targets: torch.Tensor, n_classes: int, k: int, weighting: str,
          temperature: float) -> torch.Tensor:
    """``[M, K]`` vote shares of the ``k`` most similar train samples of each row of ``[M, N]``."""
    if weighting not in ("uniform", "similarity"):
        raise ValueError(f"weighting must be 'uniform' or 'similarity', got {weighting!r}")
    k = min(k, similarity.shape[1])
    nearest = torch.sort(similarity, dim=1, descending=True, stable=True).indices[:, :k]
    near_similarity = similarity.gather(1, nearest)
    near_targets = train_targets.to(device=similarity.device, dtype=torch.long)[nearest]
    if weighting == "uniform":
        weights = torch.ones_like(near_similarity)
    else:
        weights = torch.exp((near_similarity - 1.0) / temperature)  # shifted by the max cosine: no overflow
    votes = torch.zeros(similarity.shape[0], n_classes, device=similarity.device)
    votes.scatter_add_(1, near_targets, weights)
    return votes / votes.sum(dim=1, keepdim=True)
