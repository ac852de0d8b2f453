"""Collapse signals every model reports about the network it exports.

:func:`embedding_std`, :func:`effective_rank` and :func:`position_share` turn
a batch of tokens ``[..., E]`` into one float32 device scalar each. A model
reports them as the metrics ``target_std``, ``effective_rank`` and
``position_share`` of its target encoder's tokens (the network octfw exports
and probes), which the ``collapse`` guard, ``octfw plot`` and the benchmarks
read under those names. :func:`rank_gram` is the Gram matrix of a fixed-size
subset of those tokens, which the engine copies to the host on log steps
only, where :func:`spectrum_metrics` computes RankMe from its eigenvalues: a
decomposition on the device would synchronise CUDA with the host every step
(documented for ``torch.linalg``) and is slow on TPUs. A Gram matrix rather
than the tokens: under SPMD its matrix product reduces partial sums across
devices, while the tokens themselves would be gathered every step.

Hot path: the device functions run every step. They never read a tensor on
the host, never branch on tensor values, and take fixed-size slices only
(XLA-friendly).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

__all__ = [
    "health_metrics",
    "position_share",
    "rank_sample",
    "rank_gram",
    "rankme",
    "spectrum_metrics",
    "RANK_TOKENS",
    "COLLAPSED_SPREAD",
    "AUTOCAST_DEVICE_TYPES",
    "embedding_std",
    "effective_rank",
    "effective_rank_ceiling",
]

#: Tokens :func:`effective_rank` looks at: a fixed-size, evenly strided subset
#: of the batch's target tokens, so its cost is bounded and its shape static.
RANK_TOKENS = 512

#: Mean squared distance of unit embeddings from their centroid below which
#: :func:`effective_rank` reports full collapse (rank 1) instead of the rank
#: of rounding noise.
COLLAPSED_SPREAD = 1e-6

#: Device types with an autocast to leave; others (``meta``, in shape-only
#: memory and FLOP estimates) have none.
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xla", "xpu", "mps", "hpu")


def embedding_std(features: torch.Tensor) -> torch.Tensor:
    """Collapse signal: the std across all tokens of L2-normalised embeddings,
    averaged over feature channels. ``[..., E]`` -> scalar float32.

    About ``1 / sqrt(E)`` for embeddings spread over the sphere; near 0 when
    every token maps to the same vector (representation collapse).
    """
    unit = F.normalize(features.detach().float().reshape(-1, features.shape[-1]), dim=-1)
    return unit.std(dim=0, correction=0).mean()


def _without_autocast(device_type: str):
    """A context that runs matmuls in the dtype of their inputs (float32 here).

    A membership test rather than ``torch.amp.is_autocast_available``: that
    call breaks a ``torch.compile`` graph, and the code after the break then
    recompiled on every update step (engine.compile = true).
    """
    if device_type in AUTOCAST_DEVICE_TYPES:
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def effective_rank(features: torch.Tensor, max_tokens: int = RANK_TOKENS) -> torch.Tensor:
    """Collapse signal: how many directions the embeddings really use. ``[..., E]`` -> scalar float32.

    On an evenly strided subset of at most ``max_tokens`` tokens, L2-normalised
    and centred, this is the participation ratio of the covariance spectrum,
    ``(sum(l))**2 / sum(l**2)`` over its eigenvalues ``l``: the exponential of
    the order-2 Renyi entropy of the normalised eigenvalues. It is about ``k``
    when the embeddings spread evenly over ``k`` directions (at most
    ``min(tokens - 1, E)``) and 1 when they have collapsed onto one direction
    or one point. Computed in float32 with two matrix products and no
    decomposition: eigen/singular value solvers are slow on TPUs, and on CUDA
    ``torch.linalg.svdvals``/``eigvalsh`` synchronise the device with the CPU
    (documented), a sync every step.
    """
    x = rank_sample(features, max_tokens)
    with _without_autocast(x.device.type):
        unit = F.normalize(x, dim=-1)
        centred = unit - unit.mean(dim=0, keepdim=True)
        # The smaller Gram matrix has the same non-zero eigenvalues.
        if centred.shape[0] <= centred.shape[1]:
            gram = centred @ centred.T
        else:
            gram = centred.T @ centred
        trace = torch.diagonal(gram).sum()  # sum of the eigenvalues
        squares = gram.square().sum()  # sum of the squared eigenvalues
        ratio = trace.square() / squares.clamp_min(torch.finfo(torch.float32).tiny)
        collapsed = trace <= COLLAPSED_SPREAD * centred.shape[0]
        return torch.where(collapsed, torch.ones_like(ratio), ratio)


def rank_sample(features: torch.Tensor, max_tokens: int = RANK_TOKENS) -> torch.Tensor:
    """An evenly strided subset of at most ``max_tokens`` of the tokens ``[..., E]``, float32
    ``[K, E]``: what the rank metrics look at, so their cost is bounded and the shape static."""
    x = features.detach().reshape(-1, features.shape[-1])
    stride = max(1, x.shape[0] // max_tokens)  # Python ints: a static slice
    return x[::stride][:max_tokens].float()


def position_share(tokens: torch.Tensor, positions: torch.Tensor | None = None,
                   num_positions: int | None = None) -> torch.Tensor:
    """The share of the tokens' variance that their position on the patch grid explains:
    ``[B, n, E]`` tokens (and int64 ``[B, n]`` positions among ``num_positions``; None:
    token ``i`` is at position ``i`` in every sample) -> scalar float32 in [0, 1].

    One minus the within-position variance over the total variance, each divided by its
    degrees of freedom (an adjusted R^2, so that a batch of two samples does not read as
    position-dominated by chance). Near 1 when a token says where it is and little about
    the volume (the position embedding dominates); near 0 when the content does. NaN when
    no position holds two tokens (batch of one). Fixed shapes: sums per position with
    ``index_add``, no boolean indexing, no host read.
    """
    x = tokens.detach().float()
    batch, n, width = x.shape
    if positions is None:
        positions, num_positions = torch.arange(n, device=x.device).expand(batch, n), n
    flat = positions.reshape(-1)
    with _without_autocast(x.device.type):
        x = x.reshape(-1, width)
        x = x - x.mean(dim=0, keepdim=True)
        sums = x.new_zeros(num_positions, width).index_add_(0, flat, x)
        counts = x.new_zeros(num_positions).index_add_(0, flat, torch.ones_like(flat, dtype=x.dtype))
        total = x.square().sum()
        within = total - (sums.square().sum(dim=1) / counts.clamp_min(1.0)).sum()
        within_dof = flat.numel() - (counts > 0).sum().to(x.dtype)
        within_mean = within / within_dof  # inf or NaN when every position holds one token
        total_mean = total / max(flat.numel() - 1, 1)
        share = (1.0 - within_mean / total_mean.clamp_min(torch.finfo(torch.float32).tiny)).clamp(0.0, 1.0)
        return torch.where(within_dof > 0, share, torch.full_like(share, float("nan")))


def rank_gram(features: torch.Tensor, max_tokens: int = RANK_TOKENS) -> torch.Tensor:
    """The Gram matrix of :func:`rank_sample` (the tokens as they are: not centred, not normalised),
    float32, the smaller of ``[K, K]`` and ``[E, E]``: its eigenvalues are the squared singular values
    of the sample, what :func:`rankme` reads."""
    x = rank_sample(features, max_tokens)
    with _without_autocast(x.device.type):
        return x @ x.T if x.shape[0] <= x.shape[1] else x.T @ x


def rankme(gram: "np.ndarray") -> float:
    """RankMe (Garrido et al. 2023) of tokens given by their Gram matrix (:func:`rank_gram`): the
    exponential of the Shannon entropy of the normalised singular values, ``exp(-sum p log p)``
    with ``p = s / sum(s) + 1e-7``. Between 1 and the Gram matrix's size (``min(K, E)``); the rank
    measure papers report, which the participation ratio (:func:`effective_rank`) understates for
    spread spectra."""
    import numpy as np

    gram = np.asarray(gram, dtype=np.float64)
    if not np.isfinite(gram).all():
        return float("nan")
    eigen = np.linalg.eigvalsh((gram + gram.T) / 2)
    # The Gram matrix was summed in float32: eigenvalues within its rounding of the largest are
    # noise, and their square roots would each add to the entropy (a rank-1 sample read 1.03).
    eigen[eigen < eigen.max() * len(gram) * np.finfo(np.float32).eps] = 0.0
    singular = np.sqrt(eigen)
    if singular.sum() <= 0:
        return float("nan")
    p = singular / singular.sum() + 1e-7
    return float(np.exp(-(p * np.log(p)).sum()))


def spectrum_metrics(gram: "np.ndarray") -> dict[str, float]:
    """The metrics of a host copy of :func:`rank_gram`: ``rankme`` and its maximum ``rankme_max``
    (the Gram matrix's size, ``min(K, E)``), which ``octfw plot`` draws it against."""
    return {"rankme": rankme(gram), "rankme_max": float(len(gram))}


def effective_rank_ceiling(features: torch.Tensor, max_tokens: int = RANK_TOKENS) -> int:
    """The largest :func:`effective_rank` ``features`` of this shape can have: the tokens it
    keeps, less one (they are centred), or the width, whichever is smaller. From shapes
    alone: no device work."""
    rows, width = math.prod(features.shape[:-1]), features.shape[-1]
    kept = min(rows, max_tokens)  # the strided subset has at least max_tokens rows when rows do
    return max(1, min(kept - 1, width))


def health_metrics(features: torch.Tensor, predicted: torch.Tensor, positions: torch.Tensor | None = None,
                   num_positions: int | None = None) -> dict[str, torch.Tensor]:
    """The metrics every model reports and the ``collapse`` guard, ``octfw plot`` and the
    benchmarks read: ``target_std``, ``effective_rank`` and ``position_share`` of the
    ``features`` ``[B, n, E]`` of the network octfw exports (at grid ``positions``, see
    :func:`position_share`), ``pred_std`` of what the model ``predicted``, and
    ``effective_rank_max``, the rank's ceiling for these shapes (a plot shows the rank
    against it: 5 of 63 is not 5 of 6). Device scalars; the ceiling is a filled constant
    (no copy from the host, and the same value every step: no new XLA graph)."""
    return {"target_std": embedding_std(features), "pred_std": embedding_std(predicted),
            "effective_rank": effective_rank(features),
            "effective_rank_max": features.new_full((), float(effective_rank_ceiling(features)),
                                                    dtype=torch.float32),
            "position_share": position_share(features, positions, num_positions)}
