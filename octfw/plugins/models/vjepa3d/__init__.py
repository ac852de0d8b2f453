"""The ``vjepa3d`` model component: config, size presets and factory.

Light at import (attrs only); the network lives in :mod:`octfw.plugins.models.vjepa3d.model`
and torch is imported when :func:`build` runs.

Registration and factory; the config lives in :mod:`octfw.plugins.models.vjepa3d.config`.
"""

from __future__ import annotations

import logging
from typing import Any

from octfw.display.errors import UserError
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Model
from octfw.models.presets import network_arguments
from octfw.plugins.models.vjepa3d.config import (PREDICTOR_WARMUP_STEPS, PRESETS, LOSS_CHOICES, Architecture,
                                                VJEPA3DConfig)

__all__ = ["PRESETS", "LOSS_CHOICES", "Architecture", "VJEPA3DConfig", "build"]


def build(config: VJEPA3DConfig, ctx: BuildContext) -> Model:
    """Make a :class:`octfw.plugins.models.vjepa3d.model.VJEPA3D` for ``ctx.image_size`` and ``ctx.in_channels``,
    started from ``config.init``'s weights when set (its :class:`~octfw.models.published.InitReport`
    is the model's ``init_report``)."""
    arguments = network_arguments("vjepa3d", config, ctx)  # checks the sizes before torch is imported

    from octfw.plugins.models.vjepa3d.model import VJEPA3D

    if config.dense_levels > arguments["depth"]:
        raise UserError(f"model.dense_levels = {config.dense_levels} exceeds the encoder's depth "
                        f"({arguments['depth']} blocks): each level is the output of one block")
    if config.dense_predictor == "vjepa2.1" and (config.dense_levels != 4 or config.loss != "l1"):
        raise UserError(f"model.dense_predictor = \"vjepa2.1\" predicts V-JEPA 2.1's 4 levels with its L1 loss: "
                        f"set model.dense_levels = 4 (not {config.dense_levels}) and model.loss = \"l1\" "
                        f"(not {config.loss!r})")
    model = VJEPA3D(loss=config.loss, mask_pairs=ctx.mask_pairs, dense_levels=config.dense_levels,
                    context_loss_weight=config.context_loss_weight, dense_predictor=config.dense_predictor,
                    context_distance_weighting=config.context_distance_weighting, **arguments)
    if config.init is not None and ctx.apply_init:  # not where a checkpoint restores the weights
        from octfw.models.published import InitTargets, initialise

        targets = InitTargets(
            online=model.context_encoder, ema=model.target_encoder,
            predictor=model.predictor if config.init_predictor else None,
            level_norms=({"online": model.level_norms, "ema": model.target_level_norms}
                         if config.dense_predictor == "vjepa2.1" else None),
            predictor_format="vjepa2.1" if config.dense_predictor == "vjepa2.1" else None,
            prefixes={"online": "context_encoder.", "ema": "target_encoder.", "predictor": "predictor.",
                      "online_levels": "level_norms.", "ema_levels": "target_level_norms."},
            recipe=f"[model] vjepa3d preset {config.preset!r}", predictor_note="model.init_predictor = false",
            channels=config.init_channels)
        model.init_report = initialise(config.init, targets, ctx.recipe_dir)
        if ctx.run_dir is not None:  # a run logs what it started from; `octfw check` prints it all
            logging.getLogger(__name__).info("%s", model.init_report.lines()[0])
    model.predictor_warmup_steps = predictor_warmup(config, ctx, getattr(model, "init_report", None))
    return model


def predictor_warmup(config: VJEPA3DConfig, ctx: BuildContext, report: Any) -> int | None:
    """``predictor_warmup_steps`` resolved: the update steps the encoder is held, said in the
    load ``report``; None where no run of this recipe can hold it (the optimizer's groups are then
    the two of every other run). Without a report (a resumed run, which does not read init) the
    default gives 0: the optimizer groups its checkpoint restores carry the run's own number."""
    steps = config.predictor_warmup_steps
    if steps == 0 or (steps is None and config.init is None):
        return None
    if report is None:
        return steps or 0
    new = not any(key.startswith("predictor.") for key in [*report.loaded, *report.adapted])
    if steps is None:
        total = ctx.total_update_steps
        steps = (min(PREDICTOR_WARMUP_STEPS, total // 10) if total else PREDICTOR_WARMUP_STEPS) if new else 0
    if steps:
        report.notes.append(f"the encoder is held (learning rate 0, its EMA copy unchanged) for the first {steps} "
                            f"update steps while the {'new ' if new else ''}predictor trains "
                            "(model.predictor_warmup_steps)")
    return steps


@hookimpl
def octfw_register_models(register: Register) -> None:
    register(
        "vjepa3d",
        VJEPA3DConfig,
        build,
        "V-JEPA 3D ViT: context encoder, predictor and EMA target encoder; loss on masked "
        "patches.",
    )
