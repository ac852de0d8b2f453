"""V-JEPA for 3D volumes: predict target-encoder features of masked patches.

A context encoder sees only the visible patches of the ``context`` view; a
narrower predictor gets those tokens plus learned mask tokens placed at the
masked positions and predicts, for each masked patch, the features an EMA
copy of the encoder (the target encoder) computes from the full ``target``
view. The loss is taken on masked patches only.

Hot-path rules (see :mod:`octfw.hookspecs`): ``forward`` and ``ema_update``
gather with fixed-size index tensors, never index with boolean masks, never
branch on tensor values and never read a tensor on the host.
"""

from __future__ import annotations

import copy
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from octfw.models.health import health_metrics
from octfw.models.masked_decoder import MaskedTokenDecoder
from octfw.models.vit3d import (
    ViT3DEncoder,
    gather_tokens,
    layer_norm,
    set_activation_checkpointing,
    weight_decay_groups,
)
from octfw.types import BATCH_KEYS, ModelOutput

__all__ = [
    "LOSSES",
    "Predictor",
    "VJEPA3D",
    "masked_feature_loss",
]

#: Loss names accepted by :class:`VJEPA3D` (and the ``loss`` config key).
LOSSES = ("l1", "mse", "nmse")


class Predictor(MaskedTokenDecoder):
    """Narrow transformer that predicts target features at masked positions.

    ``forward(context_tokens [B, Nc, E], context_idx [B, Nc], target_idx [B, Nt])``
    returns ``[B, Nt, E]``: the shared :class:`~octfw.models.masked_decoder.MaskedTokenDecoder`
    with an output head back to the encoder width.
    """

    def __init__(
        self,
        grid_size: tuple[int, int, int],
        embed_dim: int,
        predictor_embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float,
        activation_checkpointing: bool = False,
    ):
        super().__init__(grid_size, embed_dim, predictor_embed_dim, depth, num_heads, mlp_ratio,
                         out_dim=embed_dim, activation_checkpointing=activation_checkpointing)


def masked_feature_loss(predicted: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-sample loss ``[B]`` between ``[B, Nt, E]`` predictions and targets.

    Computed in float32 whatever the autocast dtype, averaged over masked
    tokens and feature channels:

    - ``"l1"``: mean absolute error against layer-normed (no affine) targets,
      the V-JEPA loss.
    - ``"mse"``: mean squared error against the raw target features.
    - ``"nmse"``: mean squared error between L2-normalised prediction and
      target vectors (``(2 - 2 cos) / E`` per token), the seeds' loss; about
      ``2 / E`` for unrelated vectors and 0 for aligned ones.
    """
    predicted = predicted.float()
    target = target.float()
    if kind == "l1":
        target = layer_norm(target, target.shape[-1:])  # written out on XLA (see there)
        error = (predicted - target).abs()
    elif kind == "mse":
        error = (predicted - target).square()
    elif kind == "nmse":
        error = (F.normalize(predicted, dim=-1) - F.normalize(target, dim=-1)).square()
    else:
        raise ValueError(f"unknown loss {kind!r}; choose one of {', '.join(LOSSES)}")
    return error.mean(dim=(1, 2))


class VJEPA3D(nn.Module):
    """V-JEPA with a 3D ViT context encoder, predictor and EMA target encoder.

    ``forward(batch)`` takes the keys of :data:`octfw.types.BATCH_KEYS` (its ``inputs``)
    (``context`` and ``target`` float32 ``[B, C, D, H, W]``, ``context_idx``
    int64 ``[B, Nc]``, ``target_idx`` int64 ``[B, Nt]``) and returns an
    :class:`~octfw.types.ModelOutput` with the loss on masked patches and the
    scalar metrics ``target_std``, ``pred_std`` (see :func:`~octfw.models.health.embedding_std`)
    and ``effective_rank`` of the target features (see
    :func:`~octfw.models.health.effective_rank`),
    the signals the ``collapse`` guard watches.

    Trainable parameters are those of ``context_encoder`` and ``predictor``;
    ``target_encoder`` (also :attr:`encoder`) is a copy updated only by
    :meth:`ema_update` and never receives gradients.
    """

    inputs = BATCH_KEYS  #: the batch keys forward reads (octfw.types.Model.inputs)

    def __init__(
        self,
        *,
        image_size: tuple[int, int, int],
        patch_size: tuple[int, int, int],
        in_channels: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        predictor_embed_dim: int,
        predictor_depth: int,
        predictor_num_heads: int,
        mlp_ratio: float = 4.0,
        loss: str = "l1",
        activation_checkpointing: bool = False,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
        self.loss_kind = loss
        self.context_encoder = ViT3DEncoder(
            image_size, patch_size, in_channels, embed_dim, depth, num_heads, mlp_ratio,
            activation_checkpointing=activation_checkpointing,
        )
        self.predictor = Predictor(
            self.context_encoder.grid_size,
            embed_dim,
            predictor_embed_dim,
            predictor_depth,
            predictor_num_heads,
            mlp_ratio,
            activation_checkpointing=activation_checkpointing,
        )
        self.target_encoder = copy.deepcopy(self.context_encoder)
        self.target_encoder.requires_grad_(False)
        # It runs under no_grad, where nothing is saved and nothing to recompute.
        set_activation_checkpointing(self.target_encoder.blocks, False)

    # --- geometry -----------------------------------------------------------

    @property
    def grid_size(self) -> tuple[int, int, int]:
        """The patch grid ``(D/pd, H/ph, W/pw)``."""
        return self.context_encoder.grid_size

    @property
    def num_patches(self) -> int:
        return self.context_encoder.num_patches

    @property
    def encoder(self) -> ViT3DEncoder:
        """The EMA target encoder: the network to export after pretraining."""
        return self.target_encoder

    # --- forward ------------------------------------------------------------

    def predict(
        self, context: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor
    ) -> torch.Tensor:
        """Predicted target features at ``target_idx``: ``[B, Nt, E]``."""
        visible = self.context_encoder(context, keep_idx=context_idx)
        return self.predictor(visible, context_idx, target_idx)

    @torch.no_grad()
    def target_features(self, target: torch.Tensor, target_idx: torch.Tensor) -> torch.Tensor:
        """Target-encoder features of the full ``target`` view at ``target_idx``: ``[B, Nt, E]``."""
        return gather_tokens(self.target_encoder(target), target_idx)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> ModelOutput:
        predicted = self.predict(batch["context"], batch["context_idx"], batch["target_idx"])
        target = self.target_features(batch["target"], batch["target_idx"])
        per_sample = masked_feature_loss(predicted, target, self.loss_kind)
        return ModelOutput(
            loss=per_sample.mean(),
            per_sample_loss=per_sample,
            metrics=health_metrics(target, predicted),
        )

    @torch.no_grad()
    def embed(self, volume: torch.Tensor) -> torch.Tensor:
        """Target-encoder features of every patch of ``volume``: ``[B, N, E]``."""
        return self.target_encoder(volume)

    # --- training hooks -----------------------------------------------------

    @torch.no_grad()
    def ema_update(self, momentum: torch.Tensor | float) -> None:
        """``ema = m * ema + (1 - m) * online`` for every target-encoder parameter.

        ``momentum`` is a float or a 0-dim tensor on the model's device (no
        host sync). Computed as ``ema + (1 - m) * (online - ema)``, which is
        the EMA exactly unchanged for ``m == 1``: how the engine leaves it
        untouched on a skipped update. Out-of-place ops and one copy back, not
        ``lerp_``: torch_xla traces an in-place lerp about 4 times slower.
        """
        ema = list(self.target_encoder.parameters())
        online = list(self.context_encoder.parameters())
        if isinstance(momentum, torch.Tensor):
            weight = (1.0 - momentum).to(device=ema[0].device, dtype=ema[0].dtype)
        else:
            weight = 1.0 - float(momentum)
        step = torch._foreach_mul(torch._foreach_sub(online, ema), weight)
        torch._foreach_copy_(ema, torch._foreach_add(ema, step))

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer groups over the trainable parameters.

        ``decay`` holds every weight matrix/kernel (``ndim >= 2``) with
        ``weight_decay``; ``no_decay`` holds biases, LayerNorm parameters and
        every other 1-D parameter (the predictor's mask token included) with 0.
        The target encoder is not trainable and is in neither group.
        """
        return weight_decay_groups(
            (param for name, param in self.named_parameters() if not name.startswith("target_encoder.")),
            weight_decay,
        )

    def count_parameters(self) -> dict[str, int]:
        """``trainable``: context encoder + predictor parameters (the learned
        weights, mask token included; the fixed position embeddings are
        buffers and not counted). ``ema``: target-encoder parameters."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        ema = sum(p.numel() for p in self.target_encoder.parameters())
        return {"trainable": trainable, "ema": ema}

    def extra_repr(self) -> str:
        return f"grid_size={self.grid_size}, num_patches={self.num_patches}, loss={self.loss_kind!r}"
