"""The logger stage's contract: host scalars once per log step (:class:`Logger`), and every
update step for a :class:`StepListener`. Its optional state is
:class:`octfw.types.component.Stateful`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

from octfw.types.capability import _CapabilityMeta

__all__ = ["Logger", "StepListener"]


@runtime_checkable
class Logger(Protocol, metaclass=_CapabilityMeta):
    """Receives host scalars once per log step. Only rank 0 has loggers.

    Optional: :class:`StepListener` (``on_step``) for progress displays,
    :class:`Stateful` for state kept across a resume.
    """

    def start(self, total_update_steps: int, run_dir: Path, recipe: Mapping[str, Any]) -> None: ...

    def log(self, update_step: int, metrics: Mapping[str, float]) -> None: ...

    def finish(self, summary: Mapping[str, Any]) -> None: ...


@runtime_checkable
class StepListener(Protocol, metaclass=_CapabilityMeta):
    """Optional, for loggers: ``on_step(update_step)`` after every update step.

    It receives the host step count only (no device value, no sync), for
    progress displays. It may raise :class:`StopTraining`.
    """

    def on_step(self, update_step: int) -> None: ...
