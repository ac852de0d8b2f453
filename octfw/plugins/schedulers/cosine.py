"""``cosine-no-restart``: linear warmup, one cosine decay to a floor, then flat.

With ``W`` warmup steps, ``T`` total update steps, ``r = warmup_start_ratio``
and ``k = update_step + 1`` (the number of updates done once this one is
applied), the LR of 0-based update step ``s`` is::

    k < W:   start + (k / W) * (base_lr - start),     start = r * base_lr
    k >= W:  min_lr + (base_lr - min_lr) * (1 + cos(pi * p)) / 2,
             p = min(1, (k - W) / max(1, T - W))
    decay = "linear":  base_lr + p * (min_lr - base_lr)   (V-JEPA 2's cooldown)

With ``r = 0`` this is transformers' ``get_cosine_with_min_lr_schedule_with_warmup``
(``num_cycles = 0.5``) evaluated at ``k``, which is also how V-JEPA's
``WarmupCosineSchedule`` counts (it advances its step before computing the
LR). Evaluating at ``k`` rather than ``s`` means the first update already has
``base_lr / W`` instead of 0, the last warmup step (``s = W - 1``) has exactly
``base_lr`` and the last update (``s = T - 1``) has exactly ``min_lr``.
With ``warmup_start_lr`` (V-JEPA's ``start_lr``), ``start`` is that value; with
``horizon_scale`` (V-JEPA's ``ipe_scale``), ``T = int(horizon_scale * T_run)``, so
the run ends before the floor. Each expression is evaluated in the order of
V-JEPA's ``WarmupCosineSchedule`` and ``LinearDecaySchedule``, so a run
configured like a V-JEPA one gets the same floats (tests/test_reference_schedules.py).
Clamping ``p`` at 1 is octfw's: past the end the LR stays at ``min_lr``,
where ``cos`` would rise again. There is no cycle option, so no restart can
be configured.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from octfw.display.errors import UserError
from octfw.recipe.fields import choices, doc, in_range, non_negative
from octfw.hookspecs import Register, hookimpl
from octfw.engine.schedules import EmaWdOptions, EmaWdSchedule
from octfw.types import BuildContext

__all__ = ["CosineConfig", "CosineSchedule", "build", "warmup_steps"]


def _check_warmup(instance: Any, attribute: attrs.Attribute, value: float | int) -> None:
    if isinstance(value, bool):
        raise ValueError(f"must be a fraction in [0, 1) or a whole number of steps >= 1, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"a number of update steps must be >= 1, got {value!r}")
    elif not 0.0 <= value < 1.0:
        raise ValueError(
            f"a fraction of the run must be in [0, 1), got {value!r}; "
            "write a whole number (e.g. 500) for a count of update steps"
        )


@attrs.frozen
class CosineConfig(EmaWdOptions):
    """Config of ``cosine-no-restart`` (plus the shared EMA / weight decay fields)."""

    warmup: float | int = doc(
        "linear warmup length: a fraction of the run's update steps in [0, 1) "
        "(floor, at least 1 step) or a whole number of update steps",
        default=0.03,
        validator=_check_warmup,
    )
    min_lr_ratio: float = doc(
        "LR floor as a fraction of base_lr, reached at the last update step",
        default=0.1,
        validator=in_range(0.0, 1.0),
    )
    min_lr: float | None = doc(
        "absolute LR floor; when given it replaces min_lr_ratio",
        default=None,
        validator=non_negative,
    )
    warmup_start_ratio: float = doc(
        "warmup starts from this fraction of base_lr (0: the first update gets base_lr / warmup steps)",
        default=0.0,
        validator=in_range(0.0, 1.0, high_open=True),
    )
    warmup_start_lr: float | None = doc(
        "absolute LR the warmup starts from (V-JEPA's start_lr); when given it replaces "
        "warmup_start_ratio",
        default=None,
        validator=non_negative,
    )
    decay: str = doc(
        "shape of the decay after warmup: 'cosine' or 'linear' (V-JEPA 2's cooldown, "
        "LinearDecaySchedule: base_lr straight down to min_lr)",
        default="cosine",
        validator=choices("cosine", "linear"),
    )


def warmup_steps(warmup: float | int, total_update_steps: int) -> int:
    """Warmup length in update steps: an int as given, a fraction floored (at least 1)."""
    if isinstance(warmup, int):
        return warmup
    if warmup == 0:
        return 0
    # The small epsilon keeps 0.29 * 100 = 28.999... from flooring to 28.
    return min(total_update_steps, max(1, math.floor(warmup * total_update_steps + 1e-9)))


class CosineSchedule(EmaWdSchedule):
    """The schedule built from :class:`CosineConfig`; see the module docstring for the formula."""

    def __init__(self, config: CosineConfig, ctx: BuildContext):
        super().__init__(config, ctx)
        total = self.total_update_steps
        if total <= 0:
            raise UserError(f"scheduler: the run has {total} update steps; cosine-no-restart needs at least 1")
        self.base_lr = float(ctx.base_lr)
        self.min_lr = float(config.min_lr) if config.min_lr is not None else self.base_lr * config.min_lr_ratio
        if self.min_lr > self.base_lr:
            raise UserError(
                f"scheduler.min_lr = {self.min_lr!r} is above the optimizer's base_lr = {self.base_lr!r}; "
                "the LR would rise while it decays"
            )
        self.warmup_steps = warmup_steps(config.warmup, total)
        if self.warmup_steps > total:
            raise UserError(
                f"scheduler.warmup = {config.warmup!r} update steps is longer than the run "
                f"({total} update steps)"
            )
        if config.warmup_start_lr is not None:
            if config.warmup_start_lr > self.base_lr:
                raise UserError(
                    f"scheduler.warmup_start_lr = {config.warmup_start_lr!r} is above the optimizer's "
                    f"base_lr = {self.base_lr!r}; a warmup rises to base_lr"
                )
            self.warmup_start = float(config.warmup_start_lr)
        else:
            self.warmup_start = self.base_lr * config.warmup_start_ratio
        self.decay = config.decay
        # V-JEPA's ipe_scale: the decay is laid out over a horizon longer than the run.
        self.decay_end = self.total_update_steps if self.horizon_steps is None else self.horizon_steps

    def lr(self, update_step: int) -> float:
        if update_step < 0:
            raise ValueError(f"update_step must be >= 0, got {update_step}")
        done = update_step + 1  # updates done once this one is applied
        if done < self.warmup_steps:
            return self.warmup_start + done / self.warmup_steps * (self.base_lr - self.warmup_start)
        decay_steps = max(1, self.decay_end - self.warmup_steps)
        p = min(1.0, (done - self.warmup_steps) / decay_steps)
        if self.decay == "linear":
            return self.base_lr + p * (self.min_lr - self.base_lr)
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def build(config: CosineConfig, ctx: BuildContext) -> CosineSchedule:
    return CosineSchedule(config, ctx)


@hookimpl
def octfw_register_schedulers(register: Register) -> None:
    register(
        "cosine-no-restart",
        CosineConfig,
        build,
        "Linear warmup, one cosine (or linear) decay to min_lr, then flat; cannot restart.",
    )
