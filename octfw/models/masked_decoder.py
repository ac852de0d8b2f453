"""The narrow transformer that fills in masked patches, shared by the models.

V-JEPA's predictor and MAE's decoder are the same network with a different
output head: encoded visible tokens are projected to a narrower width and
given their positions again; each masked position gets one learned mask token
plus its position embedding; pre-norm blocks and a final norm run over both;
a linear head maps the tokens at the masked positions to what the model
predicts (target-encoder features for ``vjepa3d``, the voxels of the patch for
``mae3d``).

XLA-friendly: positions are taken with fixed-size index tensors
(:func:`octfw.models.vit3d.gather_tokens`) and the masked positions are a
static slice.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from octfw.models.vit3d import (
    NORM_EPS,
    POSITIONS,
    ROTARY,
    Block,
    LayerNorm,
    gather_tokens,
    init_weights,
    rope_tables,
    rescale_residual_branches,
    set_activation_checkpointing,
    sincos_pos_embed_3d,
)
from octfw.types import mask_keys

__all__ = ["MaskedTokenDecoder", "mask_metrics"]


class MaskedTokenDecoder(nn.Module):
    """Visible tokens + mask tokens at the masked positions -> predictions there.

    ``forward(context_tokens [B, Nc, in_dim], context_idx [B, Nc], target_idx [B, Nt])``
    returns ``[B, Nt, out_dim]``. The submodules (and so the state-dict keys)
    are ``embed_in``, ``mask_token``, ``blocks``, ``norm`` and ``embed_out``;
    the sin-cos ``pos_embed`` is a buffer that is not saved (``position="learned"``: a
    saved parameter; ``"rope"``: no table, the blocks rotate queries and keys, V-JEPA 2).
    """

    def __init__(
        self,
        grid_size: tuple[int, int, int],
        in_dim: int,
        width: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float,
        out_dim: int,
        activation_checkpointing: bool = False,
        position: str = "sincos",
        norm_eps: float = NORM_EPS,
        rope_span: int | None = None,
    ):
        super().__init__()
        self.rope_span = rope_span
        if position not in POSITIONS:
            raise ValueError(f"unknown position {position!r}; choose one of {', '.join(POSITIONS)}")
        self.position = position
        self.grid_size = tuple(grid_size)
        self.head_dim = width // num_heads
        self.embed_in = nn.Linear(in_dim, width)
        # 1-D on purpose: param_groups then leaves it out of weight decay, like
        # the other non-matrix parameters.
        self.mask_token = nn.Parameter(torch.zeros(width))
        if position == "sincos":
            self.register_buffer(
                "pos_embed", sincos_pos_embed_3d(grid_size, width)[None], persistent=False
            )
        elif position == "learned":
            self.pos_embed = nn.Parameter(sincos_pos_embed_3d(grid_size, width)[None])
            self.pos_embed.no_weight_decay = True  # a position table, not a weight
        # "rope": each block rotates queries and keys by the tokens' grid positions.
        self.blocks = nn.ModuleList(Block(width, num_heads, mlp_ratio, norm_eps) for _ in range(depth))
        self.norm = LayerNorm(width, eps=norm_eps)
        self.embed_out = nn.Linear(width, out_dim)
        # Built in this order, then initialised: the draws from the RNG (and
        # so a seeded vjepa3d predictor) are those of the original Predictor.
        self.apply(init_weights)
        rescale_residual_branches(self.blocks)
        set_activation_checkpointing(self.blocks, activation_checkpointing)

    def forward(
        self, context_tokens: torch.Tensor, context_idx: torch.Tensor, target_idx: torch.Tensor,
        with_context: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Predictions at ``target_idx`` ``[B, Nt, out_dim]``; with ``with_context`` also those at
        ``context_idx`` ``[B, Nc, out_dim]`` (V-JEPA 2.1's dense loss predicts every token)."""
        tokens, num_context = self.run(context_tokens, context_idx, target_idx)
        # The masked positions are the last Nt tokens, a static slice.
        if with_context:
            predicted = self.embed_out(self.norm(tokens))
            return predicted[:, num_context:], predicted[:, :num_context]
        return self.embed_out(self.norm(tokens[:, num_context:]))

    def run(self, context_tokens: torch.Tensor, context_idx: torch.Tensor,
            target_idx: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The context tokens then the mask tokens through the blocks (before the final norm):
        ``[B, Nc + Nt, width]``, and ``Nc``."""
        batch = context_tokens.shape[0]
        context = self.embed_in(context_tokens)
        rope = None
        if self.position in ROTARY:  # structural choices, not branches on tensor values
            queries = self.mask_token.to(context.dtype).expand(batch, target_idx.shape[1], -1)
            rope = rope_tables(self.grid_size, self.head_dim, torch.cat([context_idx, target_idx], dim=1),
                               interleaved=self.position == "rope-interleaved", span=self.rope_span)
        else:
            pos = self.pos_embed.to(context.dtype).expand(batch, -1, -1)
            context = context + gather_tokens(pos, context_idx)
            queries = self.mask_token.to(context.dtype) + gather_tokens(pos, target_idx)
        tokens = self.join(context, queries)
        for block in self.blocks:
            tokens = block(tokens, rope)
        return tokens, context.shape[1]

    def join(self, context: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """The tokens the blocks read: context then queries (a subclass adds to them)."""
        return torch.cat([context, queries], dim=1)


def mask_metrics(batch: Mapping[str, torch.Tensor], pairs: tuple[str, ...],
                 like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each mask configuration's token counts as metrics (``mask/context_tokens``,
    ``mask/short/target_tokens``, ...): filled constants from the static index shapes,
    no copy from the host and the same graph every step."""
    metrics = {}
    for pair in pairs:
        prefix = f"mask/{pair}/" if pair else "mask/"
        for side, key in zip(("context", "target"), mask_keys(pair)):
            metrics[f"{prefix}{side}_tokens"] = like.new_full((), float(batch[key].shape[1]), dtype=torch.float32)
    return metrics
