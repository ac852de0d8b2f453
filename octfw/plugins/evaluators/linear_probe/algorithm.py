"""Multinomial logistic regression in torch, for probing frozen features.

Features are standardised with the train split's mean and standard
deviation; the weights start at zero and full-batch LBFGS with a strong
Wolfe line search minimises mean cross-entropy plus ``l2 / 2 x |W|^2``.
The objective is convex and nothing is random, so the same features give
the same probe.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

__all__ = ["LinearProbe", "fit_linear_probe"]


@attrs.frozen(eq=False)
class LinearProbe:
    mean: torch.Tensor  #: [E] train-split feature mean
    scale: torch.Tensor  #: [E] train-split feature standard deviation (floored)
    weight: torch.Tensor  #: [E, K]
    bias: torch.Tensor  #: [K]

    def probabilities(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` features -> ``[N, K]`` class probabilities."""
        x = (features.float() - self.mean) / self.scale
        return torch.softmax(x @ self.weight + self.bias, dim=1)


def fit_linear_probe(
    features: torch.Tensor, targets: torch.Tensor, n_classes: int, *, l2: float = 1e-2, max_iter: int = 200
) -> LinearProbe:
    """Fit on ``[N, E]`` float features and ``[N]`` class indices in ``[0, n_classes)``.

    Runs with gradients enabled whatever the caller's mode (evaluators are
    called under ``torch.no_grad``); only the probe's own tensors get them.
    """
    features = features.detach().float()
    mean = features.mean(dim=0)
    # A constant feature (a dead channel) is left at 0 instead of blowing up.
    scale = features.std(dim=0, correction=0).clamp_min(1e-6)
    x = (features - mean) / scale
    y = targets.to(device=features.device, dtype=torch.long)
    weight = torch.zeros(features.shape[1], n_classes, device=features.device, requires_grad=True)
    bias = torch.zeros(n_classes, device=features.device, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iter, history_size=20,
                                  tolerance_grad=1e-9, tolerance_change=1e-12,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + 0.5 * l2 * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return LinearProbe(mean, scale, weight.detach(), bias.detach())
