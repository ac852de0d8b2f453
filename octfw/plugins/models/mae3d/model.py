"""MAE for 3D volumes: reconstruct the voxels of masked patches.

The encoder (:class:`~octfw.models.vit3d.ViT3DEncoder`, the network octfw
exports) sees only the visible patches of the ``context`` view; a narrow
decoder (:class:`~octfw.models.masked_decoder.MaskedTokenDecoder`, the
network vjepa3d's predictor is) gets those tokens plus learned mask tokens at
the masked positions and predicts the ``pd * ph * pw * C`` voxels of each
masked patch of the ``target`` view (the unaugmented volume by default). With
``norm_pix_loss`` each target patch is first normalised by its own mean and
variance, as MAE (and RETFound, OCTCube, nnssl after it) train. The loss is a
mean squared error on masked patches only. There is no EMA and no second
encoder.

Hot-path rules (see :mod:`octfw.hookspecs`): ``forward`` gathers with
fixed-size index tensors, never indexes with boolean masks, never branches on
tensor values and never reads a tensor on the host.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from octfw.models.health import health_metrics, rank_gram
from octfw.models.masked_decoder import MaskedTokenDecoder, mask_metrics
from octfw.engine.optim import weight_decay_groups
from octfw.models.vit3d import NORM_EPS, ViT3DEncoder, gather_tokens
from octfw.types import BATCH_KEYS, ModelOutput, mask_keys

__all__ = ["NORM_PIX_EPS", "MAE3D", "patchify", "masked_pixel_loss"]

#: Added to each patch's variance before dividing by its square root (MAE's value).
NORM_PIX_EPS = 1e-6


def patchify(volume: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """``[B, C, D, H, W]`` -> ``[B, N, pd * ph * pw * C]``, patches in the row-major
    grid order of :class:`~octfw.models.vit3d.PatchEmbed3D` (token ``k`` is patch ``k``);
    within a patch the voxels run over ``(pd, ph, pw)`` with the channel last."""
    batch, channels, depth, height, width = volume.shape
    pd, ph, pw = patch_size
    gd, gh, gw = depth // pd, height // ph, width // pw
    x = volume.reshape(batch, channels, gd, pd, gh, ph, gw, pw)
    x = x.permute(0, 2, 4, 6, 3, 5, 7, 1)  # [B, gd, gh, gw, pd, ph, pw, C]
    return x.reshape(batch, gd * gh * gw, pd * ph * pw * channels)


def masked_pixel_loss(predicted: torch.Tensor, target: torch.Tensor, norm_pix_loss: bool) -> torch.Tensor:
    """Per-sample loss ``[B]``: mean squared error between ``[B, Nt, P]`` predicted and
    target patch voxels, averaged over the masked patches and their voxels, in float32
    whatever the autocast dtype.

    With ``norm_pix_loss`` each target patch is normalised by its own voxels' mean
    and (unbiased, as MAE's ``var``) variance plus :data:`NORM_PIX_EPS`: a flat
    patch becomes zeros, so its brightness alone costs nothing.
    """
    predicted = predicted.float()
    target = target.float()
    if norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) * torch.rsqrt(var + NORM_PIX_EPS)
    return (predicted - target).square().mean(dim=(1, 2))


class MAE3D(nn.Module):
    """Masked autoencoder with a 3D ViT encoder and a narrow reconstruction decoder.

    ``forward(batch)`` reads its ``inputs``: ``context`` and ``target`` float32
    ``[B, C, D, H, W]`` and, for each mask configuration in ``mask_pairs``, its
    ``context_idx`` int64 ``[B, Nc]`` and ``target_idx`` int64 ``[B, Nt]``
    (:func:`octfw.types.mask_keys`; MAE's random masking is one pair, several
    pairs' losses are averaged). It returns an :class:`~octfw.types.ModelOutput`
    with the reconstruction loss on the masked patches and the scalar metrics the
    ``collapse`` guard, ``octfw plot`` and the benchmarks read for every model:

    - ``target_std``, ``effective_rank`` and ``position_share``: of the encoder's
      output tokens, the encoder being what octfw exports and probes (the "target
      encoder" of a model without EMA). They are the visible tokens of the first
      pair, the only ones the encoder computes in training (see :mod:`octfw.models.health`).
    - ``pred_std``: :func:`~octfw.models.health.embedding_std` of the
      reconstructed patches.

    All parameters are trainable; :attr:`encoder` is the network to export.
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
        decoder_embed_dim: int,
        decoder_depth: int,
        decoder_num_heads: int,
        mlp_ratio: float = 4.0,
        norm_pix_loss: bool = True,
        activation_checkpointing: bool = False,
        mask_pairs: tuple[str, ...] = ("",),
        standardise_input: bool = False,
        position: str = "sincos",
        norm_eps: float = NORM_EPS,
        rope_span: int | None = None,
    ):
        super().__init__()
        self.norm_pix_loss = norm_pix_loss
        self.mask_pairs = tuple(mask_pairs)
        self.inputs = ("context", "target", *(key for pair in self.mask_pairs for key in mask_keys(pair)))
        self.encoder = ViT3DEncoder(
            image_size, patch_size, in_channels, embed_dim, depth, num_heads, mlp_ratio,
            activation_checkpointing=activation_checkpointing, standardise_input=standardise_input,
            position=position, norm_eps=norm_eps, rope_span=rope_span,
        )
        patch_voxels = patch_size[0] * patch_size[1] * patch_size[2] * in_channels
        self.decoder = MaskedTokenDecoder(
            self.encoder.grid_size, embed_dim, decoder_embed_dim, decoder_depth, decoder_num_heads,
            mlp_ratio, out_dim=patch_voxels, activation_checkpointing=activation_checkpointing,
            position=position, norm_eps=norm_eps, rope_span=rope_span,
        )

    # --- geometry -----------------------------------------------------------

    @property
    def grid_size(self) -> tuple[int, int, int]:
        """The patch grid ``(D/pd, H/ph, W/pw)``."""
        return self.encoder.grid_size

    @property
    def num_patches(self) -> int:
        return self.encoder.num_patches

    # --- forward ------------------------------------------------------------

    def reconstruct(
        self, context: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(visible tokens [B, Nc, E], reconstructed patches at target_idx [B, Nt, P])``."""
        visible = self.encoder(context, keep_idx=context_idx)
        return visible, self.decoder(visible, context_idx, target_idx)

    def target_patches(self, target: torch.Tensor, target_idx: torch.Tensor) -> torch.Tensor:
        """The voxels of the ``target`` view's patches at ``target_idx``: ``[B, Nt, P]``."""
        return gather_tokens(patchify(target, self.encoder.patch_size), target_idx)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> ModelOutput:
        losses, seen = [], []
        for pair in self.mask_pairs:
            context_key, target_key = mask_keys(pair)
            visible, predicted = self.reconstruct(batch["context"], batch[context_key], batch[target_key])
            target = self.target_patches(batch["target"], batch[target_key])
            losses.append(masked_pixel_loss(predicted, target, self.norm_pix_loss))
            seen.append((visible, predicted, batch[context_key]))
        per_sample = torch.stack(losses).mean(dim=0)
        visible, predicted, positions = seen[0]
        return ModelOutput(
            loss=per_sample.mean(),
            per_sample_loss=per_sample,
            metrics={**health_metrics(visible, predicted, positions, self.num_patches),
                     **mask_metrics(batch, self.mask_pairs, per_sample)},
            health_gram=rank_gram(visible),
        )

    @torch.no_grad()
    def embed(self, volume: torch.Tensor) -> torch.Tensor:
        """Encoder features of every patch of ``volume``: ``[B, N, E]``."""
        return self.encoder(volume)

    # --- training hooks -----------------------------------------------------

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer groups (see :func:`~octfw.engine.optim.weight_decay_groups`):
        weight matrices decay, biases, norms and the mask token do not."""
        return weight_decay_groups(self.parameters(), weight_decay)

    def count_parameters(self) -> dict[str, int]:
        """``trainable``: encoder + decoder parameters (the fixed position
        embeddings are buffers and not counted); ``ema``: 0, there is no EMA copy."""
        return {"trainable": sum(p.numel() for p in self.parameters() if p.requires_grad), "ema": 0}

    def extra_repr(self) -> str:
        return (f"grid_size={self.grid_size}, num_patches={self.num_patches}, "
                f"norm_pix_loss={self.norm_pix_loss}")
