"""Resuming a run: whether its recipe may have changed since the checkpoint it continues.

Which checkpoint that is, the run plan decides (:mod:`octfw.engine.plan`). A
resumed run is the run that was started: :func:`check_recipe_change`
compares the recipe with the one that trained the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs

from octfw.engine.build import Components
from octfw.engine.distributed import BatchLayout
from octfw.display.errors import RecipeError, UserError, one_line
from octfw.recipe import Recipe, to_toml
from octfw.recipe.changes import recipe_changes
from octfw.registry import Registry
from octfw.types import WarmupSchedule

__all__ = ["check_recipe_change", "BATCH_KEYS", "RecipeChangeRefused"]

log = logging.getLogger(__name__)

#: Keys that only say how the global batch is made up over the devices: a resumed run whose
#: global batch is the checkpoint's trains the same whichever of them says it.
BATCH_KEYS = ("engine.global_batch", "engine.grad_accum_steps")


def check_recipe_change(trained_with: dict[str, Any] | None, recipe: Recipe, registry: Registry, allow: bool, *,
                        resumed_from: str, start_step: int, parts: Components, layout: BatchLayout, run_dir: Path,
                        writes: bool, trained_batch: int | None = None) -> None:
    """A resumed run is the run that was started. The recipe is compared key by key with the
    one that trained the checkpoint (:mod:`octfw.recipe.changes`); every process holds that
    checkpoint, so every process decides alike. A change that shapes training is refused in one
    line naming each key with its old and new value, unless ``allow`` (``--allow-recipe-change``), and
    then the whole schedule (the old one up to the resumed step, the new one after it) must
    pass the pre-flight check: a longer cosine that would rise again is still refused. Every
    change is listed; the run folder keeps each recipe it ran with, by the update step it
    began at (``RUN/recipes/step_N.toml``), written where ``writes`` (rank 0).

    ``trained_batch``: the global batch the checkpoint recorded (None: not recorded). Where this
    run's is the same, :data:`BATCH_KEYS` only restate it (``engine.global_batch`` pinned to it,
    as the refusal of another device count advises, in place of ``grad_accum_steps``): listed
    and taken, not a change of training. Pinned to another batch, the checkpoint is refused
    before this (:func:`octfw.engine.state.restore`)."""
    if not trained_with:  # a checkpoint of an octfw that did not record its recipe
        return
    restated = BATCH_KEYS if trained_batch is not None and trained_batch == layout.global_batch else ()
    changes = recipe_changes(trained_with, recipe.to_dict(), also_untrained=restated)
    trains = [str(c) for c in changes if c.trains]
    where = f"--resume {resumed_from}"
    if trains and not allow:
        raise RecipeChangeRefused(where, trains, (
            f"{where}: the checkpoint was trained with another recipe; these changes would change its training: "
            f"{'; '.join(trains)} (resume with the recipe it began with, start a new run, or accept them with "
            "--allow-recipe-change)"))
    if trains:
        problem = _changed_schedule_problem(trained_with, recipe, registry, parts, start_step)
        if problem is not None:
            raise UserError(f"{where} --allow-recipe-change: {problem}")
    if not changes:
        return
    if writes:
        for change in changes:
            note = (" (changes training; accepted)" if change.trains else
                    " (restates the global batch it trained at)" if change.key in restated else "")
            (log.warning if change.trains else log.info)("resumed with a changed recipe: %s%s", change, note)
        history = run_dir / "recipes"
        history.mkdir(exist_ok=True)
        if not any(history.iterdir()):  # the recipe the run began with
            (history / "step_00000000.toml").write_text(to_toml(trained_with), encoding="utf-8")
        text = to_toml(recipe.to_dict())
        (history / f"step_{start_step:08d}.toml").write_text(text, encoding="utf-8")
        (run_dir / "recipe.toml").write_text(text, encoding="utf-8")


class RecipeChangeRefused(RecipeError):
    """The changes of training a resume refuses: a :class:`RecipeError` (``problems``: one
    ``key: old -> new`` each, as ``octfw.train``'s callers read them) said in one line, as
    every refusal is (a job's launcher prints one line for the job)."""

    def __init__(self, source: str, problems: list[str], message: str):
        UserError.__init__(self, message)
        self.source, self.problems = source, [one_line(p) for p in problems]

    console_text = UserError.console_text  # one line, whatever the values hold


class _ResumedSchedule:
    """The schedule a resumed run follows: the old one before ``start``, the new one from it
    (LRs of None resolved to each recipe's base LR), for the pre-flight check."""

    def __init__(self, old: Any, old_base_lr: float, new: Any, new_base_lr: float, start: int):
        self.parts, self.start = ((old, old_base_lr), (new, new_base_lr)), start
        self.warmup_steps = old.warmup_steps if isinstance(old, WarmupSchedule) else None

    def _at(self, step: int) -> tuple[Any, float]:
        return self.parts[step >= self.start]

    def lr(self, step: int) -> float:
        schedule, base = self._at(step)
        value = schedule.lr(step)
        return base if value is None else value

    def weight_decay(self, step: int) -> float | None:
        return self._at(step)[0].weight_decay(step)

    def ema_momentum(self, step: int) -> float | None:
        return self._at(step)[0].ema_momentum(step)


def _changed_schedule_problem(trained_with: dict[str, Any], recipe: Recipe, registry: Registry, parts: Components,
                              start: int) -> str | None:
    """None when the old schedule up to ``start`` and the new one after it make a schedule that
    the pre-flight check takes; else why not, in one line."""
    from octfw.recipe import validate
    from octfw.engine.schedules import validate_schedule

    old_recipe = validate(trained_with, registry, recipe.source)
    old_total = old_recipe.total_update_steps(parts.steps_per_epoch)  # the same data, the same global batch
    old = old_recipe.scheduler.build(attrs.evolve(parts.ctx, total_update_steps=old_total))
    combined = _ResumedSchedule(old, old_recipe.engine.base_lr, parts.scheduler, recipe.engine.base_lr, start)
    problems = validate_schedule(combined, parts.ctx.total_update_steps, recipe.engine.base_lr,
                                 combined.warmup_steps)
    if not problems:
        return None
    return (f"the run's schedule up to update step {start} followed by the new one is refused: "
            f"{'; '.join(problems)}")


