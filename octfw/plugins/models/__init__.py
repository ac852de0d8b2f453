"""Built-in model components (recipe table ``[model]``)."""

from __future__ import annotations

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.models.vjepa3d import VJEPA3DConfig


@hookimpl
def octfw_register_models(register: Register) -> None:
    register(
        "vjepa3d",
        VJEPA3DConfig,
        "octfw.plugins.models.vjepa3d:build",
        "V-JEPA 3D ViT: context encoder, predictor and EMA target encoder; loss on masked patches.",
    )
