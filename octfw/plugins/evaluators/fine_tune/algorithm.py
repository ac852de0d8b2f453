"""Fine-tuning: the encoder trained further under a classification head, the field's protocol.

A frozen probe measures what pretraining put in the features; RETFound and
OCTCube report fine-tuning too, because a downstream user trains the whole
network. The protocol, scaled to the CPU:

- a private copy of the encoder (the caller's is never modified), then
  V-JEPA's attentive classifier on its output tokens
  (:class:`octfw.evaluation.attentive.AttentiveHead`: a learned query token,
  a cross-attention block, a linear layer), the tokens standardised per
  channel with statistics fixed at the start (the fit volumes' tokens under
  the starting encoder), as the attentive probe standardises its frozen
  tokens. A mean over the tokens, the head first written here, washed out a
  finding a few tokens see: fine-tuning on 10 held-out phantom volumes per
  class stayed at chance where a linear probe on the 8 fovea tokens reached
  0.85 (issue #39);
- ``blocks``: ``"all"`` trains the whole encoder, patch embedding included;
  an int ``k`` only the last ``k`` blocks, the final norm and the head. The
  frozen part (patch embedding, positions and the blocks before them) then
  runs once, in :func:`frozen_prefix`, and only its output tokens are kept;
- AdamW with layer-wise learning-rate decay (BEiT, RETFound): block ``i``
  (0-based) of ``L`` gets ``lr x layer_decay ** (L - i)``, the patch
  embedding ``lr x layer_decay ** (L + 1)``, the final norm and the head
  ``lr``: layers near the input, which transfer best, move least. No weight
  decay on 1-D parameters (biases, norm scales);
- every step is full (``fit_batch_size``, capped at the fit volumes): the
  permutation of an epoch wraps around to fill its last batch, so an XLA
  graph compiles once; the attentive probe's schedule (10 % linear warmup,
  then a cosine to 0) over all steps;
- after each epoch, balanced accuracy and cross-entropy on the validation
  volumes; the epoch with the highest balanced accuracy is kept (ties: the
  lower cross-entropy, then the earlier epoch), and only its network
  predicts the test volumes: the test split never chooses. An epoch whose
  network answers one class for every validation volume is kept only when
  every epoch does (``single_class`` is then reported), for the reason the
  attentive probe's selection gives (:func:`octfw.plugins.evaluators.attentive_probe.algorithm.select_member`).

Deterministic for a seed: the head's initial weights and the batch order
come from a CPU generator seeded with ``seed``, the network has no dropout,
and nothing draws from a global generator.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from octfw.evaluation.attentive import AttentiveHead, epoch_order
from octfw.evaluation.metrics import balanced_accuracy
from octfw.schedules import warmup_cosine

# The encoder is a :class:`octfw.models.vit3d.ViT3DEncoder` (``patch_embed``, ``pos_embed``,
# ``blocks``, ``norm``, ``embed_dim``), used by those attributes: evaluation may not import a
# model package (the components of different stages stay independent, pyproject.toml).
ViT3DEncoder = nn.Module

__all__ = ["ALL_BLOCKS", "is_vit3d_encoder", "FineTuneNetwork", "FineTuneResult", "first_trained_block", "frozen_prefix",
           "layer_exponent", "parameter_groups", "fine_tune"]

#: ``blocks`` value that trains the whole encoder, patch embedding included.
ALL_BLOCKS = "all"
_BETAS = (0.9, 0.999)


def is_vit3d_encoder(module: Any) -> bool:
    return isinstance(module, nn.Module) and all(
        hasattr(module, name) for name in ("patch_embed", "pos_embed", "blocks", "norm", "embed_dim"))


def first_trained_block(depth: int, blocks: int | str) -> int:
    """Index of the first block that trains: 0 for ``"all"``, ``depth - k`` for ``k``."""
    return 0 if blocks == ALL_BLOCKS else depth - int(blocks)


def frozen_prefix(encoder: ViT3DEncoder, blocks: int | str, volumes: torch.Tensor) -> torch.Tensor:
    """The network's input: ``volumes`` themselves for ``"all"``; for ``k``, the tokens
    ``[B, N, E]`` that enter the first trained block (patch embedding, positions, frozen blocks)."""
    if blocks == ALL_BLOCKS:
        return volumes.float()
    tokens = encoder.patch_embed(volumes) + encoder.pos_embed
    for block in encoder.blocks[:first_trained_block(len(encoder.blocks), blocks)]:
        tokens = block(tokens)
    return tokens.float()


class FineTuneNetwork(nn.Module):
    """The trained part of the encoder and the head: what :func:`frozen_prefix` gives -> logits.

    Holds the whole encoder (the frozen part is never run here, so the
    state dict stays that of a ViT3DEncoder plus the head); the parameters of
    the frozen part have ``requires_grad`` False.
    """

    def __init__(self, encoder: ViT3DEncoder, blocks: int | str, n_classes: int, num_heads: int,
                 generator: torch.Generator):
        super().__init__()
        self.encoder = encoder
        self.blocks = blocks
        self.start = first_trained_block(len(encoder.blocks), blocks)
        self.head = AttentiveHead(encoder.embed_dim, n_classes, num_heads, generator)
        encoder.requires_grad_(False)  # a target encoder arrives frozen; unfreeze what trains
        trained = [encoder.norm, *encoder.blocks[self.start:]]
        if blocks == ALL_BLOCKS:
            trained.append(encoder.patch_embed)
        for module in trained:
            module.requires_grad_(True)

    def tokens(self, inputs: torch.Tensor) -> torch.Tensor:
        """``[B, N, E]``: the encoder's output tokens."""
        tokens = inputs
        if self.blocks == ALL_BLOCKS:
            tokens = self.encoder.patch_embed(inputs) + self.encoder.pos_embed
        for block in self.encoder.blocks[self.start:]:
            tokens = block(tokens)
        return self.encoder.norm(tokens)

    @torch.no_grad()
    def standardise_on(self, inputs: torch.Tensor, batch_size: int) -> None:
        """Fix the head's standardisation to the channel statistics of ``inputs``' tokens."""
        self.head.standardise_on(torch.cat([self.tokens(inputs[start:start + batch_size]).float()
                                            for start in range(0, inputs.shape[0], batch_size)]))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(inputs))


def layer_exponent(name: str, depth: int) -> int:
    """``e`` in ``lr x layer_decay ** e`` for the parameter ``name`` of a :class:`FineTuneNetwork`."""
    if name.startswith("encoder.patch_embed."):
        return depth + 1
    if name.startswith("encoder.blocks."):
        return depth - int(name.split(".")[2])
    return 0  # the final norm and the head


def parameter_groups(network: FineTuneNetwork, lr: float, layer_decay: float,
                     weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups of the trained parameters: one per (layer exponent, decayed or not).

    Each group carries ``lr_scale`` (``layer_decay ** exponent``, which the
    schedule multiplies) and ``exponent``; frozen parameters are in no group.
    """
    depth = len(network.encoder.blocks)
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in network.named_parameters():
        if not param.requires_grad:
            continue
        exponent, decayed = layer_exponent(name, depth), param.ndim > 1
        group = groups.setdefault((exponent, decayed), {
            "params": [], "names": [], "exponent": exponent, "lr_scale": layer_decay ** exponent,
            "lr": lr * layer_decay ** exponent, "weight_decay": weight_decay if decayed else 0.0})
        group["params"].append(param)
        group["names"].append(name)
    return [groups[key] for key in sorted(groups)]


@attrs.frozen(eq=False)
class FineTuneResult:
    test_probabilities: torch.Tensor  #: ``[N_test, K]``, of the selected epoch's network
    selected_epoch: int  #: 1-based
    val_balanced_accuracy: float
    val_loss: float
    trained_parameters: int
    single_class: bool  #: every epoch's network answered one class on validation


def _logits(network: nn.Module, inputs: torch.Tensor, batch_size: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([network(inputs[start:start + batch_size])
                          for start in range(0, inputs.shape[0], batch_size)])


def fine_tune(
    encoder: ViT3DEncoder,
    fit_inputs: torch.Tensor,
    fit_targets: torch.Tensor,
    val_inputs: torch.Tensor,
    val_targets: torch.Tensor,
    test_inputs: torch.Tensor,
    n_classes: int,
    *,
    blocks: int | str = ALL_BLOCKS,
    epochs: int = 20,
    batch_size: int = 8,
    lr: float = 1e-3,
    layer_decay: float = 0.75,
    weight_decay: float = 0.05,
    num_heads: int = 12,
    seed: int = 0,
    eval_batch_size: int = 16,
) -> FineTuneResult:
    """Fine-tune a copy of ``encoder`` on inputs :func:`frozen_prefix` made (class indices as
    targets); return the test probabilities of the epoch chosen on validation.

    Runs on the inputs' device with gradients enabled whatever the caller's
    mode (evaluators are called under ``torch.no_grad``); ``encoder`` itself
    is not changed.
    """
    device = fit_inputs.device
    generator = torch.Generator().manual_seed(seed)
    network = FineTuneNetwork(copy.deepcopy(encoder), blocks, n_classes, num_heads, generator).to(device).train()
    network.standardise_on(fit_inputs, eval_batch_size)
    groups = parameter_groups(network, lr, layer_decay, weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=_BETAS)
    trained = [p for group in groups for p in group["params"]]
    batch_size = min(batch_size, fit_inputs.shape[0])
    steps_per_epoch = math.ceil(fit_inputs.shape[0] / batch_size)
    total = epochs * steps_per_epoch
    fit_y = fit_targets.to(device=device, dtype=torch.long)
    val_y = val_targets.to(device=device, dtype=torch.long)
    best: tuple[tuple[float, float, int], list[torch.Tensor]] | None = None

    with torch.enable_grad():
        for epoch in range(epochs):
            for offset, batch in enumerate(epoch_order(fit_inputs.shape[0], batch_size, generator)):
                factor = warmup_cosine(epoch * steps_per_epoch + offset, total)
                for group in groups:
                    group["lr"] = lr * group["lr_scale"] * factor
                batch = batch.to(device)
                loss = F.cross_entropy(network(fit_inputs[batch]), fit_y[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if device.type == "xla":  # one graph per step, not one over the whole fit
                    import torch_xla

                    torch_xla.sync()
            # Validation: a host sync per epoch, to choose the epoch.
            logits = _logits(network, val_inputs, eval_batch_size)
            val_loss = float(F.cross_entropy(logits, val_y))
            predicted = logits.argmax(dim=1)
            balanced = balanced_accuracy(val_y.cpu().numpy(), predicted.cpu().numpy())
            single_class = bool((predicted == predicted[0]).all())
            # Smaller is better; equal keys keep the earlier epoch.
            key = (single_class, -balanced, val_loss, epoch)
            if best is None or key < best[0]:
                best = (key, [p.detach().clone() for p in trained])

    assert best is not None  # epochs >= 1
    with torch.no_grad():
        for param, kept in zip(trained, best[1]):
            param.copy_(kept)
    probabilities = torch.softmax(_logits(network.eval(), test_inputs, eval_batch_size).float(), dim=1)
    (single_class, negative_balanced, val_loss, epoch) = best[0]
    return FineTuneResult(probabilities, epoch + 1, float(-negative_balanced), val_loss,
                          sum(p.numel() for p in trained), single_class)
