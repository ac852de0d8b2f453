"""The ``vjepa3d`` model component: config, size presets and factory.

Light at import (attrs only); the network lives in :mod:`octfw.plugins.models.vjepa3d.model`
and torch is imported when :func:`build` runs.

Registration and factory; the config lives in :mod:`octfw.plugins.models.vjepa3d.config`.
"""

from __future__ import annotations

from octfw.errors import UserError
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Model
from octfw.models.presets import network_arguments
from octfw.plugins.models.vjepa3d.config import PRESETS, LOSS_CHOICES, Architecture, VJEPA3DConfig

__all__ = ["PRESETS", "LOSS_CHOICES", "Architecture", "VJEPA3DConfig", "build"]


def build(config: VJEPA3DConfig, ctx: BuildContext) -> Model:
    """Make a :class:`octfw.plugins.models.vjepa3d.model.VJEPA3D` for ``ctx.image_size`` and ``ctx.in_channels``."""
    arguments = network_arguments("vjepa3d", config, ctx)  # checks the sizes before torch is imported

    from octfw.plugins.models.vjepa3d.model import VJEPA3D

    if config.dense_levels > arguments["depth"]:
        raise UserError(f"model.dense_levels = {config.dense_levels} exceeds the encoder's depth "
                        f"({arguments['depth']} blocks): each level is the output of one block")
    return VJEPA3D(loss=config.loss, mask_pairs=ctx.mask_pairs, dense_levels=config.dense_levels,
                   context_loss_weight=config.context_loss_weight, **arguments)


@hookimpl
def octfw_register_models(register: Register) -> None:
    register(
        "vjepa3d",
        VJEPA3DConfig,
        build,
        "V-JEPA 3D ViT: context encoder, predictor and EMA target encoder; loss on masked "
        "patches.",
    )
