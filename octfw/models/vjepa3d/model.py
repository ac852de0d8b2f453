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

import contextlib
import copy
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from octfw.models.vit3d import (
    Block,
    LayerNorm,
    ViT3DEncoder,
    gather_tokens,
    init_weights,
    layer_norm,
    rescale_residual_branches,
    set_activation_checkpointing,
    sincos_pos_embed_3d,
)
from octfw.types import ModelOutput

__all__ = [
    "LOSSES",
    "RANK_TOKENS",
    "Predictor",
    "VJEPA3D",
    "masked_feature_loss",
    "embedding_std",
    "effective_rank",
]

#: Loss names accepted by :class:`VJEPA3D` (and the ``loss`` config key).
LOSSES = ("l1", "mse", "nmse")

#: Tokens :func:`effective_rank` looks at: a fixed-size, evenly strided subset
#: of the batch's target tokens, so its cost is bounded and its shape static.
RANK_TOKENS = 512

#: Mean squared distance of unit embeddings from their centroid below which
#: :func:`effective_rank` reports full collapse (rank 1) instead of the rank
#: of rounding noise.
COLLAPSED_SPREAD = 1e-6


class Predictor(nn.Module):
    """Narrow transformer that predicts target features at masked positions.

    ``forward(context_tokens [B, Nc, E], context_idx [B, Nc], target_idx [B, Nt])``
    returns ``[B, Nt, E]``. Context tokens are projected to the predictor
    width and given their positions again; each masked position gets the one
    learned mask token plus its position embedding, so the predictor knows
    where to predict.
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
        super().__init__()
        self.embed_in = nn.Linear(embed_dim, predictor_embed_dim)
        # 1-D on purpose: param_groups then leaves it out of weight decay, like
        # the other non-matrix parameters.
        self.mask_token = nn.Parameter(torch.zeros(predictor_embed_dim))
        self.register_buffer(
            "pos_embed", sincos_pos_embed_3d(grid_size, predictor_embed_dim)[None], persistent=False
        )
        self.blocks = nn.ModuleList(
            Block(predictor_embed_dim, num_heads, mlp_ratio) for _ in range(depth)
        )
        self.norm = LayerNorm(predictor_embed_dim)
        self.embed_out = nn.Linear(predictor_embed_dim, embed_dim)
        self.apply(init_weights)
        rescale_residual_branches(self.blocks)
        set_activation_checkpointing(self.blocks, activation_checkpointing)

    def forward(
        self, context_tokens: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor
    ) -> torch.Tensor:
        batch = context_tokens.shape[0]
        context = self.embed_in(context_tokens)
        pos = self.pos_embed.to(context.dtype).expand(batch, -1, -1)
        context = context + gather_tokens(pos, context_idx)
        queries = self.mask_token.to(context.dtype) + gather_tokens(pos, target_idx)
        tokens = torch.cat([context, queries], dim=1)
        for block in self.blocks:
            tokens = block(tokens)
        # The masked positions are the last Nt tokens, a static slice.
        predicted = self.norm(tokens[:, context.shape[1]:])
        return self.embed_out(predicted)


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


def embedding_std(features: torch.Tensor) -> torch.Tensor:
    """Collapse signal: the std across all tokens of L2-normalised embeddings,
    averaged over feature channels. ``[..., E]`` -> scalar float32.

    About ``1 / sqrt(E)`` for embeddings spread over the sphere; near 0 when
    every token maps to the same vector (representation collapse).
    """
    unit = F.normalize(features.detach().float().reshape(-1, features.shape[-1]), dim=-1)
    return unit.std(dim=0, correction=0).mean()


#: Device types with an autocast to leave; others (``meta``, in shape-only
#: memory and FLOP estimates) have none.
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xla", "xpu", "mps", "hpu")


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
    x = features.detach().reshape(-1, features.shape[-1])
    stride = max(1, x.shape[0] // max_tokens)  # Python ints: a static slice
    x = x[::stride][:max_tokens].float()
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


class VJEPA3D(nn.Module):
    """V-JEPA with a 3D ViT context encoder, predictor and EMA target encoder.

    ``forward(batch)`` takes the keys of :data:`octfw.types.BATCH_KEYS`
    (``context`` and ``target`` float32 ``[B, C, D, H, W]``, ``context_idx``
    int64 ``[B, Nc]``, ``target_idx`` int64 ``[B, Nt]``) and returns an
    :class:`~octfw.types.ModelOutput` with the loss on masked patches and the
    scalar metrics ``target_std``, ``pred_std`` (see :func:`embedding_std`)
    and ``effective_rank`` of the target features (see :func:`effective_rank`),
    the signals the ``collapse`` guard watches.

    Trainable parameters are those of ``context_encoder`` and ``predictor``;
    ``target_encoder`` (also :attr:`encoder`) is a copy updated only by
    :meth:`ema_update` and never receives gradients.
    """

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
            metrics={
                "target_std": embedding_std(target),
                "pred_std": embedding_std(predicted),
                "effective_rank": effective_rank(target),
            },
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
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad or name.startswith("target_encoder."):
                continue
            (decay if param.ndim >= 2 else no_decay).append(param)
        return [
            {"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
        ]

    def count_parameters(self) -> dict[str, int]:
        """``trainable``: context encoder + predictor parameters (the learned
        weights, mask token included; the fixed position embeddings are
        buffers and not counted). ``ema``: target-encoder parameters."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        ema = sum(p.numel() for p in self.target_encoder.parameters())
        return {"trainable": trainable, "ema": ema}

    def extra_repr(self) -> str:
        return f"grid_size={self.grid_size}, num_patches={self.num_patches}, loss={self.loss_kind!r}"
