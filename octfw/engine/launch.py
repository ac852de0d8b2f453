"""Start one training job: pick the run directory on rank 0, then train.

``octfw run`` and ``octfw bench`` (each grid point in its own process) both
start training here, so the run directory and resume rules exist once. While
it trains, rank 0 writes the run's ``octfw.log`` (:func:`octfw.logs.attach_run_log`).

``--resume auto`` is safe to run again and again (a preemptible VM's startup
script, a queued job that is requeued):

- no earlier run of the recipe: a new run folder, which starts from the
  checkpointer's newest checkpoint if it has one (a ``gs://`` folder that
  outlived the VM, as on a recreated spot TPU), else from scratch;
- the newest run has no ``summary.json`` (killed) or its summary says it was
  preempted: it continues from its last complete checkpoint, or from the
  start when it has none;
- the newest run finished (or a guard stopped it): nothing is trained again,
  and :class:`AlreadyFinished` carries its summary; unless the recipe now asks
  for another length (``run.max_steps`` or ``run.epochs`` changed), which
  extends it from its last checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from octfw.engine.backend import resolve_device
from octfw.engine.cadence import cadence_warnings
from octfw.engine.distributed import broadcast_object, init_process_group
from octfw.engine.trainer import RunSummary, train
from octfw.logs import attach_run_log, detach_run_log
from octfw.recipe import Recipe, read_with_extends
from octfw.registry import Registry
from octfw.rundir import create_run_dir, latest_run_dir

__all__ = ["launch", "AlreadyFinished"]

logger = logging.getLogger(__name__)


class AlreadyFinished(Exception):
    """``--resume auto`` found the newest run finished: there is nothing to train."""

    def __init__(self, run_dir: Path, summary: dict[str, Any]):
        self.run_dir, self.summary = run_dir, summary
        super().__init__(f"{run_dir} already finished ({summary.get('update_steps')}/"
                         f"{summary.get('total_update_steps')} update steps"
                         + (f", stopped: {summary['stopped']}" if summary.get("stopped") else "") + ")")


def _resumable_run(recipe: Recipe) -> tuple[Path | None, dict[str, Any] | None]:
    """(the newest run of ``recipe`` to continue, or None to start a new one; the
    summary of that run if it finished). See the module docstring."""
    run_dir = latest_run_dir(recipe)
    if run_dir is None:
        logger.info("--resume auto: no earlier run of %r under %s; starting a new run",
                    recipe.name, recipe.run.output_dir)
        return None, None
    summary_file = run_dir / "summary.json"
    if summary_file.exists():
        summary = json.loads(summary_file.read_text(encoding="utf-8"))
        recorded = read_with_extends(run_dir / "recipe.toml").get("run", {})
        extended = (recorded.get("max_steps"), recorded.get("epochs")) != (recipe.run.max_steps, recipe.run.epochs)
        if not summary.get("preempted") and not extended:
            return run_dir, summary
    logger.info("--resume auto: continuing %s", run_dir)
    return run_dir, None


def launch(recipe: Recipe, registry: Registry, resume: str | None = None) -> RunSummary:
    """Train ``recipe``; ``resume`` is None, ``"auto"`` (see the module docstring) or a
    checkpoint location. Raises :class:`AlreadyFinished` when ``auto`` has nothing to do."""
    # Under torchrun every process runs this; rank 0 picks the run directory.
    rank, _world = init_process_group(resolve_device(recipe.run.device))
    run_dir, finished = None, None
    if rank == 0:
        for warning in cadence_warnings(recipe.engine):
            logger.warning(warning)
        if resume == "auto":
            run_dir, finished = _resumable_run(recipe)
        if run_dir is None:
            # A new run folder; with "auto" the checkpointer is still asked for its newest
            # checkpoint: a gs:// checkpoint folder outlives a preempted VM and its local disk.
            run_dir = create_run_dir(recipe, registry)
    run_dir, resume, finished = broadcast_object((run_dir, resume, finished))  # every rank decides alike
    if finished is not None:
        raise AlreadyFinished(run_dir, finished)
    run_log = attach_run_log(run_dir) if rank == 0 else None
    try:
        return train(recipe, registry, run_dir, resume=resume)
    finally:
        if run_log is not None:
            detach_run_log(run_log)
