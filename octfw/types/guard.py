"""The guard stage's contract: what a guard sees every update step (:class:`GuardInputs`) and
its two methods (:class:`Guard`). Its optional state is :class:`octfw.types.component.Stateful`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, runtime_checkable

import attrs

from octfw.types.capability import _CapabilityMeta

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = ["GuardInputs", "Guard"]


@attrs.frozen
class GuardInputs:
    """Device tensors a guard sees once per update step, before the optimizer step."""

    update_step: int
    loss: "torch.Tensor"  #: scalar, mean over the accumulated micro-steps
    grad_norm: "torch.Tensor"  #: global L2 norm of all gradients, before clipping
    parameters: tuple  #: the trainable parameters (with their ``.grad``)
    lr: float  #: learning rate of this update (host value, known without a sync)


@runtime_checkable
class Guard(Protocol, metaclass=_CapabilityMeta):
    """Decides on the device whether an update may be applied; watches health.

    ``before_step`` runs in the hot path on every update step and must not
    force a host sync: it returns a boolean device tensor (True = apply) or
    None (no opinion), and may rescale gradients in place (``grad-clip``).
    ``at_log_step`` runs at log steps with host values and may warn, raise
    :class:`StopTraining` (something is wrong: exit 1) or raise
    :class:`TrainingDone` (a target reached: the run is done, exit 0).
    """

    def before_step(self, inputs: GuardInputs) -> "torch.Tensor | None": ...

    def at_log_step(self, update_step: int, metrics: Mapping[str, float]) -> None: ...
