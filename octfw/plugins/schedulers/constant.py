"""``constant``: the LR is never rewritten; EMA momentum and weight decay may still be scheduled.

``lr()`` returns None, so the engine leaves the optimizer's LR at the
``base_lr`` it was built with. The seeds' "LR = 0" came from a loop that
rewrote the LR every step from a scheduler that had been switched off; a
schedule that never writes cannot do that. Use
:func:`octfw.engine.schedules.effective_lr` for the LR in effect.
"""

from __future__ import annotations

import attrs

from octfw.hookspecs import Register, hookimpl
from octfw.engine.schedules import EmaWdOptions, EmaWdSchedule
from octfw.types import BuildContext

__all__ = ["ConstantConfig", "ConstantSchedule", "build"]


@attrs.frozen
class ConstantConfig(EmaWdOptions):
    """Config of ``constant``: only the shared EMA / weight decay fields."""


class ConstantSchedule(EmaWdSchedule):
    """Keeps the optimizer's LR; schedules EMA momentum and weight decay."""

    def lr(self, update_step: int) -> None:
        if update_step < 0:
            raise ValueError(f"update_step must be >= 0, got {update_step}")
        return None


def build(config: ConstantConfig, ctx: BuildContext) -> ConstantSchedule:
    return ConstantSchedule(config, ctx)


@hookimpl
def octfw_register_schedulers(register: Register) -> None:
    register(
        "constant",
        ConstantConfig,
        build,
        "Keeps the optimizer's base_lr (never rewrites it); EMA and weight decay optional.",
    )
