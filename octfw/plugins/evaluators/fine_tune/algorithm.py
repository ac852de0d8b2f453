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
- the head first (``head_epochs``; linear probing then fine-tuning, LP-FT,
  Kumar et al. 2022): the head alone trains on the starting encoder's frozen
  tokens at ``head_lr``, its best validation epoch is kept, and fine-tuning
  starts from it; that network (no encoder update, ``selected_epoch`` 0)
  competes with every fine-tuning epoch. A fresh head trained together with
  the encoder for 15 epochs of 3 steps answered one class on the reversal
  task even on an encoder trained with its labels (issue #39,
  ``benchmarks/learning/supervised_ceiling.py``);
- ``blocks``: ``"all"`` trains the whole encoder, patch embedding included;
  an int ``k`` only the last ``k`` blocks, the final norm and the head. The
  frozen part (patch embedding, positions and the blocks before them) then
  runs once, in :func:`frozen_prefix`, and only its output tokens are kept;
- AdamW with layer-wise learning-rate decay (BEiT, RETFound;
  :func:`octfw.evaluation.fine_tuning.parameter_groups`, which the dense
  evaluators share with this one, as they share ``blocks``): block ``i``
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

from octfw.evaluation.attentive import AttentiveHead, decayed, epoch_order
from octfw.evaluation.fine_tuning import ALL_BLOCKS, first_trained_block, parameter_groups, unfreeze_trained_part
from octfw.evaluation.metrics import balanced_accuracy
from octfw.display.progress import fit_step
from octfw.engine.schedules import warmup_cosine
from octfw.types import BlockwiseEncoder

__all__ = ["FineTuneNetwork", "FineTuneResult", "frozen_prefix", "fine_tune"]

_BETAS = (0.9, 0.999)


def frozen_prefix(encoder: BlockwiseEncoder, blocks: int | str, volumes: torch.Tensor) -> torch.Tensor:
    """The network's input: ``volumes`` themselves for ``"all"``; for ``k``, the tokens
    ``[B, N, E]`` that enter the first trained block (the encoder's input tokens through the
    frozen blocks)."""
    if blocks == ALL_BLOCKS:
        return volumes.float()
    start = first_trained_block(len(encoder.blocks), blocks)
    return encoder.run_blocks(encoder.input_tokens(volumes), 0, start).float()


class FineTuneNetwork(nn.Module):
    """The trained part of the encoder and the head: what :func:`frozen_prefix` gives -> logits.

    Holds the whole encoder (the frozen part is never run here, so the
    state dict stays that of a ViT3DEncoder plus the head); the parameters of
    the frozen part have ``requires_grad`` False.
    """

    def __init__(self, encoder: BlockwiseEncoder, blocks: int | str, n_classes: int, num_heads: int,
                 generator: torch.Generator):
        super().__init__()
        self.encoder = encoder
        self.blocks = blocks
        self.head = AttentiveHead(encoder.embed_dim, n_classes, num_heads, generator)
        self.start = unfreeze_trained_part(encoder, blocks)

    def tokens(self, inputs: torch.Tensor) -> torch.Tensor:
        """``[B, N, E]``: the encoder's output tokens."""
        tokens = self.encoder.input_tokens(inputs) if self.blocks == ALL_BLOCKS else inputs
        return self.encoder.norm(self.encoder.run_blocks(tokens, self.start))

    @torch.no_grad()
    def standardise_on(self, inputs: torch.Tensor, batch_size: int) -> None:
        """Fix the head's standardisation to the channel statistics of ``inputs``' tokens."""
        self.head.standardise_on(_batched(self.tokens, inputs, batch_size).float())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(inputs))


@attrs.frozen(eq=False)
class FineTuneResult:
    test_probabilities: torch.Tensor  #: ``[N_test, K]``, of the selected epoch's network
    selected_epoch: int  #: 1-based; 0: the fitted head on the starting encoder, no encoder update kept
    val_balanced_accuracy: float
    val_loss: float
    trained_parameters: int
    single_class: bool  #: every epoch's network answered one class on validation


def _batched(function: Any, inputs: torch.Tensor, batch_size: int) -> torch.Tensor:
    return torch.cat([function(inputs[start:start + batch_size]) for start in range(0, inputs.shape[0], batch_size)])


def _logits(network: nn.Module, inputs: torch.Tensor, batch_size: int) -> torch.Tensor:
    with torch.no_grad():
        return _batched(network, inputs, batch_size)


def fine_tune(
    encoder: BlockwiseEncoder,
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
    head_epochs: int = 100,
    head_lr: float = 1e-2,
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
    batch_size = min(batch_size, fit_inputs.shape[0])
    fit_y = fit_targets.to(device=device, dtype=torch.long)
    val_y = val_targets.to(device=device, dtype=torch.long)
    if head_epochs:
        with torch.no_grad():  # the starting encoder's tokens: the head's first phase reads them frozen
            fit_tokens, val_tokens = (_batched(network.tokens, inputs, eval_batch_size)
                                      for inputs in (fit_inputs, val_inputs))
        head = list(network.head.parameters())
        head_groups = [{"params": [p for p in head if decayed(p.shape)], "weight_decay": weight_decay, "lr_scale": 1.0},
                       {"params": [p for p in head if not decayed(p.shape)], "weight_decay": 0.0, "lr_scale": 1.0}]
        _restore(head_groups, _train(network.head, head_groups, fit_tokens, fit_y, val_tokens, val_y, head_epochs,
                                     batch_size, head_lr, generator, eval_batch_size))
    groups = parameter_groups(network, lr, layer_decay, weight_decay)
    trained = [p for group in groups for p in group["params"]]
    # With a fitted head, its network (no encoder update: epoch 0) competes with every epoch.
    start = (_validate(network, val_inputs, val_y, eval_batch_size, -1), [p.detach().clone() for p in trained]) \
        if head_epochs else None
    best = _train(network, groups, fit_inputs, fit_y, val_inputs, val_y, epochs, batch_size, lr, generator,
                  eval_batch_size, best=start)
    _restore(groups, best)
    probabilities = torch.softmax(_logits(network.eval(), test_inputs, eval_batch_size).float(), dim=1)
    (single_class, negative_balanced, val_loss, epoch) = best[0]
    return FineTuneResult(probabilities, epoch + 1, float(-negative_balanced), val_loss,
                          sum(p.numel() for p in trained), single_class)


_Kept = tuple[tuple[bool, float, float, int], list[torch.Tensor]]


def _validate(network: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int,
              epoch: int) -> tuple[bool, float, float, int]:
    """The epoch's selection key, smaller is better: (one class answered, -balanced accuracy,
    cross-entropy, epoch); equal keys keep the earlier epoch. A host sync, once per epoch."""
    logits = _logits(network, inputs, batch_size)
    predicted = logits.argmax(dim=1)
    balanced = balanced_accuracy(targets.cpu().numpy(), predicted.cpu().numpy())
    return bool((predicted == predicted[0]).all()), -balanced, float(F.cross_entropy(logits, targets)), epoch


def _restore(groups: list[dict[str, Any]], kept: _Kept) -> None:
    """Set the parameters of ``groups`` to the values :func:`_train` kept (in the groups' order)."""
    with torch.no_grad():
        for param, value in zip([p for group in groups for p in group["params"]], kept[1]):
            param.copy_(value)


def _train(network: nn.Module, groups: list[dict[str, Any]], fit_inputs: torch.Tensor, fit_y: torch.Tensor,
           val_inputs: torch.Tensor, val_y: torch.Tensor, epochs: int, batch_size: int, lr: float,
           generator: torch.Generator, eval_batch_size: int, best: _Kept | None = None) -> _Kept:
    """Train the parameters of ``groups`` (each with its ``lr_scale``) with AdamW under the warmup
    and cosine schedule; (the best epoch's key, its parameters), ``best`` to beat if given."""
    device = fit_inputs.device
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=_BETAS)
    trained = [p for group in groups for p in group["params"]]
    steps_per_epoch = math.ceil(fit_inputs.shape[0] / batch_size)
    total = epochs * steps_per_epoch
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
            key = _validate(network, val_inputs, val_y, eval_batch_size, epoch)
            fit_step(epoch + 1, epochs)  # octfw eval's progress, where one listens
            if best is None or key < best[0]:
                best = (key, [p.detach().clone() for p in trained])
    assert best is not None  # epochs >= 1
    return best
