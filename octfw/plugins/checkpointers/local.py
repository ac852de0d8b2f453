"""``local``: atomic checkpoints in a local folder, the newest ``keep_last`` kept.

Layout of the folder (``<run_dir>/checkpoints`` unless ``dir`` is given)::

    step_00000120.pt     one complete checkpoint per save
    step_00000120.pt.tmp a save in progress (or one that was interrupted)
    latest               the file name of the newest complete checkpoint

A save writes ``step_N.pt.tmp``, fsyncs it, renames it to ``step_N.pt``
(``os.replace`` is atomic on one filesystem), then rewrites ``latest`` the
same way. A crash at any point leaves ``latest`` naming a complete file.

The state must hold only tensors and plain Python data (dict, list, tuple,
str, bytes, int, float, bool, None, torch dtypes and devices): ``load`` uses
``torch.load(weights_only=True)``, which cannot run code from the file and
refuses anything else. ``save`` checks this first, so a state that could not
be loaded back fails at its first save rather than at resume. Convert numpy
arrays and RNG states to tensors or lists before saving.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

import attrs

from octfw.errors import UserError
from octfw.fields import Location, doc, positive
from octfw.plugins.checkpointers.common import (
    LATEST, check_plain, checkpoint_name, checkpoint_step, prunable, safe_load,
)
from octfw.types import BuildContext

__all__ = ["LocalCheckpointConfig", "LocalCheckpointer", "build", "checkpoint_name", "LATEST"]

_PARTIAL = re.compile(r"^step_(\d{8,})\.pt\.tmp$")


@attrs.frozen
class LocalCheckpointConfig:
    """Config of the ``local`` checkpointer."""

    dir: Location | None = doc(
        "folder for checkpoints on a local disk; leave out for <run_dir>/checkpoints",
        default=None,
    )
    keep_last: int = doc(
        "how many of the newest checkpoints to keep (the one 'latest' names is never deleted)",
        default=3,
        validator=positive,
    )


def _write_atomically(path: Path, write) -> None:
    """``write(file)`` into ``path.tmp``, fsync, rename over ``path``, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself is durable only once the folder's entry is on disk.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalCheckpointer:
    """Saves on rank 0 only; every rank may ask for ``latest()`` and ``load()`` to resume."""

    def __init__(self, folder: Path | None, keep_last: int = 3, rank: int = 0):
        self.folder = folder
        self.keep_last = keep_last
        self.rank = rank

    def _complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (update step, path), oldest first."""
        if self.folder is None or not self.folder.is_dir():
            return []
        found = []
        for entry in self.folder.iterdir():
            step = checkpoint_step(entry.name)
            if step is not None and entry.is_file():
                found.append((step, entry))
        return sorted(found)

    def checkpoints(self) -> list[tuple[int, str]]:
        """Every complete checkpoint as (update step, path), oldest first (for ``octfw replay``)."""
        return [(step, str(path)) for step, path in self._complete()]

    def _pointed(self) -> Path | None:
        """The checkpoint the ``latest`` file names, if it names one that exists."""
        if self.folder is None:
            return None
        try:
            name = (self.folder / LATEST).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        # Only a bare checkpoint name is followed: never a path out of the folder.
        if checkpoint_step(name) is None:
            return None
        path = self.folder / name
        return path if path.is_file() else None

    def save(self, update_step: int, state: Mapping[str, Any]) -> str:
        """Write ``state`` for ``update_step`` and return its path; "" on ranks other than 0."""
        if self.rank != 0:
            return ""
        if self.folder is None:
            raise UserError("checkpointer: no folder to save into (no run folder and no checkpointer.dir)")
        import torch

        check_plain(state, "state")
        self.folder.mkdir(parents=True, exist_ok=True)
        name = checkpoint_name(update_step)
        path = self.folder / name
        _write_atomically(path, lambda f: torch.save(dict(state), f))
        _write_atomically(self.folder / LATEST, lambda f: f.write(name.encode("utf-8")))
        self._prune(keep=path)
        return str(path)

    def _prune(self, keep: Path) -> None:
        """Delete checkpoints older than the newest ``keep_last``, and leftover ``.tmp`` files."""
        pointed = self._pointed()
        protected = {keep.name} | ({pointed.name} if pointed is not None else set())
        for name in prunable((path.name for _, path in self._complete()), self.keep_last, protected):
            (self.folder / name).unlink(missing_ok=True)
        # Only rank 0 writes here, and its own save has finished: any .tmp left
        # is an interrupted save that would otherwise fill the disk.
        for entry in self.folder.iterdir():
            if _PARTIAL.match(entry.name):
                entry.unlink(missing_ok=True)

    def latest(self) -> str | None:
        """The checkpoint ``latest`` names; else the newest complete ``step_*.pt``; else None."""
        pointed = self._pointed()
        if pointed is not None:
            return str(pointed)
        complete = self._complete()
        return str(complete[-1][1]) if complete else None

    def load(self, location: str) -> dict[str, Any]:
        """Read a checkpoint onto the CPU; raises UserError for a missing or refused file."""
        path = Path(Location(location).local_path)
        if not path.is_file():
            raise UserError(f"checkpoint {location} does not exist")
        return safe_load(str(path), location)


def build(config: LocalCheckpointConfig, ctx: BuildContext) -> LocalCheckpointer:
    if config.dir is not None:
        if config.dir.is_remote:
            raise UserError(
                f"checkpointer.dir = {str(config.dir)!r} is not a local folder; "
                "use the 'gcs' checkpointer for remote locations"
            )
        folder: Path | None = Path(config.dir.local_path)
    elif ctx.run_dir is not None:
        folder = Path(ctx.run_dir) / "checkpoints"
    else:
        folder = None  # `octfw check`: nothing will be saved
    return LocalCheckpointer(folder, keep_last=config.keep_last, rank=ctx.rank)
