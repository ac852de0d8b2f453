"""The scheduler stage's contract: pure functions of the update step."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from octfw.types.capability import _CapabilityMeta

__all__ = ["Schedule", "WarmupSchedule"]


@runtime_checkable
class Schedule(Protocol, metaclass=_CapabilityMeta):
    """Pure functions of the update step (0-based): no hidden state to restart.

    ``lr`` is None for a schedule that never rewrites the learning rate
    (``constant``): the optimizer keeps the ``base_lr`` it was built with.
    ``weight_decay`` and ``ema_momentum`` return None when not scheduled.
    """

    def lr(self, update_step: int) -> float | None: ...

    def weight_decay(self, update_step: int) -> float | None: ...

    def ema_momentum(self, update_step: int) -> float | None: ...


@runtime_checkable
class WarmupSchedule(Schedule, Protocol):
    """Optional: the schedule states its warmup length (update steps), so the pre-flight
    check knows where the learning rate may rise; without it the rise is inferred."""

    warmup_steps: int | None
