"""Attentive probe: learned queries attend over frozen patch tokens; a linear classifier reads them.

A mean over tokens can wash out a small lesion that a few tokens see; a
query that learns *where* to look keeps it. This is the idea of the probe
V-JEPA reports, reduced to one cross-attention without the MLP after it.
For each grid member, with ``H`` attention heads of width ``d = E / H``:

- ``x = (tokens - mean) / std`` per channel, with the mean and standard
  deviation of every fit token (as the linear probe standardises its
  features). Frozen tokens share a large common direction, which a
  per-token layer norm keeps: with one instead, on the quickstart's
  encoder, members with learning rates up to 3e-3 still predicted one
  class after 100 epochs;
- head ``h`` weighs the tokens by ``a = softmax_t(q_h . x_t)``, ``q_h`` a
  learned ``[E]`` query;
- its value is ``(sum_t a_t x_t) W_v,h + b_v,h`` (``W_v,h`` the ``[E, d]``
  slice of ``W_v``); the ``H`` values are concatenated to ``[E]``;
- ``logits = layer_norm(values) W_c + b_c``.

The keys are the normalised tokens themselves: a key projection ``W_k``
would only meet the query as ``q . (W_k x) = (W_k^T q) . x``, which the
query alone already spans: it would add parameters (and scores that start
as a product of two small factors) but no function. The query's length is the
attention's temperature, so there is no ``1 / sqrt(d)``. The query starts
small, so a member starts as a probe on (projected) mean-pooled tokens and
learns to attend from there. Because the weights ``a`` sum to 1, each head
takes one weighted mean of the tokens before the value projection: a step
holds ``G x B x H x (T + E)`` floats, never ``G x B x T x E``.

The grid: one member per (learning rate, weight decay) pair, trained
together as one module whose parameters are stacked along a leading axis
``G``. Every member starts from the same initial weights and sees the same
mini-batches in the same order, so members differ only by their learning
rate and weight decay, and the whole grid costs one pass over the cached
tokens per epoch. Their losses are summed: the members share no parameter,
so each gets exactly its own gradient. AdamW is written out here because
torch's optimizers take one learning rate per parameter tensor, and a
stacked tensor holds all ``G`` members. All parameters live in one
``[G, P]`` buffer (the named tensors are views of it), so an update is a
handful of operations whatever the number of parameter tensors.

Deterministic for a seed: the initial weights and the batch order come from
a CPU generator seeded with ``seed`` (then moved to the device), and nothing
draws from a global generator.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch

from octfw.schedules import warmup_cosine
import torch.nn.functional as F

__all__ = ["AttentiveProbeGrid", "Selection", "fit_attentive_grid", "select_member"]

_BETAS = (0.9, 0.999)
_EPS = 1e-8
_INIT_STD = 0.02
#: Weight decay applies to these (the projection and classifier matrices), not to biases or the query.
_DECAYED = ("w_v", "w_c")


def _sync(device: torch.device) -> None:
    # torch_xla traces lazily: without a cut per step the graph would grow over the whole fit.
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


@attrs.frozen(eq=False)
class AttentiveProbeGrid:
    """Trained grid members; ``params`` are stacked ``[G, ...]`` on the fit device."""

    params: dict[str, torch.Tensor]  #: with the fit tokens' channel ``mean`` and ``scale`` ([E] each)
    num_heads: int
    members: tuple[tuple[float, float], ...]  #: (learning rate, weight decay) of each member

    def logits(self, tokens: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
        """``[N, T, E]`` tokens (any float dtype) -> ``[G, N, K]`` logits, in chunks of ``batch_size``."""
        chunks = [_forward(self.params, tokens[start:start + batch_size], self.num_heads)
                  for start in range(0, tokens.shape[0], batch_size)]
        return torch.cat(chunks, dim=1)

    def probabilities(self, tokens: torch.Tensor, member: int, batch_size: int = 64) -> torch.Tensor:
        """``[N, K]`` class probabilities of one member."""
        return torch.softmax(self.logits(tokens, batch_size)[member], dim=1)


def _forward(params: dict[str, torch.Tensor], tokens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T, E]`` tokens -> ``[G, B, K]`` logits of every member."""
    x = (tokens.float() - params["mean"]) / params["scale"]
    members, _heads, width = params["query"].shape
    scores = torch.einsum("bte,ghe->gbht", x, params["query"])
    weights = torch.softmax(scores, dim=-1)  # [G, B, heads, T]
    mixed = torch.einsum("gbht,bte->gbhe", weights, x)  # each head's attention-weighted token mean
    w_v = params["w_v"].reshape(members, width, num_heads, width // num_heads)
    pooled = torch.einsum("gbhe,gehd->gbhd", mixed, w_v).reshape(members, -1, width) + params["b_v"][:, None]
    z = F.layer_norm(pooled, (width,))
    return torch.einsum("gbe,gek->gbk", z, params["w_c"]) + params["b_c"][:, None]


def _layout(width: int, num_heads: int, n_classes: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one member's parameters, in their order in the flat buffer."""
    return {"query": (num_heads, width), "w_v": (width, width), "b_v": (width,),
            "w_c": (width, n_classes), "b_c": (n_classes,)}


def _views(flat: torch.Tensor, layout: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``[G, P]`` flat parameters -> ``{name: [G, *shape]}`` views (no copy)."""
    views, start = {}, 0
    for name, shape in layout.items():
        size = math.prod(shape)
        views[name] = flat[:, start:start + size].reshape(flat.shape[0], *shape)
        start += size
    return views


def _initial_flat(members: int, layout: dict[str, tuple[int, ...]], generator: torch.Generator) -> torch.Tensor:
    """``[G, P]``: small normal weights and zero biases, the same for every member, so only
    learning rate and weight decay tell the members apart."""
    parts = [torch.zeros(math.prod(shape)) if name.startswith("b_")
             else torch.randn(math.prod(shape), generator=generator) * _INIT_STD
             for name, shape in layout.items()]
    return torch.cat(parts).expand(members, -1).clone()


def _decay_mask(layout: dict[str, tuple[int, ...]]) -> torch.Tensor:
    return torch.cat([torch.full((math.prod(shape),), float(name in _DECAYED)) for name, shape in layout.items()])


def _batch_order(n: int, epochs: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``[steps, batch_size]`` sample indices: one permutation per epoch, concatenated.

    Every batch is full (the stream runs on into the next permutation, and
    the last one wraps to its start), so an XLA graph compiles once; about
    ``epochs`` passes over the data in all.
    """
    steps = max(1, math.ceil(epochs * n / batch_size))
    needed = steps * batch_size
    stream = torch.cat([torch.randperm(n, generator=generator) for _ in range(math.ceil(needed / n))])
    return stream[:needed].reshape(steps, batch_size)


def fit_attentive_grid(
    tokens: torch.Tensor,
    targets: torch.Tensor,
    n_classes: int,
    *,
    learning_rates: Sequence[float],
    weight_decays: Sequence[float],
    num_heads: int = 4,
    epochs: int = 30,
    batch_size: int = 16,
    seed: int = 0,
) -> AttentiveProbeGrid:
    """Train one member per (learning rate, weight decay) on ``[N, T, E]`` tokens and ``[N]`` class indices.

    Runs on the tokens' device, with gradients enabled whatever the caller's
    mode (evaluators are called under ``torch.no_grad``); only the probe's
    own tensors get them. Raises ValueError when ``E`` is not a multiple of
    ``num_heads``.
    """
    device = tokens.device
    width = tokens.shape[-1]
    if width % num_heads:
        raise ValueError(f"the tokens' width {width} is not a multiple of num_heads = {num_heads}")
    members = tuple((float(lr), float(wd)) for lr in learning_rates for wd in weight_decays)
    layout = _layout(width, num_heads, n_classes)
    generator = torch.Generator().manual_seed(seed)
    # One [G, P] buffer for all parameters: an AdamW step is a handful of ops on one tensor,
    # whatever the number of parameter tensors (per-op overhead dominates a probe this small).
    flat = _initial_flat(len(members), layout, generator).to(device)
    order = _batch_order(tokens.shape[0], epochs, batch_size, generator)
    # Channel statistics over every fit token; fixed, not trained. A constant channel stays at 0.
    channels = tokens.float().reshape(-1, width)
    stats = {"mean": channels.mean(dim=0), "scale": channels.std(dim=0, correction=0).clamp_min(1e-6)}
    lr = torch.tensor([m[0] for m in members], device=device)[:, None]
    decay = lr * torch.tensor([m[1] for m in members], device=device)[:, None] * _decay_mask(layout).to(device)
    first, second = torch.zeros_like(flat), torch.zeros_like(flat)
    y = targets.to(device=device, dtype=torch.long)

    with torch.enable_grad():
        for step, batch in enumerate(order):
            batch = batch.to(device)
            leaf = flat.detach().requires_grad_(True)
            logits = _forward({**_views(leaf, layout), **stats}, tokens[batch], num_heads)  # [G, B, K]
            target = y[batch].expand(len(members), -1)
            # Sum over members of each member's mean cross-entropy: independent gradients.
            loss = F.cross_entropy(logits.reshape(-1, n_classes), target.reshape(-1), reduction="sum")
            (grad,) = torch.autograd.grad(loss / batch.shape[0], [leaf])
            # The step's schedule and bias corrections travel as data, not as Python constants
            # that would change the traced graph (and recompile it on XLA) at every step.
            t = step + 1
            factor, correct_first, correct_second = torch.tensor(
                [warmup_cosine(step, len(order)), 1 - _BETAS[0] ** t, 1 - _BETAS[1] ** t]).to(device)
            with torch.no_grad():
                first = first * _BETAS[0] + grad * (1 - _BETAS[0])
                second = second * _BETAS[1] + grad * grad * (1 - _BETAS[1])
                update = (first / correct_first) / ((second / correct_second).sqrt() + _EPS)
                # Decoupled weight decay (AdamW) on the masked entries only.
                flat = flat * (1 - factor * decay) - (factor * lr) * update
            _sync(device)
    return AttentiveProbeGrid({**_views(flat, layout), **stats}, num_heads, members)


@attrs.frozen
class Selection:
    """The grid member chosen on the validation split, and what every member scored there."""

    chosen: int
    balanced_accuracy: list[float]  #: validation balanced accuracy of each member
    loss: list[float]  #: validation cross-entropy of each member
    #: members that predict the same class for every validation volume: they learned nothing
    single_class: list[bool]

    @property
    def degenerate(self) -> bool:
        """Whether the chosen member predicts one class only (then every member does)."""
        return self.single_class[self.chosen]


def select_member(grid: AttentiveProbeGrid, val_tokens: torch.Tensor, val_targets: torch.Tensor,
                  batch_size: int = 64) -> Selection:
    """Choose the member with the highest validation balanced accuracy; among equals the lower
    cross-entropy (on a few dozen validation volumes accuracies tie often), then the earlier grid
    position.

    A member whose validation predictions are all one class is never chosen while another is
    left: its balanced accuracy is exactly chance, which on a small validation split can tie with
    or beat members that learned something, and its cross-entropy (about ln K when it predicts the
    prior) wins the tie against members that commit to their answers.
    """
    logits = grid.logits(val_tokens, batch_size)  # [G, N, K]
    y = val_targets.to(device=logits.device, dtype=torch.long)
    predicted = logits.argmax(dim=2)
    recalls = [(predicted[:, y == c] == c).float().mean(dim=1) for c in torch.unique(y).tolist()]
    balanced = torch.stack(recalls).mean(dim=0).cpu().tolist()
    losses = torch.stack([F.cross_entropy(member, y) for member in logits]).cpu().tolist()
    single = (predicted == predicted[:, :1]).all(dim=1).cpu().tolist()
    candidates = [g for g in range(len(balanced)) if not single[g]] or list(range(len(balanced)))
    chosen = min(candidates, key=lambda g: (-balanced[g], losses[g], g))
    return Selection(chosen, balanced, losses, single)
