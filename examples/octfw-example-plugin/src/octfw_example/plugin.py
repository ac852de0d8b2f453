"""Registers one scheduler, ``linear-decay``: linear warmup, then a straight
line from ``base_lr`` down to ``min_lr_ratio * base_lr`` at the last step.

The module only imports attrs and octfw's light modules, so ``octfw list``
stays fast. The factory could import torch or anything heavy inside.
"""

from __future__ import annotations

import attrs

from octfw.recipe.fields import doc, in_range, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext


@attrs.frozen
class LinearDecayConfig:
    warmup_steps: int = doc("Update steps of linear warmup.", default=10, validator=positive)
    min_lr_ratio: float = doc("LR at the last step, as a fraction of base_lr.", default=0.1,
                              validator=in_range(0.0, 1.0, low_open=True))


class LinearDecay:
    def __init__(self, config: LinearDecayConfig, ctx: BuildContext):
        self.base_lr = ctx.base_lr
        self.total = max(ctx.total_update_steps, 1)
        self.warmup = min(config.warmup_steps, self.total)
        self.min_lr = config.min_lr_ratio * ctx.base_lr

    def lr(self, update_step: int) -> float:
        if update_step < self.warmup:
            return self.base_lr * (update_step + 1) / self.warmup
        progress = (update_step - self.warmup) / max(self.total - self.warmup, 1)
        return self.base_lr + (self.min_lr - self.base_lr) * min(progress, 1.0)

    def weight_decay(self, update_step: int) -> None:
        return None

    def ema_momentum(self, update_step: int) -> float:
        return 0.996 + (1.0 - 0.996) * update_step / self.total


def build(config: LinearDecayConfig, ctx: BuildContext) -> LinearDecay:
    return LinearDecay(config, ctx)


@hookimpl
def octfw_register_schedulers(register: Register) -> None:
    register("linear-decay", LinearDecayConfig, build,
             "Linear warmup, then a straight line down to min_lr_ratio x base_lr.")
