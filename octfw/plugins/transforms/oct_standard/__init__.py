"""The ``oct-standard`` transform: resample, normalise, fit, augment, mask.

Registration and factory only. The config classes live in
:mod:`octfw.plugins.transforms.oct_standard.config` (attrs only) and the implementation
(numpy, torch, MONAI) in :mod:`octfw.plugins.transforms.oct_standard.transform`, imported when the
transform is built.
"""

from __future__ import annotations

from octfw.plugins.transforms.oct_standard.config import MaskConfig, OCTStandardConfig
from octfw.display.errors import UserError
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Transform

__all__ = ["MaskConfig", "OCTStandardConfig", "build"]


def build(config: OCTStandardConfig, ctx: BuildContext) -> Transform:
    """Make the transform for the model's patch grid (``ctx.patch_size``)."""
    patch = ctx.patch_size
    image = tuple(int(s) for s in config.image_size)
    if patch is None:
        raise UserError(
            f"transform 'oct-standard' needs the model's patch_size to split "
            f"transform.image_size {list(image)} into patches, but the model declares none"
        )
    patch = tuple(int(p) for p in patch)
    bad = [axis for axis, s, p in zip("DHW", image, patch) if s % p]
    if bad:
        raise UserError(
            f"transform.image_size {list(image)} is not divisible by the model's "
            f"patch_size {list(patch)} (along {', '.join(bad)})"
        )
    if ctx.in_channels != 1:
        raise UserError(
            f"transform 'oct-standard' makes 1-channel views but the model expects "
            f"in_channels={ctx.in_channels}"
        )
    from octfw.plugins.transforms.oct_standard.transform import OCTStandardTransform

    transform = OCTStandardTransform(config, patch)
    if config.cache:
        transform.enable_cache(ctx.cache_dir)
    return transform


@hookimpl
def octfw_register_transforms(register: Register) -> None:
    register(
        "oct-standard",
        OCTStandardConfig,
        build,
        "Resample to a spacing, normalise by percentiles, fit to image_size, augment, and "
        "draw a fixed-size patch mask.",
    )
