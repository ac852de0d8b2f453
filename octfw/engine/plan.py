"""The run plan: what a run is, decided once, before any training.

One object, :class:`RunPlan`, holds every decision about a run that is taken
before its first update step: the run folder (new, or the run resumed), the
checkpoint it continues, who this process is among the job's processes, and
whether the recipe may have changed since that checkpoint. Rank 0 decides,
every process of the job hears the same plan
(:meth:`octfw.engine.distributed.Peers.decide`), and the trainer receives it
and decides nothing about folders. ``octfw run``, ``octfw.train``,
``octfw bench`` and every process a launcher starts come through here
(:func:`planned_run`); :func:`octfw.engine.trainer.train`, given a folder
already made, holds it the same way (:func:`planned_folder`); code that
trains in a folder of its own (a replay's scratch folder, the tests) makes the
plan with :func:`plan_for_folder`.

One process writes a run folder: rank 0 holds it for the run's life
(:class:`octfw.storage.owner.FolderOwner`), and a second ``octfw run`` into
it is refused with one line naming the owner. A start that fails before its
first update step removes the folder it made (and only that one), so nothing
empty is left for ``--resume auto`` to pick.

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
(:func:`octfw.runs.folder.recipe_runs`), never a folder name or a clock.

**The checkpoint continued** is, with ``auto``, the one the run stands at
(:func:`octfw.runs.checkpoint.run_checkpoint`, which ``octfw export``, ``eval`` and
``replay`` ask too): the fallback copy of the final state the checkpointer
could not take (``RUN/fallback``) where it is newer than the checkpointer's
newest complete checkpoint, else that one; with a PATH, that checkpoint.
Every process must be able to read it, or the run is refused before anyone
loads anything. **The global batch** of a run continued by ``auto`` is the one
it recorded at its first start (``RUN/run.json``): kept on another number of
devices, the accumulation derived from those found. **A resumed run is the run that was started**: the trainer
compares the recipe with the one that trained that checkpoint
(:func:`octfw.engine.resume.check_recipe_change`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import attrs

from octfw.engine.backend import this_process
from octfw.engine.cadence import cadence_warnings
from octfw.engine.distributed import Peers, Processes
from octfw.engine.preemption import StopRequests
from octfw.display.errors import UserError
from octfw.recipe import Recipe, read_with_extends
from octfw.registry import Registry
from octfw.runs.checkpoint import run_checkpoint
from octfw.runs.folder import START_FILES, create_run_dir, recipe_runs, run_record
from octfw.storage.owner import FolderInUse, FolderOwner, describe_owner, is_owned

__all__ = ["RunPlan", "AlreadyFinished", "planned_run", "planned_folder", "plan_for_folder"]

logger = logging.getLogger(__name__)


@attrs.frozen
class RunPlan:
    """Everything decided about a run before training; the same on every process of the job."""

    recipe: Recipe
    run_dir: Path
    processes: Processes  #: who this process is (rank, world, device), from :func:`~octfw.engine.distributed.join`
    resume_from: str | None = None  #: the checkpoint the run continues (None: from the start)
    #: ``resume_from`` is the run's fallback copy of its final state: the final save must reach the
    #: checkpointer, even with no update step left
    from_fallback: bool = False
    allow_recipe_change: bool = False  #: ``--allow-recipe-change``: a resume may train otherwise
    #: the global batch the run continued trains at (recorded in its ``run.json``), kept on other
    #: devices; None: a new run, or a checkpoint named by its path
    trained_batch: int | None = None


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


def _checkpoint(run_dir: Path, recipe: Recipe, registry: Registry) -> tuple[str | None, bool]:
    """The checkpoint ``run_dir`` stands at, as every command sees it (:func:`octfw.runs.checkpoint.run_checkpoint`)."""
    ctx = recipe.build_context(registry=registry, run_dir=run_dir)
    return run_checkpoint(run_dir, recipe.by_stage["checkpointer"].build(ctx))


@attrs.frozen
class _Found:
    """What ``--resume auto`` read of a recipe's runs: the run to continue (None: a new one), its
    summary if it finished, and the checkpoint it stands at (location, whether the fallback copy)."""

    run_dir: Path | None = None
    finished: dict[str, Any] | None = None
    checkpoint: tuple[str | None, bool] = (None, False)
    trained_batch: int | None = None  #: the global batch the run recorded at its first start


def _resumable_run(recipe: Recipe, registry: Registry) -> _Found:
    """What the runs folder and the checkpoint store say of ``recipe``'s runs, read once: the
    run to continue, its summary if it finished, the checkpoint it stands at. See the module
    docstring."""
    runs = recipe_runs(recipe)
    for run_dir in (run.folder for run in runs):
        owner = is_owned(run_dir)
        if owner is not None:
            raise FolderInUse(f"--resume auto: run folder {run_dir} is in use by {describe_owner(owner)}; "
                              "one process trains a run at a time")
    for run in runs:
        run_dir = run.folder
        summary = _finished(run_dir, recipe)
        if summary is not None:
            return _Found(run_dir, summary)
        checkpoint = _checkpoint(run_dir, recipe, registry)
        if checkpoint[0] is not None:
            logger.info("--resume auto: continuing %s", run_dir)
            return _Found(run_dir, None, checkpoint, run.global_batch)
        logger.info("--resume auto: skipping %s (no complete checkpoint: it never saved one)", run_dir)
    logger.info("--resume auto: no earlier run of %r under %s to continue; starting a new run",
                recipe.name, recipe.run.output_dir)
    return _Found()


def _failed_start(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds only what a start writes (its start files, and files the
    loggers opened but never wrote): nothing trained, nothing saved."""
    return all(p.name in START_FILES or p.stat().st_size == 0 for p in run_dir.rglob("*") if p.is_file())


def plan_for_folder(recipe: Recipe, registry: Registry, run_dir: Path, resume: str | None = None, *,
                    processes: Processes | None = None, peers: Peers | None = None,
                    allow_recipe_change: bool = False) -> RunPlan:
    """The plan of a run in ``run_dir``, a folder already chosen; ``resume``: None, ``"auto"``
    (the checkpoint the folder stands at: :func:`octfw.runs.checkpoint.run_checkpoint`) or a checkpoint location.
    Rank 0 decides which checkpoint; every process must be able to read it. ``processes``:
    who this process is in a job (default: alone on ``run.device``)."""
    processes = processes or this_process(recipe.run.device)
    peers = peers or Peers(processes)

    def checkpoint() -> tuple[str | None, bool]:
        return _checkpoint(run_dir, recipe, registry) if resume == "auto" else (resume, False)

    location, from_fallback, batch = peers.decide(lambda: (*checkpoint(), _trained_batch(run_dir, resume)))
    return _plan(recipe, run_dir, processes, peers, location, from_fallback, resume, allow_recipe_change, batch)


def _trained_batch(run_dir: Path, resume: str | None) -> int | None:
    """The global batch recorded by the run ``--resume auto`` continues in ``run_dir``."""
    return run_record(run_dir).global_batch if resume == "auto" else None


def _plan(recipe: Recipe, run_dir: Path, processes: Processes, peers: Peers, location: str | None,
          from_fallback: bool, resume: str | None, allow_recipe_change: bool, trained_batch: int | None) -> RunPlan:
    """The plan, once the folder and the checkpoint are decided: refused unless every process
    can read the checkpoint."""
    if location is not None and not peers.all_agree(_readable(location)):
        raise UserError(f"the checkpoint to resume, {location}, cannot be read by every process of the job; "
                        "put checkpointer.dir on storage that every node reads (gs://, a shared file system)")
    if from_fallback:
        logger.warning("--resume auto: continuing from %s, the final state the checkpointer could not take; "
                       "it is written to the checkpointer at the end of this run", location)
    elif resume == "auto" and location is None:  # a new run, or one killed before its first save
        logger.info("--resume auto: no complete checkpoint yet; training from the start")
    return RunPlan(recipe, run_dir, processes, location, from_fallback, allow_recipe_change, trained_batch)


def _held(run_dir: Path) -> FolderOwner:
    """``run_dir``, held by this process (its one writer) until released; FolderInUse, one line
    naming the owner, when another live process holds it."""
    owner = FolderOwner(run_dir, "run folder")
    owner.acquire()
    return owner


@contextlib.contextmanager
def planned_folder(recipe: Recipe, registry: Registry, run_dir: Path, resume: str | None = None, *,
                   allow_recipe_change: bool = False) -> Iterator[RunPlan]:
    """The plan of a run in ``run_dir``, a folder already made, trained by this process alone,
    the folder held while the block runs as :func:`planned_run` holds it: a second trainer
    into it, from Python or ``octfw run``, is refused."""
    owner = _held(run_dir)
    try:
        yield plan_for_folder(recipe, registry, run_dir, resume, allow_recipe_change=allow_recipe_change)
    finally:
        owner.release()


def _readable(location: str) -> bool:
    """Whether this process sees the checkpoint file ``location`` (a path or an fsspec URL)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(location)
        return bool(fs.exists(path))
    except Exception:  # noqa: BLE001 - unreachable counts as unreadable; the refusal says where
        return False


@contextlib.contextmanager
def planned_run(recipe: Recipe, registry: Registry, *, resume: str | None, processes: Processes, peers: Peers,
                stop_requests: StopRequests | None = None, allow_recipe_change: bool = False) -> Iterator[RunPlan]:
    """The plan of a new or resumed run of ``recipe`` (see the module docstring), its folder held
    by rank 0 while the block runs; a start that fails (or is stopped) before its first update
    step removes the folder it made. Raises :class:`AlreadyFinished` when ``auto`` has nothing
    to do."""
    run_dir, owner, created = None, None, False

    def remove_failed_start(*_: Any) -> None:  # a refusal, a failure or a stop before the first update
        if created and run_dir is not None and _failed_start(run_dir):  # nothing --resume auto could take
            shutil.rmtree(run_dir, ignore_errors=True)

    def decide() -> tuple[Path, dict[str, Any] | None, str | None, bool, int | None]:
        """Rank 0: read (the recipe's runs, their owners and checkpoints), decide, then create
        (a new folder) and hold the folder trained. (The run folder, its summary if it finished,
        the checkpoint continued, whether it is the fallback copy, the global batch it trains at.)"""
        nonlocal run_dir, owner, created
        # Once per run, here on rank 0: what the extends chain dropped, a missing safety guard,
        # a checkpoint cadence in step with another.
        for warning in (*recipe.warnings(), *cadence_warnings(recipe.engine)):
            logger.warning(warning)
        found = _resumable_run(recipe, registry) if resume == "auto" else _Found(checkpoint=(resume, False))
        run_dir = found.run_dir
        checkpoint = found.checkpoint
        if run_dir is None:
            run_dir, created = create_run_dir(recipe, registry), True
            if resume == "auto":  # the checkpointer's newest: a gs:// folder outlives a preempted VM's disk
                checkpoint = _checkpoint(run_dir, recipe, registry)
        if found.finished is None:  # rank 0 writes the folder: it holds it until the run ends
            owner = _held(run_dir)
        return run_dir, found.finished, *checkpoint, found.trained_batch

    if stop_requests is not None:
        stop_requests.abandon_hooks.append(remove_failed_start)
    try:
        run_dir, finished, location, from_fallback, batch = peers.decide(decide)  # a refusal on rank 0: every process's
        if finished is not None:
            raise AlreadyFinished(run_dir, finished)
        yield _plan(recipe, run_dir, processes, peers, location, from_fallback, resume, allow_recipe_change, batch)
    except BaseException:
        remove_failed_start()
        raise
    finally:
        if owner is not None:
            owner.release()
