"""Config of the ``vjepa3d`` component (light: attrs only).

Validating a recipe imports it and nothing heavier; the implementation
reads it, and the package's ``__init__`` (:mod:`octfw.plugins.models.vjepa3d`) registers it
and holds the factory.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from octfw.recipe.fields import choices, doc, non_negative, positive
from octfw.models.presets import (EncoderArchitecture, PresetSized, describe_presets, init_channels_field,
                                  init_field, model_presets, norm_eps_field, patch_size_field, position_field,
                                  rope_span_field, size_field, standardise_field)

__all__ = ["PRESETS", "Architecture", "VJEPA3DConfig"]

#: Predictor sizes by preset name, beside the shared encoder sizes
#: (:data:`octfw.models.presets.ENCODER_PRESETS`).
PREDICTOR_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(predictor_embed_dim=64, predictor_depth=2, predictor_num_heads=2, predictor_mlp_ratio=4.0),
    "small": dict(predictor_embed_dim=320, predictor_depth=6, predictor_num_heads=5, predictor_mlp_ratio=4.0),
    "base": dict(predictor_embed_dim=384, predictor_depth=12, predictor_num_heads=12, predictor_mlp_ratio=4.0),
    # V-JEPA 2's predictor for its ViT-L and ViT-g (facebookresearch/vjepa2 configs/train and
    # src/hub/backbones.py: pred_embed_dim 384, pred_depth 12, pred_num_heads 12; its
    # vit_predictor's MLP is 4 wide whatever the encoder's, 48/11 for the ViT-g).
    "large": dict(predictor_embed_dim=384, predictor_depth=12, predictor_num_heads=12, predictor_mlp_ratio=4.0),
    "giant": dict(predictor_embed_dim=384, predictor_depth=12, predictor_num_heads=12, predictor_mlp_ratio=4.0),
    # V-JEPA 2.1 trains its ViT-G with a predictor of 24 blocks, 384 wide (a misfit with a
    # checkpoint's predictor is refused naming both: set predictor_depth to its depth).
    "gigantic": dict(predictor_embed_dim=384, predictor_depth=24, predictor_num_heads=12, predictor_mlp_ratio=4.0),
}

#: Network sizes by preset name. ``small`` is the seeds' V-JEPA3D: with one
#: input channel and patch (4, 16, 16) it has 29,333,120 trainable parameters
#: (context encoder + predictor), within 0.3% of the seeds' 29.4M.
PRESETS: dict[str, dict[str, Any]] = model_presets(PREDICTOR_PRESETS)

#: Parameters of each preset with one input channel and patch (4, 16, 16) (they do not
#: depend on the image size: position embeddings are fixed sin-cos): trainable (context
#: encoder + predictor) and the exported encoder's. tests/test_vjepa3d.py checks them.
PRESET_PARAMETERS: dict[str, tuple[int, int]] = {
    "tiny": (658_560, 545_952),
    "small": (29_333_120, 21_687_936),
    "base": (107_728_896, 85_843_200),
    "large": (325_443_584, 303_361_024),
    "giant": (1_033_830_912, 1_011_453_056),
    "gigantic": (1_886_940_160, 1_843_071_872),
}


LOSS_CHOICES = ("l1", "mse", "nmse")
#: Update steps the encoder is held by default while a new predictor trains (at most a tenth of
#: the run): benchmarks/learning/README.md, "A new predictor on a pretrained encoder".
PREDICTOR_WARMUP_STEPS = 300
DENSE_PREDICTOR_CHOICES = ("octfw", "vjepa2.1")


@attrs.frozen
class Architecture(EncoderArchitecture):
    """The resolved network sizes: the preset with explicit fields applied."""

    predictor_embed_dim: int
    predictor_depth: int
    predictor_num_heads: int
    predictor_mlp_ratio: float


@attrs.frozen
class VJEPA3DConfig(PresetSized):
    """V-JEPA with a 3D ViT: context encoder, narrower predictor, EMA target encoder."""

    PRESETS: ClassVar = PRESETS
    ARCHITECTURE: ClassVar = Architecture
    WIDTH_HEADS: ClassVar = (("embed_dim", "num_heads"), ("predictor_embed_dim", "predictor_num_heads"))

    preset: str = doc(
        "network size: 'tiny' (CPU quickstart), 'small' (the seeds' 29.4M model), 'base', 'large' "
        "(V-JEPA 2's ViT-L), 'giant' (V-JEPA 2's ViT-g). "
        f"{describe_presets(PRESETS, PRESET_PARAMETERS)} (patch 4x16x16, one channel)",
        default="small", validator=choices(*PRESETS),
    )
    patch_size: tuple[int, int, int] = patch_size_field()
    standardise_input: bool = standardise_field()
    position: str = position_field()
    rope_span: int | None = rope_span_field()
    norm_eps: float = norm_eps_field()
    init: str | None = init_field("; the EMA target encoder starts from the checkpoint's target_encoder, the "
                                  "predictor from its predictor where the sizes match (init_predictor)")
    init_predictor: bool = doc(
        "with init: continue the checkpoint's predictor too (V-JEPA pretraining continued) where its width, "
        "depth and output match the recipe's; false: a fresh predictor",
        default=True,
    )
    init_channels: str = init_channels_field()
    predictor_warmup_steps: int | None = doc(
        "update steps at the start of training for which the context encoder's learning rate is 0 (the "
        "encoder held, and its EMA copy with it) while the predictor trains, so that a new predictor's first "
        "gradients do not reach a pretrained encoder at the full learning rate; then the schedule's. Default: "
        f"{PREDICTOR_WARMUP_STEPS} (at most a tenth of the run) when init leaves the predictor new, else 0. "
        "Fixed when the run starts: a resumed run holds until the same step",
        default=None, validator=non_negative,
    )
    loss: str = doc(
        "'l1' on layer-normed targets (V-JEPA), 'mse', or 'nmse' (MSE of L2-normalised vectors, the seeds')",
        default="l1", validator=choices(*LOSS_CHOICES),
    )
    embed_dim: int | None = size_field("encoder width")
    depth: int | None = size_field("encoder blocks")
    num_heads: int | None = size_field("encoder attention heads")
    predictor_embed_dim: int | None = size_field("predictor width")
    predictor_depth: int | None = size_field("predictor blocks")
    predictor_num_heads: int | None = size_field("predictor attention heads")
    mlp_ratio: float | None = doc(
        "MLP hidden width / embedding width of the encoder (default: from preset)", default=None, validator=positive,
    )
    predictor_mlp_ratio: float | None = doc(
        "MLP hidden width / width of the predictor (default: from preset, 4 as V-JEPA 2's predictor)",
        default=None, validator=positive,
    )
    dense_levels: int = doc(
        "V-JEPA 2.1's dense loss: 0 = off (plain V-JEPA); N > 0 = the predictor predicts the target "
        "encoder's tokens at N evenly spaced depths (V-JEPA 2.1: 4), each layer-normed, at the masked "
        "patches and also at the visible ones, where each token's loss is weighted by 1/sqrt of its "
        "grid distance to the nearest masked patch (context_loss_weight). Meant to make the tokens "
        "dense features (segmentation); dense_predictor chooses octfw's adaptation or V-JEPA 2.1's own",
        default=0, validator=non_negative,
    )
    context_loss_weight: float = doc(
        "dense_levels > 0: weight of the loss on the visible tokens beside the masked ones "
        "(V-JEPA 2.1's lambda_value_vid, constant: its pretraining ramps it from 0 at iteration "
        "15,000 to this value at 30,000, which octfw does not)",
        default=0.5, validator=non_negative,
    )
    context_distance_weighting: bool = doc(
        "dense_levels > 0: weight each visible token's loss by 1/sqrt of its distance to the nearest "
        "masked patch (V-JEPA 2.1's pretraining, weight_distance_loss); false: every visible token "
        "counts the same (its cooldown)",
        default=True,
    )
    dense_predictor: str = doc(
        "dense_levels > 0: 'octfw' (octfw's predictor: one MaskedTokenDecoder reading the last "
        "level and predicting all levels with one head, targets re-normed over all levels, evenly "
        "spaced depths) or 'vjepa2.1' (V-JEPA 2.1's own, number for number: the context encoder's "
        "4 levels, each through its own affine norm, read through a two-layer projection, a "
        "modality token, separate heads for the masked and the visible tokens, the reference's "
        "depths; needs dense_levels = 4 and loss = 'l1'; with init, a 2.1 checkpoint's predictor "
        "and level norms load)",
        default="octfw", validator=choices(*DENSE_PREDICTOR_CHOICES),
    )
    activation_checkpointing: bool = doc(
        "recompute each transformer block's activations in the backward pass instead of keeping "
        "them: much less activation memory (octfw check shows how much, and the largest batch that "
        "fits) for about one more forward pass of the context encoder and predictor",
        default=False,
    )
