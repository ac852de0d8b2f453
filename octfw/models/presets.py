"""What the configs and factories of models on the ViT3D encoder share (light: no torch).

A model's config adds its own head sizes (the ``vjepa3d`` predictor, the
``mae3d`` decoder) to :data:`ENCODER_PRESETS` under the same names, so
``preset = "small"`` gives the same exported encoder whichever model trained
it. :func:`resolve_sizes` applies a config's explicit fields over its preset;
:func:`patch_geometry` checks a factory's image and patch sizes.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from octfw.errors import UserError
from octfw.fields import doc, positive

__all__ = ["ENCODER_PRESETS", "resolve_sizes", "size_field", "positive_each", "patch_geometry"]

#: Encoder sizes by preset name: 'tiny' for the CPU quickstart, 'small' the
#: seeds' encoder (ViT-S width), 'base' ViT-B.
ENCODER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(embed_dim=96, depth=4, num_heads=3, mlp_ratio=4.0),
    "small": dict(embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    "base": dict(embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
}


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
