"""What the configs and factories of models on the ViT3D encoder share (light: no torch).

A model's config adds its own head sizes (the ``vjepa3d`` predictor, the
``mae3d`` decoder) to :data:`ENCODER_PRESETS` under the same names
(:func:`model_presets`), so ``preset = "small"`` gives the same exported
encoder whichever model trained it. A config subclasses :class:`PresetSized`
for ``architecture()`` (:func:`resolve_sizes`: its explicit fields over its
preset, checked when the config is made), its ``Architecture`` subclasses
:class:`EncoderArchitecture`, and its factory passes
:func:`network_arguments` (which checks the image and patch sizes) to the
network. Each model's own fields, presets and texts stay in its package.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import attrs

from octfw.display.errors import UserError
from octfw.recipe.fields import choices, doc, length, positive

__all__ = ["ENCODER_PRESETS", "EncoderArchitecture", "PresetSized", "model_presets", "describe_presets",
           "resolve_sizes", "size_field", "patch_size_field", "positive_each", "patch_geometry",
           "network_arguments", "standardise_field", "position_field", "norm_eps_field", "init_field",
           "init_channels_field", "rope_span_field",
           "POSITION_CHOICES", "INIT_CHANNELS_CHOICES", "DEFAULT_NORM_EPS"]

#: ``position`` choices (:data:`octfw.models.vit3d.POSITIONS`, repeated here: this module imports no torch).
POSITION_CHOICES = ("sincos", "rope", "rope-interleaved", "learned")
#: ``init_channels`` choices (:data:`octfw.models.published.inputs.CHANNEL_RULES`, repeated: no torch here).
INIT_CHANNELS_CHOICES = ("auto", "sum", "fold")
#: LayerNorm epsilon of octfw's networks (:data:`octfw.models.vit3d.NORM_EPS`).
DEFAULT_NORM_EPS = 1e-5

#: Encoder sizes by preset name: 'tiny' for the CPU quickstart, 'small' the
#: seeds' encoder (ViT-S width), 'base' ViT-B, 'large' ViT-L (V-JEPA 2's ViT-L/16,
#: MAE's and RETFound's ViT-L), 'giant' V-JEPA 2's ViT-g (facebookresearch/vjepa2
#: ``vit_giant_xformers``, the published ViT-g/16: 22 heads of 64 channels, an MLP
#: 48/11 as wide, 6,144 channels), 'gigantic' V-JEPA 2.1's ViT-G (``vit_gigantic_xformers``,
#: 1.8B parameters: 26 heads of 64 channels, an MLP 64/13 as wide, 8,192 channels). Published
#: weights load into the preset of their width, depth and heads (docs/published-weights.md).
ENCODER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(embed_dim=96, depth=4, num_heads=3, mlp_ratio=4.0),
    "small": dict(embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    "base": dict(embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
    "large": dict(embed_dim=1024, depth=24, num_heads=16, mlp_ratio=4.0),
    "giant": dict(embed_dim=1408, depth=40, num_heads=22, mlp_ratio=48 / 11),
    "gigantic": dict(embed_dim=1664, depth=48, num_heads=26, mlp_ratio=64 / 13),
}


def model_presets(head_presets: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A model's network sizes by preset name: each encoder preset with the head sizes of the same name."""
    return {name: {**encoder, **head_presets[name]} for name, encoder in ENCODER_PRESETS.items()}


def describe_presets(presets: Mapping[str, Mapping[str, Any]], parameters: Mapping[str, tuple[int, int]],
                     head: str | None = None) -> str:
    """Each preset's sizes and parameter counts (trainable, exported encoder), as a ``preset`` doc shows
    them; ``head`` (``"decoder"``) adds that head's width and depth."""
    def sizes(name: str, p: Mapping[str, Any]) -> str:
        text = f"'{name}': width {p['embed_dim']}, depth {p['depth']}, {p['num_heads']} heads, "
        if head is not None:
            text += f"{head} width {p[f'{head}_embed_dim']}, depth {p[f'{head}_depth']}, "
        trainable, encoder = parameters[name]
        return text + f"{trainable / 1e6:.1f}M trainable, encoder {encoder / 1e6:.1f}M"

    return "; ".join(sizes(name, p) for name, p in presets.items())


@attrs.frozen
class EncoderArchitecture:
    """The encoder's resolved sizes; a model's ``Architecture`` adds its head's."""

    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float


class PresetSized:
    """Base of a model config with a ``preset`` and optional size fields that override it.

    A subclass sets :attr:`PRESETS`, :attr:`ARCHITECTURE` and :attr:`WIDTH_HEADS`.
    The sizes are resolved when the config is made, so that recipe validation
    catches a bad combination without building (or importing) anything.
    """

    __slots__ = ()

    #: Network sizes by preset name (:func:`model_presets`).
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]]
    #: The attrs class :meth:`architecture` returns.
    ARCHITECTURE: ClassVar[type]
    #: ``(width, heads)`` pairs of field names whose width the heads must split.
    WIDTH_HEADS: ClassVar[tuple[tuple[str, str], ...]]

    preset: str

    def __attrs_post_init__(self) -> None:
        self.architecture()

    def architecture(self) -> Any:
        """The preset overridden by every explicit field; raises ValueError
        for widths that heads or the sin-cos position embedding cannot split."""
        return self.ARCHITECTURE(**resolve_sizes(self, self.PRESETS[self.preset], self.WIDTH_HEADS))


def resolve_sizes(config: Any, preset: Mapping[str, Any],
                  width_heads: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """``preset`` with every field of ``config`` of the same name that is not None applied.

    Raises ValueError for a width its heads cannot split, or an odd width
    (the sin-cos position embedding needs an even one), for each
    ``(width, heads)`` pair of field names in ``width_heads``.
    """
    sizes = dict(preset)
    for key in sizes:
        value = getattr(config, key)
        if value is not None:
            sizes[key] = value
    for width, heads in width_heads:
        w, h = sizes[width], sizes[heads]
        if w % h:
            raise ValueError(f"{width} = {w} is not divisible by {heads} = {h}")
        if w % 2:
            raise ValueError(f"{width} = {w} must be even (sin-cos position embedding)")
    return sizes


def size_field(text: str) -> Any:
    """An optional positive config field that overrides the preset's value."""
    return doc(f"{text} (default: from preset)", default=None, validator=positive)


def patch_size_field() -> Any:
    """The ``patch_size`` config field: [pd, ph, pw] voxels, (4, 16, 16) by default."""
    return doc("patch size [pd, ph, pw] in voxels; image_size must be divisible by it",
               default=(4, 16, 16), converter=tuple, validator=[length(3), positive_each])


def standardise_field() -> Any:
    """The ``standardise_input`` config field: on by default (new recipes), recorded in the export."""
    return doc("standardise each input volume to mean 0 and std 1 over its voxels before the patch "
               "projection (after the transform's percentile scaling), as the reference methods "
               "standardise their inputs: without it the fixed position embedding outweighed the "
               "content of [0, 1] inputs. Part of the encoder, so an export does the same in `embed`",
               default=True)


def position_field() -> Any:
    """The ``position`` config field: how tokens know their place, recorded in the export."""
    return doc("how tokens know their place: 'sincos' a fixed 3D sin-cos table added to the tokens; 'rope' "
               "V-JEPA 2's 3D rotary embedding of queries and keys (needed for V-JEPA 2 weights); "
               "'rope-interleaved' V-JEPA 2.1's (each angle on one channel pair; with rope_span = 16 for its "
               "weights); 'learned' a trained table (MAE-family weights carry one). Part of the encoder, so an "
               "export does the same", default="sincos", validator=choices(*POSITION_CHOICES))


def rope_span_field() -> Any:
    """The ``rope_span`` config field: V-JEPA 2.1's stretched in-plane rotary positions."""
    return doc("rotary positions only: stretch the in-plane positions so that rows and columns run from 0 to "
               "rope_span - 1 whatever the grid (V-JEPA 2.1's interpolate_rope: 16, its 256-pixel training "
               "frames of 16-pixel patches); unset: positions 0, 1, 2, ...", default=None, validator=positive)


def norm_eps_field() -> Any:
    """The ``norm_eps`` config field: the LayerNorms' epsilon."""
    return doc("epsilon of every LayerNorm; V-JEPA 2 and MAE train with 1e-6, so a recipe that starts from "
               "their weights computes what they compute with it", default=DEFAULT_NORM_EPS, validator=positive)


def init_field(extra: str = "") -> Any:
    """The ``init`` config field: published weights to start from (read when the model is built)."""
    return doc("start from published weights: a checkpoint file (relative to the recipe's folder) or a Hugging "
               "Face Hub id org/name[:file] (offline from the local cache with HF_HUB_OFFLINE=1). Its format is "
               "recognised (V-JEPA 2 and 2.1 checkpoints) and adapted to the recipe's input: RGB to one channel, the "
               "tubelet inflated to patch_size, a position table resampled; `octfw check` lists the keys "
               "loaded, adapted and left new, and refuses weights of another width or depth. A resumed run "
               f"takes its own checkpoint instead{extra}. Unset: random initialisation",
               default=None, validator=_init_value)


def init_channels_field() -> Any:
    """The ``init_channels`` config field: how published RGB weights meet the recipe's input."""
    return doc("with init: how the published RGB patch projection meets the recipe's volumes. 'sum': the "
               "kernel as published, its 3 channels summed for one (the published model shown the volume "
               "repeated in R, G and B, as it comes: standardised per volume with standardise_input); 'fold': "
               "the published per-channel normalisation (ImageNet's mean and std for V-JEPA 2 and 2.1, VideoMAE "
               "and RETFound; MAE-ST's 0.45 / 0.225) folded into the kernel and bias, so that [0, 1] "
               "intensities give the published model's tokens for the grey image normalised as it was trained "
               "(needs standardise_input = false); 'auto': 'fold' where standardise_input = false, else 'sum'. "
               "docs/published-weights.md says which to choose", default="auto",
               validator=choices(*INIT_CHANNELS_CHOICES))


def _init_value(instance: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not str(value).strip():
        raise ValueError("must name a file or a Hub id (leave the key out for random initialisation)")


def positive_each(instance: Any, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    """attrs validator: every item of a sequence (a patch size) is > 0."""
    if any(v <= 0 for v in value):
        raise ValueError(f"every value must be > 0, got {list(value)!r}")


def patch_geometry(model: str, patch_size: tuple[int, int, int],
                   ctx: Any) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(image_size, patch_size)`` for model ``model`` built with ``ctx``
    (a :class:`octfw.types.BuildContext`); raises UserError when the input size
    is missing, not divisible by the patch, or the grid was set up for another patch."""
    patch_size = tuple(patch_size)
    image_size = ctx.image_size
    if image_size is None:
        raise UserError(
            f"model {model} needs the input size: set transform.image_size "
            f"(a multiple of model.patch_size = {list(patch_size)})"
        )
    image_size = tuple(image_size)
    if any(size % patch for size, patch in zip(image_size, patch_size)):
        raise UserError(
            f"transform.image_size = {list(image_size)} is not divisible by "
            f"model.patch_size = {list(patch_size)}"
        )
    if ctx.patch_size is not None and tuple(ctx.patch_size) != patch_size:
        raise UserError(
            f"the patch grid was set up for patch_size = {list(ctx.patch_size)} "
            f"but model.patch_size = {list(patch_size)}"
        )
    return image_size, patch_size


def network_arguments(model: str, config: Any, ctx: Any) -> dict[str, Any]:
    """The constructor arguments every network on the encoder takes: ``image_size``, ``patch_size``
    (checked by :func:`patch_geometry`), ``in_channels``, ``activation_checkpointing``,
    ``standardise_input``, ``position``, ``norm_eps``, ``rope_span`` and the resolved sizes of ``config`` (a :class:`PresetSized`); the model adds its own."""
    image_size, patch_size = patch_geometry(model, config.patch_size, ctx)
    sizes = attrs.asdict(config.architecture())
    if config.position.startswith("rope") and sizes["embed_dim"] // sizes["num_heads"] < 6:
        raise UserError(f"model.position = {config.position!r} needs attention heads of at least 6 channels "
                        f"(3 axes x 2); embed_dim {sizes['embed_dim']} / num_heads {sizes['num_heads']} gives "
                        f"{sizes['embed_dim'] // sizes['num_heads']}")
    return dict(image_size=image_size, patch_size=patch_size, in_channels=ctx.in_channels,
                activation_checkpointing=config.activation_checkpointing,
                standardise_input=config.standardise_input, position=config.position,
                norm_eps=config.norm_eps, rope_span=config.rope_span, **sizes)
