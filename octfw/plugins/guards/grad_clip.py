"""``grad-clip``: scale gradients so their global norm is at most ``max_norm``.

Uses the norm the engine measured once per update, before clipping, so the
logged gradient norm is the real one (the seeds logged the norm after
``zero_grad``: 0 for weeks).
"""

from __future__ import annotations

from typing import Mapping

import attrs

from octfw.recipe.fields import doc, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, GuardInputs


@attrs.frozen
class GradClipConfig:
    max_norm: float = doc("Largest global L2 gradient norm applied.", default=1.0, validator=positive)


class GradClip:
    def __init__(self, config: GradClipConfig):
        self.max_norm = config.max_norm

    def before_step(self, inputs: GuardInputs):
        import torch

        grads = [p.grad for p in inputs.parameters if p.grad is not None]
        # A non-finite norm gives a non-finite scale; nan-skip then drops the update.
        scale = torch.clamp(self.max_norm / (inputs.grad_norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, scale)
        return None

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None:
        return None


def build(config: GradClipConfig, ctx: BuildContext) -> GradClip:
    return GradClip(config)


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register(
        "grad-clip",
        GradClipConfig,
        build,
        "Clip the global gradient norm (measured once, before clipping).",
    )
