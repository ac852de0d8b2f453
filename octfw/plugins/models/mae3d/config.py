"""Config of the ``mae3d`` component (light: attrs only).

Validating a recipe imports it and nothing heavier; the implementation
reads it, and the package's ``__init__`` (:mod:`octfw.plugins.models.mae3d`) registers it
and holds the factory.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from octfw.recipe.fields import choices, doc, positive
from octfw.models.presets import (EncoderArchitecture, PresetSized, describe_presets, init_channels_field,
                                  init_field, model_presets, norm_eps_field, patch_size_field, position_field,
                                  rope_span_field, size_field, standardise_field)

__all__ = ["PRESETS", "PRESET_PARAMETERS", "Architecture", "MAE3DConfig"]

#: Decoder sizes by preset name, beside the shared encoder sizes
#: (:data:`octfw.models.presets.ENCODER_PRESETS`): 'tiny' as narrow as the
#: vjepa3d tiny predictor; 'small' MAE's light decoder (MAE's default is 512
#: wide and 8 deep; its ablation found a narrower, shallower decoder costs
#: little linear-probe accuracy and much less compute); 'base', 'large' and
#: 'giant' MAE's default decoder (ViT-L MAE and RETFound ship it).
DECODER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(decoder_embed_dim=64, decoder_depth=2, decoder_num_heads=2),
    "small": dict(decoder_embed_dim=256, decoder_depth=4, decoder_num_heads=8),
    "base": dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "large": dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "giant": dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "gigantic": dict(decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
}

#: Network sizes by preset name: the encoder of the same vjepa3d preset and a decoder.
PRESETS: dict[str, dict[str, Any]] = model_presets(DECODER_PRESETS)

#: Parameters of each preset with one input channel and patch (4, 16, 16) (they do not
#: depend on the image size: position embeddings are fixed sin-cos): trainable (encoder +
#: decoder) and the exported encoder's. tests/test_mae3d.py checks them.
PRESET_PARAMETERS: dict[str, tuple[int, int]] = {
    "tiny": (718_880, 545_952),
    "small": (25_209_472, 21_687_936),
    "base": (111_982_848, 85_843_200),
    "large": (329_631_744, 303_361_024),
    "giant": (1_039_445_584, 1_011_453_056),
    "gigantic": (1_873_540_672, 1_843_071_872),
}


@attrs.frozen
class Architecture(EncoderArchitecture):
    """The resolved network sizes: the preset with explicit fields applied."""

    decoder_embed_dim: int
    decoder_depth: int
    decoder_num_heads: int


@attrs.frozen
class MAE3DConfig(PresetSized):
    """Masked autoencoder with a 3D ViT: the encoder sees the visible patches, a narrow
    decoder reconstructs the voxels of the masked ones."""

    PRESETS: ClassVar = PRESETS
    ARCHITECTURE: ClassVar = Architecture
    WIDTH_HEADS: ClassVar = (("embed_dim", "num_heads"), ("decoder_embed_dim", "decoder_num_heads"))

    preset: str = doc(
        "network size; the encoder is vjepa3d's of the same name: 'tiny' (CPU), 'small', 'base', "
        "'large' (ViT-L, MAE's and RETFound's), 'giant' (V-JEPA 2's ViT-g). "
        f"{describe_presets(PRESETS, PRESET_PARAMETERS, 'decoder')} (patch 4x16x16, one channel)",
        default="small", validator=choices(*PRESETS),
    )
    patch_size: tuple[int, int, int] = patch_size_field()
    standardise_input: bool = standardise_field()
    position: str = position_field()
    rope_span: int | None = rope_span_field()
    norm_eps: float = norm_eps_field()
    init: str | None = init_field("; a V-JEPA checkpoint's target_encoder (the one it evaluates) becomes the "
                                  "encoder")
    init_channels: str = init_channels_field()
    norm_pix_loss: bool = doc(
        "reconstruct each masked patch normalised by its own voxels' mean and std (MAE's "
        "norm_pix_loss, as RETFound, OCTCube and nnssl train): the loss then rewards texture and "
        "structure over a patch's brightness; false: the raw voxel values",
        default=True,
    )
    embed_dim: int | None = size_field("encoder width")
    depth: int | None = size_field("encoder blocks")
    num_heads: int | None = size_field("encoder attention heads")
    decoder_embed_dim: int | None = size_field("decoder width")
    decoder_depth: int | None = size_field("decoder blocks")
    decoder_num_heads: int | None = size_field("decoder attention heads")
    mlp_ratio: float | None = doc(
        "MLP hidden width / embedding width, encoder and decoder (default: from preset)",
        default=None, validator=positive,
    )
    activation_checkpointing: bool = doc(
        "recompute each transformer block's activations in the backward pass instead of keeping "
        "them: much less activation memory for about one more forward pass of the encoder and decoder",
        default=False,
    )
