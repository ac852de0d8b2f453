"""Start one training job: join the job's processes, pick the run directory on rank 0, then train.

``octfw run`` and ``octfw bench`` (each grid point in its own process) both
start training here, so the run directory and resume rules exist once. While
it trains, rank 0 writes the run's ``octfw.log`` (:func:`octfw.logs.attach_run_log`).

Rank 0 takes every decision below and the other processes of the job hear it
(:class:`octfw.engine.distributed.Peers`), a refusal included: no process
starts training on a decision another did not take.

One process writes a run folder: rank 0 holds it for the run's life
(:class:`octfw.storage.owner.FolderOwner`), and a second ``octfw run`` into
it is refused with one line naming the owner. A start that fails before its
first update step removes the folder it made, so nothing empty is left for
``--resume auto`` to pick.

``--resume auto`` is safe to run again and again (a preemptible VM's startup
script, a queued job that is requeued), and never goes backwards:

- a run of the recipe is still being trained (its folder is held): refused,
  naming the owner;
- otherwise the runs of the recipe are read newest first, and the first one
  that has a complete checkpoint whose checksum holds (or a fallback copy of
  its final state), or that finished, decides; runs with neither (killed
  before their first save, failed starts of an older octfw) are skipped;
- that run finished (or a guard stopped it): nothing is trained again, and
  :class:`AlreadyFinished` carries its summary; unless the recipe now asks
  for another length (``run.max_steps`` or ``run.epochs`` changed), which
  extends it from its last checkpoint. A run whose final save failed, that
  was preempted or interrupted, or that lost a process, is not finished: it
  continues;
- no run has either: a new run folder, which starts from the checkpointer's
  newest checkpoint if it has one (a ``gs://`` folder that outlived the VM,
  as on a recreated spot TPU), else from scratch.

"Newest" is the run started last by its recorded sequence
(:func:`octfw.rundir.run_dirs`), never a folder name or a clock.

**A resumed run is the run that was started**: the trainer compares the
recipe with the one that trained the checkpoint it continues, and refuses a
change that shapes training unless ``allow_recipe_change``
(:func:`octfw.engine.resume.check_recipe_change`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from octfw.engine.backend import require_torch_xla, resolve_device
from octfw.engine.cadence import cadence_warnings
from octfw.engine.distributed import PeerLost, join
from octfw.engine.preemption import StopRequests
from octfw.engine.trainer import FALLBACK_DIR, RunSummary, train
from octfw.errors import UserError
from octfw.logs import attach_run_log, detach_run_log
from octfw.recipe import Recipe, read_with_extends
from octfw.registry import Registry
from octfw.rundir import START_FILES, create_run_dir, run_dirs
from octfw.storage.checkpoints import CheckpointStorage
from octfw.storage.owner import FolderInUse, FolderOwner, describe_owner, is_owned

__all__ = ["launch", "AlreadyFinished"]

logger = logging.getLogger(__name__)


class AlreadyFinished(Exception):
    """``--resume auto`` found the newest run finished: there is nothing to train."""

    def __init__(self, run_dir: Path, summary: dict[str, Any]):
        self.run_dir, self.summary = run_dir, summary
        super().__init__(f"{run_dir} already finished ({summary.get('update_steps')}/"
                         f"{summary.get('total_update_steps')} update steps"
                         + (f", stopped: {summary['stopped']}" if summary.get("stopped") else "") + ")")


def _finished(run_dir: Path, recipe: Recipe) -> dict[str, Any] | None:
    """The summary of ``run_dir`` if that run is done with this recipe's length; else None."""
    summary_file = run_dir / "summary.json"
    if not summary_file.exists():
        return None
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    if any(summary.get(key) for key in ("preempted", "interrupted", "final_save_failed", "peer_lost")):
        return None
    recorded = read_with_extends(run_dir / "recipe.toml").get("run", {})
    extended = (recorded.get("max_steps"), recorded.get("epochs")) != (recipe.run.max_steps, recipe.run.epochs)
    return None if extended else summary


def _has_checkpoint(run_dir: Path, recipe: Recipe, registry: Registry) -> bool:
    """Whether ``run_dir`` can be continued: a complete, intact checkpoint, or a fallback copy."""
    if CheckpointStorage(str(run_dir / FALLBACK_DIR)).latest() is not None:
        return True
    ctx = recipe.build_context(registry=registry, run_dir=run_dir)
    return recipe.by_stage["checkpointer"].build(ctx).latest() is not None


def _resumable_run(recipe: Recipe, registry: Registry) -> tuple[Path | None, dict[str, Any] | None]:
    """(the run of ``recipe`` to continue, or None to start a new one; the summary of that
    run if it finished). See the module docstring."""
    runs = run_dirs(recipe)
    for run_dir in runs:
        owner = is_owned(run_dir)
        if owner is not None:
            raise FolderInUse(f"--resume auto: run folder {run_dir} is in use by {describe_owner(owner)}; "
                              "one process trains a run at a time")
    for run_dir in runs:
        summary = _finished(run_dir, recipe)
        if summary is not None:
            return run_dir, summary
        if _has_checkpoint(run_dir, recipe, registry):
            logger.info("--resume auto: continuing %s", run_dir)
            return run_dir, None
        logger.info("--resume auto: skipping %s (no complete checkpoint: it never saved one)", run_dir)
    logger.info("--resume auto: no earlier run of %r under %s to continue; starting a new run",
                recipe.name, recipe.run.output_dir)
    return None, None


def _failed_start(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds only what a start writes (its start files, and files the
    loggers opened but never wrote): nothing trained, nothing saved."""
    return all(p.name in START_FILES or p.stat().st_size == 0 for p in run_dir.rglob("*") if p.is_file())


def launch(recipe: Recipe, registry: Registry, resume: str | None = None,
           stop_requests: StopRequests | None = None, allow_recipe_change: bool = False) -> RunSummary:
    """Train ``recipe``; ``resume`` is None, ``"auto"`` (see the module docstring) or a
    checkpoint location. Raises :class:`AlreadyFinished` when ``auto`` has nothing to do.
    ``stop_requests``: the command's signal handling, installed since it started.
    ``allow_recipe_change``: continue a run with a recipe that trains otherwise."""
    # Every process of the job runs this: it works out who it is once (device first), then
    # rank 0 decides where the run goes and every process hears the same decision.
    kind = resolve_device(recipe.run.device)
    if kind == "xla":
        require_torch_xla()
    processes, peers = join(kind, recipe.engine.collective_timeout_s)
    run_dir, owner, created = None, None, False

    def remove_failed_start(*_: Any) -> None:  # a refusal, a failure or a stop before the first update
        if created and run_dir is not None and _failed_start(run_dir):  # nothing --resume auto could take
            shutil.rmtree(run_dir, ignore_errors=True)

    def decide() -> tuple[Path, dict[str, Any] | None]:  # rank 0: (the run folder, its summary if finished)
        nonlocal run_dir, owner, created
        for warning in cadence_warnings(recipe.engine):
            logger.warning(warning)
        finished = None
        if resume == "auto":
            run_dir, finished = _resumable_run(recipe, registry)
        if run_dir is None:
            # A new run folder; with "auto" the checkpointer is still asked for its newest
            # checkpoint: a gs:// checkpoint folder outlives a preempted VM and its local disk.
            run_dir, created = create_run_dir(recipe, registry), True
        if finished is None:  # rank 0 writes the folder: it holds it until the run ends
            owner = FolderOwner(run_dir, "run folder")
            owner.acquire()
        return run_dir, finished

    if stop_requests is not None:
        stop_requests.abandon_hooks.append(remove_failed_start)
    try:
        run_dir, finished = peers.decide(decide)  # a refusal on rank 0 is every process's
        if finished is not None:
            raise AlreadyFinished(run_dir, finished)
        run_log = attach_run_log(run_dir) if processes.is_main else None
        try:
            return train(recipe, registry, run_dir, resume=resume, processes=processes, peers=peers,
                         stop_requests=stop_requests, allow_recipe_change=allow_recipe_change)
        finally:
            if run_log is not None:
                detach_run_log(run_log)
    except BaseException as exc:
        remove_failed_start()
        # A collective of the build (DDP's first broadcast) that met a peer gone: not this process's bug.
        lost = None if isinstance(exc, PeerLost) else peers.lost(exc)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        if owner is not None:
            owner.release()
        peers.close()
