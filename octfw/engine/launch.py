"""Start one training job: pick the run directory on rank 0, then train.

``octfw run`` and ``octfw bench`` (each grid point in its own process) both
start training here, so the run directory and resume rules exist once. While
it trains, rank 0 writes the run's ``octfw.log`` (:func:`octfw.logs.attach_run_log`).
"""

from __future__ import annotations

import logging

from octfw.engine.backend import resolve_device
from octfw.engine.cadence import cadence_warnings
from octfw.engine.distributed import broadcast_object, init_process_group
from octfw.engine.trainer import RunSummary, train
from octfw.errors import UserError
from octfw.logs import attach_run_log, detach_run_log
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.rundir import create_run_dir, latest_run_dir

__all__ = ["launch"]

logger = logging.getLogger(__name__)


def launch(recipe: Recipe, registry: Registry, resume: str | None = None) -> RunSummary:
    """Train ``recipe``; ``resume`` is None, ``"auto"`` (the newest run of this
    recipe, from its last complete checkpoint) or a checkpoint location."""
    # Under torchrun every process runs this; rank 0 picks the run directory.
    rank, _world = init_process_group(resolve_device(recipe.run.device))
    run_dir = None
    if rank == 0:
        for warning in cadence_warnings(recipe.engine):
            logger.warning(warning)
        if resume == "auto":
            run_dir = latest_run_dir(recipe)
            if run_dir is None:
                raise UserError(f"--resume auto: no earlier run of {recipe.name!r} under {recipe.run.output_dir}")
        else:
            run_dir = create_run_dir(recipe, registry)
    run_dir = broadcast_object(run_dir)
    run_log = attach_run_log(run_dir) if rank == 0 else None
    try:
        return train(recipe, registry, run_dir, resume=resume)
    finally:
        if run_log is not None:
            detach_run_log(run_log)
