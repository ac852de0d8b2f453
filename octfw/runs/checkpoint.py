"""Which checkpoint a run stands at, decided here once (:func:`run_checkpoint`).

The newer of the run's fallback copy (``RUN/fallback``, the final state the
checkpointer could not take) and the checkpointer's newest complete checkpoint.
``--resume auto``, ``octfw export``, ``octfw eval`` (``--checkpoints`` too),
``octfw replay`` and ``octfw.load_encoder`` of a run folder all ask it.
"""

from __future__ import annotations

from pathlib import Path

from octfw.storage.checkpoint_names import checkpoint_step
from octfw.storage.checkpoints import CheckpointStorage
from octfw.types import Checkpointer, ListingCheckpointer

__all__ = ["FALLBACK_DIR", "fallback_storage", "run_checkpoint", "run_checkpoints"]

#: Folder of the run directory that takes the final state when the checkpointer cannot.
FALLBACK_DIR = "fallback"


def fallback_storage(run_dir: Path) -> CheckpointStorage:
    """RUN/fallback: the final state, when the checkpointer could not take it (a full disk, a store away)."""
    return CheckpointStorage(str(run_dir / FALLBACK_DIR), keep_last=1)


def _step(location: str, checkpointer: Checkpointer) -> int:
    """The update step of checkpoint ``location``: from its name (``step_00000120.pt``) where it
    has one, else from its contents (a checkpointer of other names)."""
    step = checkpoint_step(location.rstrip("/").rsplit("/", 1)[-1])
    return step if step is not None else int(checkpointer.load(location).get("update_step", 0))


def run_checkpoint(run_dir: Path, checkpointer: Checkpointer) -> tuple[str | None, bool]:
    """The checkpoint the run in ``run_dir`` stands at: (its location, or None before the run's
    first save; whether it is the run's fallback copy). ``checkpointer``: the run's, built from
    its recipe (it also loads the location, the fallback's included).

    The fallback copy is preferred when it is newer than the checkpointer's newest complete,
    intact checkpoint: it holds the final state of a run whose final save failed, which the
    checkpointer never got, so the checkpointer's newest is older (exporting it would silently
    drop the run's last steps). It is not preferred when the checkpointer has caught up or gone
    past it (a resumed run that saved there, then was killed before its final save removed the
    copy): taking it then would go backwards. The checkpointer's copy wins a tie: it is the
    run's own store, and nothing is left to upload.
    """
    fallback = fallback_storage(run_dir).latest()
    step = _step(fallback, checkpointer) if fallback is not None else None
    if step is not None and isinstance(checkpointer, ListingCheckpointer) \
            and all(listed < step for listed, _ in checkpointer.checkpoints()):
        return fallback, True  # newer than all it lists: its newest need not be read (a download, on gs://)
    newest = checkpointer.latest()
    if step is not None and (newest is None or step > _step(newest, checkpointer)):
        return fallback, True
    return newest, False


def run_checkpoints(run_dir: Path, checkpointer: Checkpointer) -> list[tuple[int, str]]:
    """Every complete checkpoint of the run in ``run_dir`` as (update step, location), oldest
    first, for choosing among them (``octfw eval --checkpoints``, ``octfw replay``): the last is
    always the one :func:`run_checkpoint` chooses, the fallback copy where it is newer; a
    listed checkpoint newer than that one is damaged (``latest()`` skipped it, saying so) and
    left out. A checkpointer that cannot list (:class:`~octfw.types.ListingCheckpointer`)
    gives its newest alone. Empty before the run's first save."""
    chosen, _ = run_checkpoint(run_dir, checkpointer)
    if chosen is None:
        return []
    step = _step(chosen, checkpointer)
    listed = checkpointer.checkpoints() if isinstance(checkpointer, ListingCheckpointer) else []
    return sorted({(s, location) for s, location in listed if s < step} | {(step, chosen)})
