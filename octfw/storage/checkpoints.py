"""Checkpoints of one run in one folder: naming, the ``latest`` pointer, retention, safe loading.

Every checkpointer keeps its files through :class:`CheckpointStorage`, on a
local disk or any fsspec store, so what is complete, what ``latest`` means and
what ``keep_last`` deletes are decided here, once. Layout of the folder::

    step_00000120.pt      one checkpoint per save; names sort by update step
    step_00000120.pt.tmp  a local save in progress, or one that was interrupted
    latest                the pointer, written after the checkpoint

The pointer (format 1) lists the kept checkpoints, newest first, each with
its size in bytes::

    {"format": 1, "checkpoints": [{"name": "step_00000120.pt", "bytes": 10212539}, ...]}

``latest()`` returns the first entry whose file exists with exactly that
size, so it never names a checkpoint whose write was cut short, and falls back
to an older entry when the newest is missing or truncated. A pointer in the
older local format (the bare name of one checkpoint) is still read, as one
entry whose size is unknown; the next save rewrites it in format 1.

A save writes the checkpoint, then the pointer, then deletes what
``keep_last`` lets go and any ``.tmp`` leftovers. On a local disk a write goes
to ``<name>.tmp`` and is renamed into place, so a ``step_*.pt`` there is
always complete and, when no pointer entry holds, the newest one is used. An
object store is written in place, and other fsspec stores may show an object
while it is still written: there an object no pointer lists (a save that died
before its pointer) is never trusted, and the next saves prune it.

The state must hold only tensors and plain Python data (dict, list, tuple,
str, bytes, int, float, complex, bool, None, torch dtypes and devices): loads
use ``torch.load(weights_only=True)``, which cannot run code from the file.
:func:`check_plain` refuses anything else at save time, so a state that could
not be loaded back fails at its first save rather than at resume.

Light at import time (stdlib only): torch and fsspec load inside the functions.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
from typing import IO, Any, Iterable, Iterator, Mapping

from octfw.errors import UserError
from octfw.storage.files import Data, is_local_filesystem, open_filesystem, write_atomically
from octfw.storage.retry import RetryPolicy

__all__ = [
    "LATEST", "POINTER_FORMAT", "PointerEntry", "CheckpointStorage",
    "checkpoint_name", "checkpoint_step", "prunable", "parse_pointer", "format_pointer",
    "check_plain", "safe_load", "load_checkpoint",
]

logger = logging.getLogger(__name__)

#: Name of the pointer to the newest complete checkpoint, next to the checkpoints.
LATEST = "latest"
#: Version of the pointer's JSON layout.
POINTER_FORMAT = 1

_COMPLETE = re.compile(r"^step_(\d{8,})\.pt$")
# What an interrupted local write leaves: a checkpoint's or the pointer's temporary file.
_LEFTOVER = re.compile(r"^(step_\d{8,}\.pt|latest)\.tmp$")


# --- names and retention ------------------------------------------------------


def checkpoint_name(update_step: int) -> str:
    """Name of the checkpoint taken at ``update_step``."""
    return f"step_{update_step:08d}.pt"


def checkpoint_step(name: str) -> int | None:
    """The update step of a checkpoint name; None for any other name (``.tmp``, ``latest``, paths)."""
    match = _COMPLETE.match(name)
    return int(match.group(1)) if match else None


def prunable(names: Iterable[str], keep_last: int, protected: Iterable[str] = ()) -> list[str]:
    """Checkpoint names to delete so that the newest ``keep_last`` (by update step) remain.

    Names in ``protected`` (the one just written) are never returned, even
    when older: a run that restarted its numbering below an earlier run's
    must not lose the checkpoint its pointer names.
    """
    keep = set(protected)
    ordered = sorted((step, name) for name in names if (step := checkpoint_step(name)) is not None)
    return [name for _, name in ordered[: max(0, len(ordered) - keep_last)] if name not in keep]


# --- the pointer ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PointerEntry:
    """One checkpoint the pointer lists; ``bytes`` is None for an old-format pointer."""

    name: str
    bytes: int | None


def parse_pointer(raw: bytes) -> list[PointerEntry]:
    """Entries of a ``latest`` pointer, newest first; [] for a damaged or foreign one.

    Reads format 1 (JSON, with sizes) and the older local format (one bare
    checkpoint name). Only bare checkpoint names are followed, never a path
    out of the folder.
    """
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return []
    if checkpoint_step(text) is not None:
        return [PointerEntry(text, None)]  # written by octfw before pointer format 1
    try:
        record = json.loads(text)
        if record["format"] != POINTER_FORMAT:
            return []  # a newer layout: trust none of it rather than misread it
        entries = [PointerEntry(str(e["name"]), int(e["bytes"])) for e in record["checkpoints"]]
    except (ValueError, KeyError, TypeError):
        return []  # damaged, or not octfw's: trust no entry of it
    return [e for e in entries if checkpoint_step(e.name) is not None]


def format_pointer(entries: Iterable[PointerEntry]) -> bytes:
    """The ``latest`` pointer (format 1) listing ``entries``, newest first."""
    listed = [{"name": e.name, "bytes": e.bytes} for e in entries]
    return json.dumps({"format": POINTER_FORMAT, "checkpoints": listed}).encode("utf-8")


# --- what a checkpoint may hold, and reading one ------------------------------------


def check_plain(value: Any, where: str = "state") -> None:
    """Raise TypeError naming the first value ``torch.load(weights_only=True)`` would refuse."""
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor,
                                           torch.dtype, torch.device)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds only "
        "tensors and plain Python data (convert it to a tensor or a list)"
    )


# Lines of torch's weights_only message that say nothing about this file.
_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _reason(exc: Exception) -> str:
    """The line of a ``torch.load`` error that names what was refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    specific = [line for line in lines if not line.startswith(_BOILERPLATE)]
    return (specific or lines or [""])[0]


def safe_load(source: str | IO[bytes], location: str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` onto the CPU; UserError naming ``location`` if refused.

    ``source`` is a local path or a binary file object (a BytesIO of a remote
    object). weights_only cannot run code from the file: a pickled arbitrary
    object is refused, not executed.
    """
    import pickle

    import torch

    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused an object: never executed
        raise UserError(
            f"checkpoint {location} cannot be loaded safely ({type(exc).__name__}: {_reason(exc)}); "
            "octfw loads tensors and plain Python data only"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - re-raised with the checkpoint's name
        raise UserError(
            f"checkpoint {location} cannot be read ({type(exc).__name__}: {_reason(exc)}); "
            "the file is cut short or not a checkpoint"
        ) from exc
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {location} holds a {type(state).__name__}, not a dict")
    return state


def _read_checkpoint(fs: Any, path: str, location: str, retry: RetryPolicy) -> dict[str, Any]:
    if is_local_filesystem(fs):
        if not os.path.isfile(path):
            raise UserError(f"checkpoint {location} does not exist")
        return safe_load(path, location)  # torch reads the file itself: no second copy in memory
    try:
        data = retry.run(f"download {location}", fs.cat_file, path, **retry.options(fs))
    except FileNotFoundError:
        raise UserError(f"checkpoint {location} does not exist") from None
    return safe_load(io.BytesIO(data), location)


def load_checkpoint(url: str, retry: RetryPolicy = RetryPolicy()) -> dict[str, Any]:
    """Read the checkpoint file at ``url`` (local path, ``file://`` or fsspec URL) onto the CPU.

    Uses ``torch.load(weights_only=True)``; raises UserError for a missing
    file or one holding anything but tensors and plain Python data. Remote
    reads are tried as ``retry`` says.
    """
    fs, path = open_filesystem(url, fresh=True)
    return _read_checkpoint(fs, path, url, retry)


# --- one folder of checkpoints ------------------------------------------------------


class CheckpointStorage:
    """The checkpoints in folder ``url`` (a local path or fsspec URL): save, list, latest, load.

    ``keep_last``: how many of the newest checkpoints a save leaves. ``retry``:
    how each storage operation is retried (not at all by default: a local
    disk). ``setting``: the config key that named the folder, for error
    messages. One process writes (rank 0); any number may read. The
    filesystem is opened on first use, so building a component opens no
    connection.
    """

    def __init__(self, url: str, keep_last: int = 3, retry: RetryPolicy = RetryPolicy(),
                 setting: str | None = None):
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.retry = retry
        self.setting = setting
        self._fs: Any = None
        self._root = ""

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.url!r}, keep_last={self.keep_last})"

    # --- the filesystem, each operation retried ---------------------------------

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of the folder (a fresh client: see ``open_filesystem``)."""
        if self._fs is None:
            self._fs, root = open_filesystem(self.url, fresh=True, setting=self.setting)
            self._root = root.rstrip("/")
        return self._fs

    def location(self, name: str) -> str:
        """The URL (or local path) of file ``name`` in the folder, as ``save`` returns it."""
        return f"{self.url}/{name}"

    @property
    def root(self) -> str:
        """Path of the folder inside the filesystem (``bucket/run`` for ``gs://bucket/run``)."""
        self.fs  # noqa: B018 - opening the filesystem also sets the root
        return self._root

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    @property
    def _renamed_into_place(self) -> bool:
        """Whether files here appear only once complete (a local disk: written, then renamed)."""
        return is_local_filesystem(self.fs)

    def _complete_without_pointer(self) -> list[str]:
        """Checkpoint files trusted though no pointer entry vouches for them: every one on a local disk."""
        if not self._renamed_into_place:
            return []
        return [name for name in self._names() if checkpoint_step(name) is not None]

    def _call(self, what: str, operation: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<operation>(*args, **kwargs)`` with the deadline and retries of ``self.retry``."""
        fs = self.fs
        return self.retry.run(what, getattr(fs, operation), *args, **kwargs, **self.retry.options(fs))

    def _write(self, name: str, data: Data) -> int:
        """Write file ``name`` atomically (see ``write_atomically``); returns its size in bytes."""
        verb = "write" if self._renamed_into_place else "upload"
        # Only one process writes here, so a fixed temporary name is safe, and
        # it lets the next save recognise an interrupted write and delete it.
        return self.retry.run(f"{verb} {self.location(name)}", write_atomically, self._path(name), data,
                              fs=self.fs, temp_name=f"{name}.tmp", **self.retry.options(self.fs))

    def _names(self) -> list[str]:
        """Names of the files in the folder; [] before its first save."""
        try:
            entries = self._call(f"list {self.url}", "ls", self.root, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file"]

    def _size(self, name: str) -> int | None:
        """Size in bytes of file ``name``; None if absent."""
        try:
            info = self._call(f"stat {self.location(name)}", "info", self._path(name))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def _pointer(self) -> list[PointerEntry]:
        """Entries of the ``latest`` pointer, newest first; [] when there is none yet."""
        try:
            raw = self._call(f"read {self.location(LATEST)}", "cat_file", self._path(LATEST))
        except FileNotFoundError:
            return []
        return parse_pointer(raw)

    def _vouched(self) -> Iterator[PointerEntry]:
        """Pointer entries whose file exists with the listed size, newest first, each with its size."""
        for entry in self._pointer():
            size = self._size(entry.name)
            if size is not None and entry.bytes in (None, size):
                yield PointerEntry(entry.name, size)

    def _delete(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                self._call(f"delete {self.location(name)}", "rm_file", self._path(name))
            except FileNotFoundError:
                pass  # gone already
            except Exception as exc:  # noqa: BLE001 - the checkpoint is safe; the next save prunes again
                logger.warning("could not delete %s (the next save tries again): %s",
                               self.location(name), exc)

    # --- checkpoints ------------------------------------------------------------

    def save(self, update_step: int, state: Mapping[str, Any]) -> str:
        """Write ``state`` for ``update_step``, then the pointer, then prune; returns its location."""
        import torch

        check_plain(state, "state")
        name = checkpoint_name(update_step)
        # Read the old pointer first: if the store cannot be reached, nothing has changed yet.
        previous = list(self._vouched())
        size = self._write(name, lambda f: torch.save(dict(state), f))
        names = self._names()
        doomed = set(prunable(names, self.keep_last, protected={name}))
        kept = [PointerEntry(name, size)]
        kept += [e for e in previous if e.name != name and e.name not in doomed]
        # The pointer goes last: until it is written, `latest` names the previous checkpoint.
        self._write(LATEST, format_pointer(kept[: self.keep_last]))
        # Only this process writes here and its own writes have finished: a
        # .tmp left is an interrupted save that would otherwise fill the disk.
        self._delete(sorted(doomed) + [n for n in names if _LEFTOVER.match(n)])
        return self.location(name)

    def latest(self) -> str | None:
        """The newest checkpoint the pointer vouches for; else, on a local disk, the newest file."""
        vouched = next(self._vouched(), None)
        if vouched is not None:
            return self.location(vouched.name)
        complete = self._complete_without_pointer()
        return self.location(max(complete, key=checkpoint_step)) if complete else None

    def checkpoints(self) -> list[tuple[int, str]]:
        """Every complete checkpoint as (update step, location), oldest first (for ``octfw replay``)."""
        names = {entry.name for entry in self._vouched()} | set(self._complete_without_pointer())
        return sorted((step, self.location(n)) for n in names if (step := checkpoint_step(n)) is not None)

    def load(self, location: str) -> dict[str, Any]:
        """Read a checkpoint onto the CPU; UserError for a missing or refused file."""
        inside = self.location("")
        if location.startswith(inside):
            return _read_checkpoint(self.fs, self._path(location[len(inside):]), location, self.retry)
        # `--resume URL` of a checkpoint elsewhere: its own filesystem, the same retries.
        return load_checkpoint(location, self.retry)
