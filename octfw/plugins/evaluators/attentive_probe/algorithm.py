"""Attentive probe: V-JEPA's attentive classifier on frozen patch tokens, a grid trained until
validation stops improving.

A mean over tokens can wash out a finding that a few tokens see; a query
that learns *where* to look keeps it. The classifier is V-JEPA's (one
learned query token, a cross-attention block with its MLP, a linear head;
:mod:`octfw.evaluation.attentive`).

**The grid**: one member per (learning rate, weight decay) pair, trained
together as one set of parameters stacked along a leading axis ``G``.
Every member starts from the same initial weights and sees the same
mini-batches in the same order, so members differ only by their learning
rate and weight decay, and the whole grid costs one pass over the cached
tokens per epoch. Their losses are summed: the members share no parameter,
so each gets exactly its own gradient. AdamW is written out here because
torch's optimizers take one learning rate per parameter tensor, and a
stacked tensor holds all ``G`` members. All parameters live in one
``[G, P]`` buffer (the named tensors are views of it), so an update is a
handful of operations whatever the number of parameter tensors.

**Trained until validation stops improving.** After each epoch every
member is scored on the validation tokens (balanced accuracy, then
cross-entropy: an epoch improves on a member's best when its balanced
accuracy is higher, or equal with a cross-entropy lower by more than
:data:`LOSS_TOLERANCE`); each member keeps the parameters of its best
epoch. Training stops when no member has improved for ``patience`` epochs,
or after ``max_epochs``. The learning rate warms up over the first 10 % of
``max_epochs`` and follows a cosine to 0 over all of them. A member whose
parameters stop being finite (a learning rate too large) is frozen there and
never improves again.

Deterministic for a seed: the initial weights and the batch order come from
a CPU generator seeded with ``seed`` (then moved to the device), and nothing
draws from a global generator.
"""

from __future__ import annotations

import math
from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

from octfw.evaluation.attentive import (attentive_forward, channel_statistics, decayed, epoch_order,
                                        initial_parameters, layout)
from octfw.display.progress import fit_step
from octfw.engine.schedules import warmup_cosine

__all__ = ["AttentiveProbeGrid", "Selection", "fit_attentive_grid", "select_member", "validation_scores",
           "LOSS_TOLERANCE"]

_BETAS = (0.9, 0.999)
_EPS = 1e-8
#: A validation cross-entropy must fall by more than this to count as an improvement at equal
#: balanced accuracy: a loss creeping down by rounding would never let training stop.
LOSS_TOLERANCE = 1e-3


def _sync(device: torch.device) -> None:
    # torch_xla traces lazily: without a cut per step the graph would grow over the whole fit.
    if device.type == "xla":
        import torch_xla

        torch_xla.sync()


@attrs.frozen(eq=False)
class AttentiveProbeGrid:
    """Trained grid members at their best validation epoch; ``params`` are stacked ``[G, ...]``."""

    params: dict[str, torch.Tensor]  #: with the fit tokens' channel ``mean`` and ``scale`` ([E] each)
    num_heads: int
    members: tuple[tuple[float, float], ...]  #: (learning rate, weight decay) of each member
    best_epoch: tuple[int, ...] = ()  #: 1-based epoch each member's parameters come from
    epochs_trained: int = 0  #: epochs run before every member stopped improving (or the cap)
    best_balanced_accuracy: tuple[float, ...] = ()  #: each member's validation score at its best epoch

    def logits(self, tokens: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
        """``[N, T, E]`` tokens (any float dtype) -> ``[G, N, K]`` logits, in chunks of ``batch_size``."""
        chunks = [attentive_forward(self.params, tokens[start:start + batch_size], self.num_heads)
                  for start in range(0, tokens.shape[0], batch_size)]
        return torch.cat(chunks, dim=1)

    def probabilities(self, tokens: torch.Tensor, member: int, batch_size: int = 64) -> torch.Tensor:
        """``[N, K]`` class probabilities of one member."""
        return torch.softmax(self.logits(tokens, batch_size)[member], dim=1)


def _views(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``[G, P]`` flat parameters -> ``{name: [G, *shape]}`` views (no copy)."""
    views, start = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        views[name] = flat[:, start:start + size].reshape(flat.shape[0], *shape)
        start += size
    return views


def validation_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[list[float], list[float], list[bool]]:
    """Per member of ``[G, N, K]`` logits: balanced accuracy, cross-entropy (inf where not
    finite) and whether it predicts one class for every volume."""
    y = targets.to(device=logits.device, dtype=torch.long)
    predicted = logits.argmax(dim=2)
    recalls = [(predicted[:, y == c] == c).float().mean(dim=1) for c in torch.unique(y).tolist()]
    balanced = torch.stack(recalls).mean(dim=0)
    losses = torch.stack([F.cross_entropy(member, y) for member in logits])
    losses = torch.where(torch.isfinite(losses), losses, torch.full_like(losses, math.inf))
    single = (predicted == predicted[:, :1]).all(dim=1)
    return balanced.cpu().tolist(), losses.cpu().tolist(), single.cpu().tolist()


def fit_attentive_grid(
    tokens: torch.Tensor,
    targets: torch.Tensor,
    val_tokens: torch.Tensor,
    val_targets: torch.Tensor,
    n_classes: int,
    *,
    learning_rates: Sequence[float],
    weight_decays: Sequence[float],
    num_heads: int = 4,
    max_epochs: int = 300,
    patience: int = 40,
    batch_size: int = 16,
    seed: int = 0,
) -> AttentiveProbeGrid:
    """Train one member per (learning rate, weight decay) on ``[N, T, E]`` tokens and ``[N]`` class
    indices until the validation tokens stop improving; every member at its best epoch.

    Runs on the tokens' device, with gradients enabled whatever the caller's
    mode (evaluators are called under ``torch.no_grad``); only the probe's
    own tensors get them. A validation pass per epoch is a host sync. Raises
    ValueError when ``E`` is not a multiple of ``num_heads``.
    """
    device = tokens.device
    width = tokens.shape[-1]
    if width % num_heads:
        raise ValueError(f"the tokens' width {width} is not a multiple of num_heads = {num_heads}")
    members = tuple((float(lr), float(wd)) for lr in learning_rates for wd in weight_decays)
    shapes = layout(width, n_classes)
    generator = torch.Generator().manual_seed(seed)
    start = initial_parameters(width, n_classes, generator)
    # One [G, P] buffer for all parameters: an AdamW step is a handful of ops on one tensor,
    # whatever the number of parameter tensors (per-op overhead dominates a probe this small).
    flat = torch.cat([start[name].reshape(-1) for name in shapes]).expand(len(members), -1).clone().to(device)
    mask = torch.cat([torch.full((math.prod(shape),), float(decayed(shape))) for shape in shapes.values()])
    stats = channel_statistics(tokens)
    lr = torch.tensor([m[0] for m in members], device=device)[:, None]
    decay = lr * torch.tensor([m[1] for m in members], device=device)[:, None] * mask.to(device)
    first, second = torch.zeros_like(flat), torch.zeros_like(flat)
    y = targets.to(device=device, dtype=torch.long)
    batch_size = min(batch_size, tokens.shape[0])
    steps_per_epoch = math.ceil(tokens.shape[0] / batch_size)
    total = max_epochs * steps_per_epoch

    best = flat.clone()
    best_key: list[tuple[float, float]] = [(-math.inf, math.inf)] * len(members)  # (balanced, loss)
    best_epoch = [0] * len(members)
    waited = [0] * len(members)
    epoch = 0
    with torch.enable_grad():
        for epoch in range(1, max_epochs + 1):
            for offset, batch in enumerate(epoch_order(tokens.shape[0], batch_size, generator)):
                step = (epoch - 1) * steps_per_epoch + offset
                batch = batch.to(device)
                leaf = flat.detach().requires_grad_(True)
                logits = attentive_forward({**_views(leaf, shapes), **stats}, tokens[batch], num_heads)
                target = y[batch].expand(len(members), -1)
                # Sum over members of each member's mean cross-entropy: independent gradients.
                loss = F.cross_entropy(logits.reshape(-1, n_classes), target.reshape(-1), reduction="sum")
                (grad,) = torch.autograd.grad(loss / batch.shape[0], [leaf])
                # The step's schedule and bias corrections travel as data, not as Python constants
                # that would change the traced graph (and recompile it on XLA) at every step.
                t = step + 1
                factor, correct_first, correct_second = torch.tensor(
                    [warmup_cosine(step, total), 1 - _BETAS[0] ** t, 1 - _BETAS[1] ** t]).to(device)
                with torch.no_grad():
                    first = first * _BETAS[0] + grad * (1 - _BETAS[0])
                    second = second * _BETAS[1] + grad * grad * (1 - _BETAS[1])
                    update = (first / correct_first) / ((second / correct_second).sqrt() + _EPS)
                    # Decoupled weight decay (AdamW) on the masked entries only.
                    stepped = flat * (1 - factor * decay) - (factor * lr) * update
                    # A member that diverged stays where it was: it cannot poison its own best.
                    finite = torch.isfinite(stepped).all(dim=1, keepdim=True)
                    flat = torch.where(finite, stepped, flat)
                _sync(device)
            with torch.no_grad():
                val_logits = AttentiveProbeGrid({**_views(flat, shapes), **stats}, num_heads, members).logits(
                    val_tokens)
            balanced, losses, _single = validation_scores(val_logits, val_targets)
            fit_step(epoch, max_epochs)  # octfw eval's progress, where one listens (patience may stop it sooner)
            improved = [balanced[g] > best_key[g][0]
                        or (balanced[g] == best_key[g][0] and losses[g] < best_key[g][1] - LOSS_TOLERANCE)
                        for g in range(len(members))]
            for g, better in enumerate(improved):
                if better:
                    best_key[g], best_epoch[g], waited[g] = (balanced[g], losses[g]), epoch, 0
                else:
                    waited[g] += 1
            rows = torch.tensor(improved, device=device)[:, None]
            best = torch.where(rows, flat, best)
            if min(waited) >= patience:
                break
    return AttentiveProbeGrid({**_views(best, shapes), **stats}, num_heads, members, tuple(best_epoch), epoch,
                              tuple(key[0] for key in best_key))


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
    balanced, losses, single = validation_scores(grid.logits(val_tokens, batch_size), val_targets)
    candidates = [g for g in range(len(balanced)) if not single[g]] or list(range(len(balanced)))
    chosen = min(candidates, key=lambda g: (-balanced[g], losses[g], g))
    return Selection(chosen, balanced, losses, single)
