"""``lr-positive``: the learning rate of the first update must be > 0.

The seeds trained for hours at LR 0 after disabling their scheduler. The LR
is a host value, so this check costs no device sync.
"""

from __future__ import annotations

from typing import Mapping

import attrs

from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, GuardInputs, StopTraining


@attrs.frozen
class LRPositiveConfig:
    pass


class LRPositive:
    def __init__(self) -> None:
        self.checked = False

    def before_step(self, inputs: GuardInputs):
        if not self.checked:
            self.checked = True
            if not inputs.lr > 0:
                raise StopTraining(
                    f"lr-positive: the learning rate at update step {inputs.update_step} is "
                    f"{inputs.lr!r}; nothing would be learned"
                )
        return None

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None:
        return None


def build(config: LRPositiveConfig, ctx: BuildContext) -> LRPositive:
    return LRPositive()


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register(
        "lr-positive",
        LRPositiveConfig,
        build,
        "Refuse to train when the learning rate of the first update is not > 0.",
    )
