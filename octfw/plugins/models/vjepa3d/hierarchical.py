"""V-JEPA 2.1's predictor and the level norms of its dense loss (``dense_predictor = "vjepa2.1"``).

Facts of the reference (facebookresearch/vjepa2 ``app/vjepa_2_1``, commit 204698b), which this
network computes number for number (tests/test_vjepa21_parity.py):

- the encoder hands the predictor its tokens after 4 blocks (:data:`REFERENCE_LEVELS`), each
  through its own affine LayerNorm (``norms_block``), side by side: ``[B, Nc, 4E]``; the last
  of those norms is the encoder's output norm (octfw's ``norm``), the other three are
  training-only state (:class:`VJEPA3D`'s ``level_norms``, and their EMA copy);
- ``predictor_embed`` maps ``4E`` to the predictor's width through ``E`` (Linear, GELU,
  Linear): octfw's ``embed_in``;
- one learned modality token (``video_mod_embed``) is added to every token, context and
  mask tokens alike, before the blocks: ``mod_embed``;
- after the final norm, the masked tokens go through ``predictor_proj`` (``embed_out``) and
  the context tokens through their own ``predictor_proj_context`` (``embed_out_context``),
  each to ``4E``.

The reference sorts the tokens by patch index before its blocks and back after them; with
rotary positions and no attention mask the blocks do not depend on the order, so octfw keeps
context then mask tokens (the same numbers up to float rounding).
"""

from __future__ import annotations

import torch
from torch import nn

from octfw.models.masked_decoder import MaskedTokenDecoder
from octfw.models.vit3d import NORM_EPS, init_weights

__all__ = ["REFERENCE_LEVELS", "HierarchicalPredictor", "level_depths"]

#: The encoder blocks (1 = the first) whose tokens V-JEPA 2.1 predicts, by encoder depth:
#: ``hierarchical_layers`` of its VisionTransformer (ViT-B, ViT-L, ViT-g, ViT-G). Not evenly
#: spaced for 48 blocks.
REFERENCE_LEVELS: dict[int, tuple[int, ...]] = {
    12: (3, 6, 9, 12), 24: (6, 12, 18, 24), 40: (10, 20, 30, 40), 48: (12, 24, 38, 48),
}


def level_depths(depth: int, levels: int, reference: bool) -> tuple[int, ...]:
    """The blocks whose tokens the dense loss predicts: ``levels`` evenly spaced ones, the last
    block included; with ``reference`` and 4 levels, V-JEPA 2.1's own where it has them
    (:data:`REFERENCE_LEVELS`; at other depths the reference has none and the even spacing
    stands in)."""
    if reference and levels == 4 and depth in REFERENCE_LEVELS:
        return REFERENCE_LEVELS[depth]
    return tuple(depth * (i + 1) // levels for i in range(levels))


class HierarchicalPredictor(MaskedTokenDecoder):
    """V-JEPA 2.1's predictor: ``forward(context_levels [B, Nc, L*E], context_idx [B, Nc],
    target_idx [B, Nt])`` returns the predictions at the masked positions ``[B, Nt, L*E]``
    and at the context positions ``[B, Nc, L*E]``, each level side by side."""

    def __init__(
        self,
        grid_size: tuple[int, int, int],
        embed_dim: int,
        width: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float,
        activation_checkpointing: bool = False,
        levels: int = 4,
        position: str = "sincos",
        norm_eps: float = NORM_EPS,
        rope_span: int | None = None,
    ):
        super().__init__(grid_size, embed_dim * levels, width, depth, num_heads, mlp_ratio,
                         out_dim=embed_dim * levels, activation_checkpointing=activation_checkpointing,
                         position=position, norm_eps=norm_eps, rope_span=rope_span)
        self.levels = levels
        self.embed_in = nn.Sequential(nn.Linear(embed_dim * levels, embed_dim), nn.GELU(),
                                      nn.Linear(embed_dim, width))
        # 1-D as the mask token, so that param_groups leaves it out of weight decay.
        self.mod_embed = nn.Parameter(torch.zeros(width))
        self.embed_out_context = nn.Linear(width, embed_dim * levels)
        self.embed_in.apply(init_weights)
        self.embed_out_context.apply(init_weights)

    def join(self, context: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        return torch.cat([context, queries], dim=1) + self.mod_embed.to(context.dtype)

    def forward(self, context_tokens: torch.Tensor, context_idx: torch.Tensor,
                target_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, num_context = self.run(context_tokens, context_idx, target_idx)
        tokens = self.norm(tokens)
        # Static slices: the masked positions are the last Nt tokens.
        return self.embed_out(tokens[:, num_context:]), self.embed_out_context(tokens[:, :num_context])
