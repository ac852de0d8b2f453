"""Warnings for a checkpoint interval that falls in step with other periodic work.

Why it matters (the seeds): a loss explosion that comes back at a regular
step (512, 514, ...) is either a bad batch or a periodic code path. When the
checkpoint save, the metric read-back and the accumulation cycle all fire on
the same update steps, a periodic failure cannot be pinned on one of them; the
seeds' advice was an interval such as 997 that shares no factor with the
other cadences.

Two rules, both about ``engine.checkpoint_every_steps`` (C, in update steps):

- **Logging**: C is a multiple of ``log_every_steps`` (L > 1). Then every
  checkpoint step is also a log step: the save and the device-to-host metric
  read happen together each time, and a slow or failing step cannot be told
  apart. (With L = 1 every step is a log step and no interval can avoid it, so
  nothing is said.)
- **Accumulation**: C is a multiple of ``grad_accum_steps`` (A > 1). octfw
  counts every interval in update steps of A micro-steps each; an interval
  that divides by A is the mark of one carried over from a loop that counted
  micro-steps (the seeds' 512 with accumulation 2), which octfw stretches to
  C x A micro-steps, and it keeps the save in phase with any routine that
  still counts micro-steps (a data or mask cycle of A batches).

Each warning suggests the smallest interval >= C that breaks both rules.
These are warnings, not errors: the run is valid either way.
"""

from __future__ import annotations

from octfw.recipe.config import EngineConfig

__all__ = ["cadence_warnings", "suggest_interval"]


def _coincides(interval: int, period: int) -> bool:
    return period > 1 and interval % period == 0


def suggest_interval(interval: int, log_every_steps: int, grad_accum_steps: int) -> int:
    """The smallest interval >= ``interval`` that is a multiple of neither cadence (> 1)."""
    candidate = interval
    while _coincides(candidate, log_every_steps) or _coincides(candidate, grad_accum_steps):
        candidate += 1
    return candidate


def cadence_warnings(engine: EngineConfig) -> list[str]:
    """One line per way ``checkpoint_every_steps`` coincides with logging or accumulation; [] if none."""
    every = engine.checkpoint_every_steps
    if every is None:
        return []
    log, accum = engine.log_every_steps, engine.grad_accum_steps
    suggestion = suggest_interval(every, log, accum)
    hint = f"; an interval such as {suggestion} would not coincide"
    warnings = []
    if _coincides(every, log):
        warnings.append(
            f"engine.checkpoint_every_steps = {every} is a multiple of engine.log_every_steps = {log}: "
            "every checkpoint save lands on a log step, so a periodic slowdown or failure cannot be "
            f"pinned on one of them{hint}"
        )
    if _coincides(every, accum):
        warnings.append(
            f"engine.checkpoint_every_steps = {every} is a multiple of engine.grad_accum_steps = {accum}: "
            f"octfw counts update steps, so saves come every {every * accum} micro-steps, in phase with "
            f"the accumulation cycle (was the interval meant in micro-steps?){hint}"
        )
    return warnings
