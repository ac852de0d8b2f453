"""Dense probing: the finding mask predicted from patch tokens, per token and per voxel.

Two linear heads read each token of the encoder's output (standardised with the
fit volumes' channel mean and standard deviation, as the linear probe standardises
its features):

- the **token head**, ``Linear(E, 1)``: does the patch hold the finding? The
  token's truth is ``any`` voxel of its patch in the finding, or the ``majority``
  of them (the config's ``token_target``);
- the **voxel decoder**, ``Linear(E, pd x ph x pw)``: one logit per voxel of the
  token's own patch (MAE's pixel decoder, without its transformer), so the mask is
  predicted at the volume's resolution from one token per patch and nothing else.

Both are fitted together (binary cross-entropy plus a soft Dice loss on each:
a finding is a few per cent of the voxels and tokens, and cross-entropy alone
settles on background) with AdamW, full batches of ``batch_size`` volumes
(the epoch's permutation wraps around to fill the last one, so an XLA graph
compiles once), a 10 % warmup and a cosine. The weights start at zero and the
biases at the fit volumes' log-odds of the finding, so every fit starts from the
prior whatever the seed. After each epoch the pooled Dice of each head on the
validation volumes is measured; the epoch with the highest mean of the two (ties:
the lower validation loss, then the earlier epoch) is kept, and only it predicts
the test volumes.

Frozen: the heads on cached tokens. Fine-tuned: a copy of the encoder trained
with the heads, with layer-wise learning-rate decay
(:func:`octfw.evaluation.fine_tuning.parameter_groups`), starting
from the frozen fit's selected heads (linear probing, then fine-tuning: heads
that start at zero would hand the encoder noise to follow; Kumar et al. 2022). Dice and
IoU need only counts per volume (voxels both predicted and true, predicted, true),
and those do not depend on the voxels' order: predictions stay patch-major.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from octfw.evaluation.fine_tuning import parameter_groups
from octfw.display.progress import fit_step
from octfw.engine.schedules import warmup_cosine

__all__ = ["TOKEN_TARGETS", "patchify", "token_truth", "DenseHeads", "DenseNetwork", "DenseResult", "fit_dense"]

TOKEN_TARGETS = ("any", "majority")
_BETAS = (0.9, 0.999)
_PRIOR_FLOOR = 1e-4  # log-odds of a finding no fit voxel shows: finite, far below 0


def patchify(masks: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """``[B, D, H, W]`` -> ``[B, N, pd x ph x pw]``: each patch's voxels, patches in the encoder's
    row-major (d, h, w) order, the voxels of a patch in row-major order too."""
    batch, d, h, w = masks.shape
    pd, ph, pw = patch_size
    blocks = masks.reshape(batch, d // pd, pd, h // ph, ph, w // pw, pw)
    return blocks.permute(0, 1, 3, 5, 2, 4, 6).reshape(batch, -1, pd * ph * pw)


def token_truth(patches: torch.Tensor, token_target: str) -> torch.Tensor:
    """``[B, N]`` bool: a token is in the finding when any (or most) of its patch's voxels are."""
    share = patches.float().mean(dim=-1)
    return share > 0 if token_target == "any" else share >= 0.5


class DenseHeads(nn.Module):
    """Standardisation, then the token head and the voxel decoder on every token."""

    def __init__(self, width: int, patch_voxels: int):
        super().__init__()
        self.register_buffer("feature_mean", torch.zeros(width))
        self.register_buffer("feature_scale", torch.ones(width))
        self.token = nn.Linear(width, 1)
        self.voxel = nn.Linear(width, patch_voxels)
        for layer in (self.token, self.voxel):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    @torch.no_grad()
    def start_at(self, tokens: torch.Tensor, token_prior: float, voxel_prior: float) -> None:
        """Fix the standardisation to ``tokens``' channel statistics (``[M, E]``) and start each
        head at its prior's log-odds."""
        self.feature_mean.copy_(tokens.mean(dim=0))
        self.feature_scale.copy_(tokens.std(dim=0, correction=0).clamp_min(1e-6))
        for layer, prior in ((self.token, token_prior), (self.voxel, voxel_prior)):
            prior = min(max(prior, _PRIOR_FLOOR), 1 - _PRIOR_FLOOR)
            layer.bias.fill_(math.log(prior / (1 - prior)))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, N, E]`` -> (token logits ``[B, N]``, voxel logits ``[B, N, pd x ph x pw]``)."""
        x = (tokens.float() - self.feature_mean) / self.feature_scale
        return self.token(x)[..., 0], self.voxel(x)


class DenseNetwork(nn.Module):
    """What is trained: the heads alone on cached tokens (``encoder`` None), or an encoder
    copy under them, whose parameters all train (layer decay sets how fast)."""

    def __init__(self, heads: DenseHeads, encoder: nn.Module | None = None):
        super().__init__()
        self.heads = heads
        self.encoder = encoder
        if encoder is not None:
            encoder.requires_grad_(True)  # a target encoder arrives frozen

    def tokens(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs if self.encoder is None else self.encoder(inputs)

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.tokens(inputs))


@attrs.frozen(eq=False)
class DenseResult:
    """Per test volume counts (float64 host arrays ``[N_test]``) of the selected epoch's network."""

    voxel: tuple[Any, Any, Any]  #: (both predicted and true, predicted, true) voxels
    token: tuple[Any, Any, Any]  #: the same for tokens
    selected_epoch: int  #: 1-based
    heads: "DenseHeads"  #: the selected epoch's heads (fine-tuning starts from the frozen fit's)
    val_dice: float  #: mean of the voxel and the token head's pooled Dice on validation (0 where undefined)
    trained_parameters: int


def _soft_dice_loss(logits: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    probabilities = torch.sigmoid(logits)
    overlap = (probabilities * truth).sum()
    return 1 - (2 * overlap + 1) / (probabilities.sum() + truth.sum() + 1)


def _loss(network: DenseNetwork, inputs: torch.Tensor, patches: torch.Tensor, token_target: str) -> torch.Tensor:
    token_logits, voxel_logits = network(inputs)
    voxels = patches.float()
    tokens = token_truth(patches, token_target).float()
    return (F.binary_cross_entropy_with_logits(voxel_logits, voxels) + _soft_dice_loss(voxel_logits, voxels)
            + F.binary_cross_entropy_with_logits(token_logits, tokens) + _soft_dice_loss(token_logits, tokens))


def _counts(network: DenseNetwork, inputs: torch.Tensor, patches: torch.Tensor, token_target: str,
            batch_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``([N, 3]`` voxel counts, ``[N, 3]`` token counts, mean loss): counts of (both, predicted,
    true) per volume, a logit above 0 predicting the finding."""
    voxel_counts, token_counts, losses = [], [], []
    with torch.no_grad():
        for start in range(0, inputs.shape[0], batch_size):
            batch, truth = inputs[start:start + batch_size], patches[start:start + batch_size]
            token_logits, voxel_logits = network(batch)
            tokens = token_truth(truth, token_target)
            for logits, true, out in ((voxel_logits, truth.bool(), voxel_counts), (token_logits, tokens, token_counts)):
                predicted = logits > 0
                dims = tuple(range(1, predicted.ndim))
                out.append(torch.stack([(predicted & true).sum(dims), predicted.sum(dims), true.sum(dims)], 1))
            losses.append(float(_loss(network, batch, truth, token_target)) * batch.shape[0])
    return (torch.cat(voxel_counts).double().cpu(), torch.cat(token_counts).double().cpu(),
            sum(losses) / inputs.shape[0])


def _pooled_dice(counts: torch.Tensor) -> float:
    both, predicted, true = counts.sum(0).tolist()
    return 2 * both / (predicted + true) if predicted + true > 0 else 0.0


def _epoch_order(n: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``[steps, batch_size]`` indices of one epoch: a permutation, wrapped to fill the last batch."""
    steps = math.ceil(n / batch_size)
    order = torch.randperm(n, generator=generator)
    return order.repeat(math.ceil(steps * batch_size / n))[:steps * batch_size].reshape(steps, batch_size)


def fit_dense(
    fit_inputs: torch.Tensor,
    fit_patches: torch.Tensor,
    val_inputs: torch.Tensor,
    val_patches: torch.Tensor,
    test_inputs: torch.Tensor,
    test_patches: torch.Tensor,
    width: int,
    *,
    encoder: nn.Module | None = None,
    heads: DenseHeads | None = None,
    token_target: str = "any",
    epochs: int = 30,
    batch_size: int = 8,
    lr: float = 1e-2,
    layer_decay: float = 0.75,
    weight_decay: float = 0.0,
    seed: int = 0,
    eval_batch_size: int = 4,
    sync: Callable[[], None] | None = None,
) -> DenseResult:
    """Fit the heads (on tokens ``[N, T, E]``; or, with ``encoder``, on a copy of it, from volumes
    ``[N, C, D, H, W]``) to the patchified masks ``[N, T, pd x ph x pw]``; return the counts of
    the epoch chosen on validation over the test volumes.

    Runs on the inputs' device with gradients enabled whatever the caller's mode;
    ``encoder`` itself is not changed. ``sync`` (an XLA step marker) runs after each step.
    """
    device = fit_inputs.device
    start = DenseHeads(width, fit_patches.shape[-1]) if heads is None else copy.deepcopy(heads)
    network = DenseNetwork(start, None if encoder is None else copy.deepcopy(encoder)).to(device)
    if heads is None:
        with torch.no_grad():
            start_tokens = torch.cat([network.tokens(fit_inputs[i:i + eval_batch_size]).float()
                                      for i in range(0, fit_inputs.shape[0], eval_batch_size)])
        network.heads.start_at(start_tokens.reshape(-1, width),
                               float(token_truth(fit_patches, token_target).float().mean()),
                               float(fit_patches.float().mean()))
        del start_tokens
    network.train()
    if encoder is None:
        groups = [{"params": list(network.heads.parameters()), "lr_scale": 1.0, "weight_decay": weight_decay}]
    else:
        groups = parameter_groups(network, lr, layer_decay, weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=_BETAS)
    trained = [p for group in groups for p in group["params"]]
    generator = torch.Generator().manual_seed(seed)
    batch_size = min(batch_size, fit_inputs.shape[0])
    steps_per_epoch = math.ceil(fit_inputs.shape[0] / batch_size)
    total = epochs * steps_per_epoch
    best: tuple[tuple[float, float, int], list[torch.Tensor]] | None = None

    with torch.enable_grad():
        for epoch in range(epochs):
            network.train()
            for offset, batch in enumerate(_epoch_order(fit_inputs.shape[0], batch_size, generator)):
                factor = warmup_cosine(epoch * steps_per_epoch + offset, total)
                for group in groups:
                    group["lr"] = lr * group["lr_scale"] * factor
                batch = batch.to(device)
                loss = _loss(network, fit_inputs[batch], fit_patches[batch], token_target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if sync is not None:
                    sync()
            # Validation: a host sync per epoch, to choose the epoch.
            network.eval()
            voxel_counts, token_counts, val_loss = _counts(network, val_inputs, val_patches, token_target,
                                                           eval_batch_size)
            val_dice = (_pooled_dice(voxel_counts) + _pooled_dice(token_counts)) / 2
            key = (-val_dice, val_loss, epoch)  # smaller is better
            fit_step(epoch + 1, epochs)  # octfw eval's progress, where one listens
            if best is None or key < best[0]:
                best = (key, [p.detach().clone() for p in trained])

    assert best is not None  # epochs >= 1
    with torch.no_grad():
        for param, kept in zip(trained, best[1]):
            param.copy_(kept)
    network.eval()
    voxel_counts, token_counts, _ = _counts(network, test_inputs, test_patches, token_target, eval_batch_size)
    (negative_dice, _val_loss, epoch) = best[0]
    return DenseResult(tuple(voxel_counts.T.numpy()), tuple(token_counts.T.numpy()), epoch + 1,
                       network.heads, float(-negative_dice), sum(p.numel() for p in trained))
