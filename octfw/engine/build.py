"""Build every component of a recipe, in dependency order, for ``run`` and ``check``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from octfw.errors import UserError
from octfw.recipe import Recipe
from octfw.types import BuildContext

__all__ = ["Components", "build_components", "plan_update_steps", "cache_dir_for", "check_schedule"]


@attrs.define
class Components:
    ctx: BuildContext
    dataset: Any
    transform: Any
    model: Any
    schedule: Any
    guards: list[Any]
    loggers: list[Any]
    checkpointer: Any
    steps_per_epoch: int
    domains: list[str]
    evaluators: list[Any] = attrs.field(factory=list)


def cache_dir_for(recipe: Recipe) -> Path:
    if recipe.run.cache_dir is not None:
        return Path(recipe.run.cache_dir.local_path)
    return Path(os.environ.get("OCTFW_CACHE_DIR") or Path.home() / ".cache" / "octfw")


def plan_update_steps(recipe: Recipe, dataset_size: int, world_size: int) -> tuple[int, int]:
    """(steps per epoch, total update steps), derived once, in update steps."""
    engine, run = recipe.engine, recipe.run
    global_batch = engine.per_device_batch * world_size * engine.grad_accum_steps
    steps_per_epoch = dataset_size // global_batch
    if steps_per_epoch == 0:
        raise UserError(
            f"dataset has {dataset_size} samples, fewer than one global batch of {global_batch} "
            f"(engine.per_device_batch {engine.per_device_batch} x {world_size} devices x "
            f"engine.grad_accum_steps {engine.grad_accum_steps})"
        )
    total = steps_per_epoch * run.epochs if run.epochs is not None else run.max_steps
    if run.max_steps is not None:
        total = min(total, run.max_steps)
    return steps_per_epoch, total


def _geometry(recipe: Recipe) -> dict[str, Any]:
    # Conventions documented in octfw.hookspecs: the transform's image_size and
    # the model's patch_size define the patch grid both must agree on.
    image_size = getattr(recipe.transform.config, "image_size", None)
    patch_size = getattr(recipe.model.config, "patch_size", None)
    return {
        "image_size": tuple(image_size) if image_size is not None else None,
        "patch_size": tuple(patch_size) if patch_size is not None else None,
    }


def build_components(
    recipe: Recipe, *, run_dir: Path | None, rank: int = 0, world_size: int = 1,
    with_loggers: bool = True,
) -> Components:
    """Build dataset first (its size fixes the schedule), then everything else."""
    from octfw.engine.data import dataset_domains  # imports torch: not at module level (octfw list)

    ctx = BuildContext(
        recipe_dir=recipe.folder,
        cache_dir=cache_dir_for(recipe),
        run_dir=run_dir,
        seed=recipe.run.seed,
        rank=rank,
        world_size=world_size,
        base_lr=recipe.engine.base_lr,
        weight_decay=recipe.engine.weight_decay,
        recipe=recipe.to_dict(),
        **_geometry(recipe),
    )
    dataset = recipe.dataset.build(ctx)
    if len(dataset) == 0:
        raise UserError(f"dataset {recipe.dataset.name!r} holds no samples")
    steps_per_epoch, total = plan_update_steps(recipe, len(dataset), world_size)
    ctx = attrs.evolve(ctx, total_update_steps=total)
    transform = recipe.transform.build(ctx)
    model = recipe.model.build(ctx)
    schedule = recipe.scheduler.build(ctx)
    guards = [spec.build(ctx) for spec in recipe.guards]
    loggers = [spec.build(ctx) for spec in recipe.loggers] if with_loggers and rank == 0 else []
    checkpointer = recipe.checkpointer.build(ctx)
    domains = dataset_domains(dataset)
    evaluators = [spec.build(ctx) for spec in recipe.evaluators]
    return Components(ctx, dataset, transform, model, schedule, guards, loggers,
                      checkpointer, steps_per_epoch, domains, evaluators)


def check_schedule(recipe: Recipe, parts: Components) -> None:
    """Pre-flight: simulate the whole schedule and refuse one that restarts or hits 0."""
    from octfw.schedules import validate_schedule

    problems = validate_schedule(parts.schedule, parts.ctx.total_update_steps, recipe.engine.base_lr,
                                 getattr(parts.schedule, "warmup_steps", None))
    if problems:
        raise UserError(f"[scheduler] {recipe.scheduler.name}: " + "; ".join(problems))
