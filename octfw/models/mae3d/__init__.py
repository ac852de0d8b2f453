"""The ``mae3d`` model component: a masked autoencoder on the shared 3D ViT encoder.

Light at import (attrs only); the network lives in :mod:`octfw.models.mae3d.model`
and torch is imported when :func:`build` runs. The config lives in
:mod:`octfw.models.mae3d.config`.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.hookspecs import Register, hookimpl
from octfw.models.mae3d.config import PRESETS, Architecture, MAE3DConfig
from octfw.models.presets import patch_geometry

__all__ = ["PRESETS", "Architecture", "MAE3DConfig", "build"]


def build(config: MAE3DConfig, ctx: Any):
    """Make a :class:`octfw.models.mae3d.model.MAE3D` for ``ctx.image_size`` and ``ctx.in_channels``."""
    image_size, patch_size = patch_geometry("mae3d", config.patch_size, ctx)

    from octfw.models.mae3d.model import MAE3D

    return MAE3D(
        image_size=image_size,
        patch_size=patch_size,
        in_channels=ctx.in_channels,
        norm_pix_loss=config.norm_pix_loss,
        activation_checkpointing=config.activation_checkpointing,
        **attrs.asdict(config.architecture()),
    )


@hookimpl
def octfw_register_models(register: Register) -> None:
    register(
        "mae3d",
        MAE3DConfig,
        build,
        "MAE 3D ViT: the encoder sees the visible patches, a narrow decoder reconstructs the "
        "(normalised) voxels of the masked ones; no EMA.",
    )
