"""The ``mae3d`` model component: a masked autoencoder on the shared 3D ViT encoder.

Light at import (attrs only); the network lives in :mod:`octfw.plugins.models.mae3d.model`
and torch is imported when :func:`build` runs. The config lives in
:mod:`octfw.plugins.models.mae3d.config`.
"""

from __future__ import annotations

import logging

from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Model
from octfw.plugins.models.mae3d.config import PRESETS, Architecture, MAE3DConfig
from octfw.models.presets import network_arguments

__all__ = ["PRESETS", "Architecture", "MAE3DConfig", "build"]


def build(config: MAE3DConfig, ctx: BuildContext) -> Model:
    """Make a :class:`octfw.plugins.models.mae3d.model.MAE3D` for ``ctx.image_size`` and ``ctx.in_channels``."""
    arguments = network_arguments("mae3d", config, ctx)  # checks the sizes before torch is imported

    from octfw.plugins.models.mae3d.model import MAE3D

    model = MAE3D(norm_pix_loss=config.norm_pix_loss, mask_pairs=ctx.mask_pairs, **arguments)
    if config.init is not None and ctx.apply_init:  # not where a checkpoint restores the weights
        from octfw.models.published import InitTargets, initialise

        targets = InitTargets(online=model.encoder, prefixes={"online": "encoder."},
                              recipe=f"[model] mae3d preset {config.preset!r}",
                              predictor_note="mae3d has a pixel decoder, no predictor", channels=config.init_channels)
        model.init_report = initialise(config.init, targets, ctx.recipe_dir)
        if ctx.run_dir is not None:  # a run logs what it started from; `octfw check` prints it all
            logging.getLogger(__name__).info("%s", model.init_report.lines()[0])
    return model


@hookimpl
def octfw_register_models(register: Register) -> None:
    register(
        "mae3d",
        MAE3DConfig,
        build,
        "MAE 3D ViT: the encoder sees the visible patches, a narrow decoder reconstructs the "
        "(normalised) voxels of the masked ones; no EMA.",
    )
