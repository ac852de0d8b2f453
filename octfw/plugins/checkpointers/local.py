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
from octfw.types import BuildContext

__all__ = ["LocalCheckpointConfig", "LocalCheckpointer", "build", "checkpoint_name", "LATEST"]

LATEST = "latest"
_COMPLETE = re.compile(r"^step_(\d{8,})\.pt$")
_PARTIAL = re.compile(r"^step_(\d{8,})\.pt\.tmp$")


def checkpoint_name(update_step: int) -> str:
    """File name of the checkpoint taken at ``update_step``."""
    return f"step_{update_step:08d}.pt"


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


def _check_plain(value: Any, where: str) -> None:
    """Raise TypeError naming the first value ``torch.load(weights_only=True)`` would refuse."""
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor,
                                           torch.dtype, torch.device)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds only "
        "tensors and plain Python data (convert it to a tensor or a list)"
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


# Lines of torch's weights_only message that say nothing about this file.
_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _reason(exc: Exception) -> str:
    """The line of a ``torch.load`` error that names what was refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    specific = [line for line in lines if not line.startswith(_BOILERPLATE)]
    return (specific or lines or [""])[0]


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
            match = _COMPLETE.match(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def _pointed(self) -> Path | None:
        """The checkpoint the ``latest`` file names, if it names one that exists."""
        if self.folder is None:
            return None
        try:
            name = (self.folder / LATEST).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        # Only a bare checkpoint name is followed: never a path out of the folder.
        if not _COMPLETE.match(name):
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

        _check_plain(state, "state")
        self.folder.mkdir(parents=True, exist_ok=True)
        name = checkpoint_name(update_step)
        path = self.folder / name
        _write_atomically(path, lambda f: torch.save(dict(state), f))
        _write_atomically(self.folder / LATEST, lambda f: f.write(name.encode("utf-8")))
        self._prune(keep=path)
        return str(path)

    def _prune(self, keep: Path) -> None:
        """Delete checkpoints older than the newest ``keep_last``, and leftover ``.tmp`` files."""
        complete = self._complete()
        protected = {keep, self._pointed()}
        for _, path in complete[: max(0, len(complete) - self.keep_last)]:
            if path not in protected:
                path.unlink(missing_ok=True)
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
        import torch

        path = Path(Location(location).local_path)
        if not path.is_file():
            raise UserError(f"checkpoint {location} does not exist")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with the file's name
            raise UserError(
                f"checkpoint {location} cannot be loaded safely ({type(exc).__name__}: {_reason(exc)}); "
                "octfw loads tensors and plain Python data only"
            ) from exc
        if not isinstance(state, dict):
            raise UserError(f"checkpoint {location} holds a {type(state).__name__}, not a dict")
        return state


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
