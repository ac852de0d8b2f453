"""Build every component of a recipe, in dependency order, for ``run`` and ``check``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import attrs

from octfw.display.errors import UserError
from octfw.hookspecs import STAGES
from octfw.recipe import Recipe
from octfw.recipe.resolved import ByStage
from octfw.registry import Registry
from octfw.types import BuildContext, Model, Transform, TransformCheckingDataset, WarmupSchedule
from octfw.display.tables import counted

if TYPE_CHECKING:
    from octfw.engine.distributed import BatchLayout  # imports torch: not at module level (octfw lr)

__all__ = ["Components", "build_components", "plan_update_steps", "check_schedule"]


@attrs.define
class Components(ByStage):
    """The built components: ``parts.dataset``, ``parts.scheduler``, ``parts.guards``, ..."""

    ctx: BuildContext
    by_stage: Mapping[str, Any]  #: stage -> component, or list of components for guard/logger/evaluator
    steps_per_epoch: int
    domains: list[str]


def plan_update_steps(recipe: Recipe, dataset_size: int, layout: BatchLayout) -> tuple[int, int]:
    """(steps per epoch, total update steps), derived once, in update steps."""
    steps_per_epoch = dataset_size // layout.global_batch
    if steps_per_epoch == 0:
        raise UserError(
            f"dataset lists {dataset_size} file{'' if dataset_size == 1 else 's'}, fewer than one global "
            f"batch of {layout.global_batch} "
            f"(engine.per_device_batch {layout.per_device_batch} x {counted(layout.devices, 'device')} x "
            f"engine.grad_accum_steps {layout.grad_accum_steps})"
        )
    return steps_per_epoch, recipe.total_update_steps(steps_per_epoch)


def build_components(
    recipe: Recipe, registry: Registry, *, run_dir: Path | None, rank: int = 0,
    layout: BatchLayout | None = None, with_loggers: bool = True, apply_init: bool = True,
) -> Components:
    """Build dataset first (its size fixes the schedule), then every other stage in STAGES order.
    ``layout``: the run's global batch arithmetic (default: one device). ``apply_init``: False
    when the run restores a checkpoint after this, so a model does not read its ``init`` weights."""
    from octfw.engine.domains import dataset_domains

    from octfw.engine.distributed import layout_for

    layout = layout or layout_for(recipe.engine.per_device_batch, recipe.engine.grad_accum_steps,
                                  recipe.engine.global_batch)
    ctx = recipe.build_context(registry=registry, run_dir=run_dir, rank=rank, world_size=layout.devices,
                               writable_cache=True, apply_init=apply_init)
    dataset = recipe.dataset.build(ctx)
    if len(dataset) == 0:
        raise UserError(f"dataset {recipe.dataset.name!r} lists no files")
    steps_per_epoch, total = plan_update_steps(recipe, len(dataset), layout)
    ctx = attrs.evolve(ctx, total_update_steps=total)
    built: dict[str, Any] = {"dataset": dataset}
    for stage, (_hook, _table, many) in STAGES.items():
        if stage == "dataset":
            continue
        spec = recipe.by_stage[stage]
        if stage == "logger" and not (with_loggers and rank == 0):  # only rank 0 logs
            built[stage] = []
        else:
            built[stage] = [s.build(ctx) for s in spec] if many else spec.build(ctx)
    if isinstance(dataset, TransformCheckingDataset):  # e.g. prepared volumes must meet their transform
        dataset.check_transform(built["transform"])
    check_inputs(recipe, built["transform"], built["model"])
    return Components(ctx, built, steps_per_epoch, dataset_domains(dataset))


def check_inputs(recipe: Recipe, transform: Transform, model: Model) -> None:
    """The model reads only keys the transform declares it makes (refused at build, in one line)."""
    spec = transform.batch_spec()
    missing = [key for key in model.inputs if key not in spec]
    if missing:
        raise UserError(f"[model] {recipe.model.name} reads {', '.join(map(repr, missing))}, which [transform] "
                        f"{recipe.transform.name} does not make (it makes {', '.join(map(repr, spec))})")


def check_schedule(recipe: Recipe, parts: Components) -> None:
    """Pre-flight: simulate the whole schedule and refuse one that restarts or hits 0."""
    check_schedule_values(recipe, parts.scheduler, parts.ctx.total_update_steps)


def check_schedule_values(recipe: Recipe, schedule: Any, total_update_steps: int) -> None:
    """:func:`check_schedule` for a schedule built on its own (``octfw check --steps``)."""
    from octfw.engine.schedules import validate_schedule

    problems = validate_schedule(schedule, total_update_steps, recipe.engine.base_lr,
                                 schedule.warmup_steps if isinstance(schedule, WarmupSchedule) else None)
    if problems:
        raise UserError(f"[scheduler] {recipe.scheduler.name}: " + "; ".join(problems))
