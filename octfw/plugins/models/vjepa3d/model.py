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
from functools import partial
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from octfw.engine.optim import weight_decay_groups
from octfw.models.ema import ema_update_
from octfw.models.health import health_metrics, rank_gram
from octfw.models.masked_decoder import MaskedTokenDecoder, mask_metrics
from octfw.models.vit3d import (
    NORM_EPS,
    LayerNorm,
    ViT3DEncoder,
    gather_tokens,
    layer_norm,
    set_activation_checkpointing,
)
from octfw.plugins.models.vjepa3d.hierarchical import HierarchicalPredictor, level_depths
from octfw.types import BATCH_KEYS, ModelOutput, mask_keys

__all__ = [
    "LOSSES",
    "Predictor",
    "VJEPA3D",
    "masked_feature_loss",
    "token_errors",
    "context_weights",
]

#: Loss names accepted by :class:`VJEPA3D` (and the ``loss`` config key).
LOSSES = ("l1", "mse", "nmse")
#: The dense loss's predictors (the ``dense_predictor`` config key).
DENSE_PREDICTORS = ("octfw", "vjepa2.1")


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
        out_dim: int | None = None,
        position: str = "sincos",
        norm_eps: float = NORM_EPS,
        rope_span: int | None = None,
    ):
        super().__init__(grid_size, embed_dim, predictor_embed_dim, depth, num_heads, mlp_ratio,
                         out_dim=out_dim or embed_dim, activation_checkpointing=activation_checkpointing,
                         position=position, norm_eps=norm_eps, rope_span=rope_span)


def _l1(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token mean absolute error ``[B, N]`` in float32, the targets as they are."""
    return (predicted.float() - target.float()).abs().mean(dim=2)


def masked_feature_loss(predicted: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-sample loss ``[B]`` between ``[B, Nt, E]`` predictions and targets: the mean over
    tokens of :func:`token_errors`."""
    return token_errors(predicted, target, kind).mean(dim=1)


def token_errors(predicted: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token error ``[B, N]`` between ``[B, N, E]`` predictions and targets.

    Computed in float32 whatever the autocast dtype, averaged over feature
    channels:

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
    return error.mean(dim=2)


#: Most elements of one chunk of the context-to-target distance matrix (:func:`context_weights`).
_DISTANCE_CHUNK = 1 << 24


@torch.no_grad()
def context_weights(context_idx: torch.Tensor, target_idx: torch.Tensor,
                    grid: tuple[int, int, int]) -> torch.Tensor:
    """V-JEPA 2.1's weight of each context token in the dense loss: ``1 / sqrt(d)``, ``d`` the
    distance on the patch grid to the nearest target token. ``[B, Nc]`` float32 in (0, 1]: a
    token next to the mask counts fully, one far from it less. The distance matrix is taken a
    few samples at a time (static chunks) so a 9,216-patch grid does not hold B x 3k x 6k."""
    _, gh, gw = grid

    def coordinates(idx: torch.Tensor) -> torch.Tensor:
        return torch.stack([idx // (gh * gw), (idx // gw) % gh, idx % gw], dim=-1).float()

    batch, num_context = context_idx.shape
    step = max(1, _DISTANCE_CHUNK // max(1, num_context * target_idx.shape[1]))
    nearest = torch.cat([
        torch.cdist(coordinates(context_idx[i:i + step]), coordinates(target_idx[i:i + step])).amin(dim=2)
        for i in range(0, batch, step)
    ])
    return nearest.clamp_min(1.0).rsqrt()


class VJEPA3D(nn.Module):
    """V-JEPA with a 3D ViT context encoder, predictor and EMA target encoder.

    ``forward(batch)`` reads its ``inputs``: ``context`` and ``target`` float32
    ``[B, C, D, H, W]`` and, for each mask configuration in ``mask_pairs``, its
    ``context_idx`` int64 ``[B, Nc]`` and ``target_idx`` int64 ``[B, Nt]`` (named
    by :func:`octfw.types.mask_keys`). As in V-JEPA, the target encoder encodes
    the full target view once; each configuration is its own context/target
    pair (the context encoder and predictor run once per pair) and the loss is
    the mean of the pairs' losses. It returns an :class:`~octfw.types.ModelOutput`
    with that loss, the scalar metrics ``target_std``, ``pred_std`` (see
    :func:`~octfw.models.health.embedding_std`), ``effective_rank`` and
    ``position_share`` of the target features (see :mod:`octfw.models.health`),
    the signals the ``collapse`` guard watches, each configuration's token counts
    (:func:`~octfw.models.masked_decoder.mask_metrics`), and the Gram matrix of a sample of the target tokens for RankMe.

    Trainable parameters are those of ``context_encoder`` and ``predictor``;
    ``target_encoder`` (also :attr:`encoder`) is a copy updated only by
    :meth:`ema_update` and never receives gradients.
    """

    #: the batch keys forward reads (octfw.types.Model.inputs); set from ``mask_pairs``
    inputs: tuple[str, ...] = BATCH_KEYS

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
        predictor_mlp_ratio: float | None = None,
        loss: str = "l1",
        activation_checkpointing: bool = False,
        mask_pairs: tuple[str, ...] = ("",),
        standardise_input: bool = False,
        dense_levels: int = 0,
        context_loss_weight: float = 0.5,
        dense_predictor: str = "octfw",
        context_distance_weighting: bool = True,
        position: str = "sincos",
        norm_eps: float = NORM_EPS,
        rope_span: int | None = None,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
        if not 0 <= dense_levels <= depth:
            raise ValueError(f"dense_levels must be in [0, depth = {depth}], got {dense_levels}")
        if dense_predictor not in DENSE_PREDICTORS:
            raise ValueError(f"unknown dense_predictor {dense_predictor!r}; choose one of {', '.join(DENSE_PREDICTORS)}")
        #: V-JEPA 2.1's own predictor, level norms and loss (hierarchical.py), else octfw's.
        self.hierarchical = dense_predictor == "vjepa2.1"
        if self.hierarchical and (dense_levels != 4 or loss != "l1"):
            raise ValueError("dense_predictor 'vjepa2.1' predicts 4 levels with the L1 loss: "
                             f"dense_levels = 4 and loss = 'l1', got {dense_levels} and {loss!r}")
        self.loss_kind = loss
        #: V-JEPA 2.1's dense loss when > 0: the encoder depths whose tokens are predicted
        #: (the last block included) and the weight of the loss on the context.
        self.level_depths = level_depths(depth, dense_levels, self.hierarchical) if dense_levels else ()
        self.context_loss_weight = float(context_loss_weight)
        self.context_distance_weighting = bool(context_distance_weighting)
        self.mask_pairs = tuple(mask_pairs)
        self.inputs = ("context", "target", *(key for pair in self.mask_pairs for key in mask_keys(pair)))
        self.context_encoder = ViT3DEncoder(
            image_size, patch_size, in_channels, embed_dim, depth, num_heads, mlp_ratio,
            activation_checkpointing=activation_checkpointing, standardise_input=standardise_input,
            position=position, norm_eps=norm_eps, rope_span=rope_span,
        )
        predictor_class = Predictor
        if self.hierarchical:
            predictor_class = partial(HierarchicalPredictor, levels=dense_levels)
        self.predictor = predictor_class(
            self.context_encoder.grid_size,
            embed_dim,
            predictor_embed_dim,
            predictor_depth,
            predictor_num_heads,
            mlp_ratio if predictor_mlp_ratio is None else predictor_mlp_ratio,
            activation_checkpointing=activation_checkpointing,
            **({} if self.hierarchical else {"out_dim": embed_dim * max(1, dense_levels)}),
            position=position,
            norm_eps=norm_eps,
            rope_span=rope_span,
        )
        #: Update steps the context encoder is held while the predictor trains (:meth:`param_groups`).
        self.predictor_warmup_steps: int | None = None
        self.target_encoder = copy.deepcopy(self.context_encoder)
        self.target_encoder.requires_grad_(False)
        # It runs under no_grad, where nothing is saved and nothing to recompute.
        set_activation_checkpointing(self.target_encoder.blocks, False)
        if self.hierarchical:
            # V-JEPA 2.1's norms_block but the last (which is the encoder's norm): training-only
            # state beside the encoders, so that the exported encoder stays a plain ViT3DEncoder.
            self.level_norms = nn.ModuleList(LayerNorm(embed_dim, eps=norm_eps) for _ in range(dense_levels - 1))
            self.target_level_norms = copy.deepcopy(self.level_norms).requires_grad_(False)

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

    def hierarchy(self, volume: torch.Tensor, keep_idx: torch.Tensor | None = None,
                  target: bool = False) -> list[torch.Tensor]:
        """``dense_predictor = "vjepa2.1"``: the context (or target) encoder's tokens at each of
        :attr:`level_depths`, each through its norm (the last through the encoder's own), as
        V-JEPA 2.1's encoder returns them in training (``norms_block``); each ``[B, K or N, E]``."""
        encoder, norms = ((self.target_encoder, self.target_level_norms) if target
                          else (self.context_encoder, self.level_norms))
        levels = encoder.levels(volume, keep_idx, depths=self.level_depths)
        return [norm(level) for norm, level in zip(norms, levels)] + levels[-1:]

    def forward(self, batch: Mapping[str, torch.Tensor]) -> ModelOutput:
        if self.hierarchical:
            return self._forward_hierarchical(batch)
        with torch.no_grad():  # every patch, once for all pairs
            if self.level_depths:
                levels = self.target_encoder.levels(batch["target"], depths=self.level_depths)
                tokens = levels[-1]
                # Each depth normalised on its own, then side by side: what the predictor predicts.
                targets = torch.cat([layer_norm(level, level.shape[-1:]) for level in levels], dim=-1)
            else:
                tokens = targets = self.target_encoder(batch["target"])
        losses, predictions = [], []
        for pair in self.mask_pairs:
            context_key, target_key = mask_keys(pair)
            context_idx, target_idx = batch[context_key], batch[target_key]
            visible = self.context_encoder(batch["context"], keep_idx=context_idx)
            if self.level_depths:
                predicted, predicted_context = self.predictor(visible, context_idx, target_idx, with_context=True)
                errors = token_errors(predicted_context, gather_tokens(targets, context_idx), self.loss_kind)
                if self.context_distance_weighting:
                    errors = errors * context_weights(context_idx, target_idx, self.grid_size)
                context_loss = errors.mean(dim=1)
            else:
                predicted = self.predictor(visible, context_idx, target_idx)
                context_loss = 0.0
            loss = masked_feature_loss(predicted, gather_tokens(targets, target_idx), self.loss_kind)
            losses.append(loss + self.context_loss_weight * context_loss)
            predictions.append(predicted[..., -tokens.shape[-1]:])  # the last depth's prediction
        per_sample = torch.stack(losses).mean(dim=0)
        return ModelOutput(
            loss=per_sample.mean(),
            per_sample_loss=per_sample,
            metrics={**health_metrics(tokens, torch.cat(predictions, dim=1)),
                     **mask_metrics(batch, self.mask_pairs, per_sample)},
            health_gram=rank_gram(tokens),
        )

    def _forward_hierarchical(self, batch: Mapping[str, torch.Tensor]) -> ModelOutput:
        """V-JEPA 2.1's train step (``app/vjepa_2_1/train.py``, one clip length, ``loss_exp`` 1):
        targets are the target encoder's levels, each layer-normed on its own (no affine), side
        by side; the loss is the L1 error of the masked predictions plus ``context_loss_weight``
        times that of the context predictions, each context token's weighted by
        :func:`context_weights` with ``context_distance_weighting``; each averaged over tokens
        and channels, then over the mask pairs."""
        with torch.no_grad():  # every patch, once for all pairs
            levels = self.hierarchy(batch["target"], target=True)
            tokens = levels[-1]
            targets = torch.cat([layer_norm(level, level.shape[-1:]) for level in levels], dim=-1)
        losses, predictions = [], []
        for pair in self.mask_pairs:
            context_key, target_key = mask_keys(pair)
            context_idx, target_idx = batch[context_key], batch[target_key]
            visible = torch.cat(self.hierarchy(batch["context"], context_idx), dim=-1)
            predicted, predicted_context = self.predictor(visible, context_idx, target_idx)
            loss = _l1(predicted, gather_tokens(targets, target_idx)).mean(dim=1)
            errors = _l1(predicted_context, gather_tokens(targets, context_idx))
            if self.context_distance_weighting:
                errors = errors * context_weights(context_idx, target_idx, self.grid_size)
            losses.append(loss + self.context_loss_weight * errors.mean(dim=1))
            predictions.append(predicted[..., -tokens.shape[-1]:])  # the last level's prediction
        per_sample = torch.stack(losses).mean(dim=0)
        return ModelOutput(
            loss=per_sample.mean(),
            per_sample_loss=per_sample,
            metrics={**health_metrics(tokens, torch.cat(predictions, dim=1)),
                     **mask_metrics(batch, self.mask_pairs, per_sample)},
            health_gram=rank_gram(tokens),
        )

    @torch.no_grad()
    def embed(self, volume: torch.Tensor) -> torch.Tensor:
        """Target-encoder features of every patch of ``volume``: ``[B, N, E]``."""
        return self.target_encoder(volume)

    # --- training hooks -----------------------------------------------------

    @torch.no_grad()
    def ema_update(self, momentum: torch.Tensor | float) -> None:
        """``ema = m * ema + (1 - m) * online`` for every target-encoder parameter
        (:func:`octfw.models.ema.ema_update_`; ``momentum``: a float or a 0-dim tensor on the
        model's device, no host sync)."""
        ema = list(self.target_encoder.parameters())
        online = list(self.context_encoder.parameters())
        if self.hierarchical:  # V-JEPA 2.1's level norms are part of its EMA encoder
            ema += list(self.target_level_norms.parameters())
            online += list(self.level_norms.parameters())
        ema_update_(ema, online, momentum)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer groups over the trainable parameters.

        ``decay`` holds every weight matrix/kernel (``ndim >= 2``) with
        ``weight_decay``; ``no_decay`` holds biases, LayerNorm parameters and
        every other 1-D parameter (the predictor's mask token included) with 0.
        The target encoder is not trainable and is in neither group.

        With :attr:`predictor_warmup_steps` not None, four: the context encoder's two (2.1's level
        norms with it), held so long (:data:`~octfw.engine.optim.HELD_UNTIL`), the predictor's two.
        """
        trainable = [(n, p) for n, p in self.named_parameters() if not n.startswith("target_")]  # not the EMA
        if self.predictor_warmup_steps is None:
            return weight_decay_groups((param for _, param in trainable), weight_decay)
        encoder = weight_decay_groups((p for n, p in trainable if not n.startswith("predictor.")), weight_decay)
        predictor = weight_decay_groups((p for n, p in trainable if n.startswith("predictor.")), weight_decay)
        for group in encoder:
            group.update(name=f"encoder_{group['name']}", held_until=self.predictor_warmup_steps)
        return encoder + predictor

    def count_parameters(self) -> dict[str, int]:
        """``trainable``: context encoder + predictor parameters (the learned
        weights, mask token included; the fixed position embeddings are
        buffers and not counted; V-JEPA 2.1's level norms with
        ``dense_predictor = "vjepa2.1"``). ``ema``: target-encoder parameters."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        ema = sum(p.numel() for p in self.target_encoder.parameters())
        return {"trainable": trainable, "ema": ema}

    def extra_repr(self) -> str:
        return f"grid_size={self.grid_size}, num_patches={self.num_patches}, loss={self.loss_kind!r}"
