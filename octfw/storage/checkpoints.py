"""Checkpoints of one run in one folder (``CheckpointStorage``), and the checkpointer over one (``StoredCheckpointer``).

Every checkpointer keeps its files through :class:`CheckpointStorage`, on a
local disk or any fsspec store, so what is complete, what ``latest`` means and
what ``keep_last`` deletes are decided here, once. The folder's file names
and the pointer's format are :mod:`octfw.storage.checkpoint_names`'; what a
checkpoint may hold, its SHA-256 check and reading one are
:mod:`octfw.storage.checkpoint_reading`'s.

``latest()`` returns the first entry whose file exists with exactly that
size, so it never names a checkpoint whose write was cut short, and falls back
to an older entry when the newest is missing or truncated (or damaged: its
SHA-256 does not match, and a warning names it).

A save writes the checkpoint, then the pointer, then deletes what
``keep_last`` lets go and any ``.tmp`` leftovers. On a local disk a write goes
to ``<name>.tmp`` and is renamed into place, so a ``step_*.pt`` there is
always complete and, when no pointer entry holds, the newest one is used. An
object store is written in place, and other fsspec stores may show an object
while it is still written: there an object no pointer lists (a save that died
before its pointer) is never trusted, and the next saves prune it.

A sharded checkpoint (``step_N.dcp``, :mod:`octfw.storage.sharded_checkpoints`) is a folder
every process writes into at once; the same rules hold for it, its index (written last)
standing for the file: the pointer names it only once whole, and a damaged or missing file
in it sends ``latest()`` to the previous checkpoint.

Light at import time (stdlib only): torch and fsspec load inside the functions.
"""

from __future__ import annotations

import logging
import os
from typing import IO, Any, Callable, Iterable, Iterator, Mapping

from octfw.display.errors import UserError
from octfw.storage.checkpoint_names import (
    LATEST, PointerEntry, checkpoint_name, checkpoint_step, checksum_name, checksummed_checkpoint,
    format_pointer, is_leftover, is_sharded_checkpoint, parse_pointer, prunable,
)
from octfw.storage.checkpoint_reading import (
    check_plain, read_checkpoint, recorded_checksum, sha256_of,
)
from octfw.storage.failures import format_bytes, free_bytes, storage_cause
from octfw.storage.files import Data, HashingWriter, is_local_filesystem, open_filesystem, write_atomically
from octfw.storage.retry import RetryPolicy
from octfw.storage.sharded_checkpoints import (
    METADATA, damage, is_written, read_into, read_sharded, write_sharded,
)

__all__ = ["CheckpointStorage", "load_checkpoint"]

logger = logging.getLogger(__name__)


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
        self._downloaded: tuple[str, bytes] | None = None  # the remote checkpoint latest() verified
        self._owner: Any = None  # the FolderOwner while a run writes here (claim)

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
        return [name for name in self._names() if checkpoint_step(name) is not None and (
            not is_sharded_checkpoint(name) or is_written(self.fs, self._path(name)))]

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
        # Files, and the folders of sharded checkpoints (an object store lists them as "directory").
        return [name for e in entries if (name := str(e["name"]).rstrip("/").rsplit("/", 1)[-1]) and (
            e.get("type") == "file" or (e.get("type") == "directory" and is_sharded_checkpoint(name)))]

    def _size(self, name: str) -> int | None:
        """Size in bytes of file ``name`` (of every file in a sharded checkpoint's folder, once
        its index is written); None if absent."""
        if is_sharded_checkpoint(name):
            path = self._path(name)
            if not self._call(f"stat {self.location(name)}", "exists", f"{path}/{METADATA}"):
                return None
            return int(self._call(f"stat {self.location(name)}", "du", path, total=True))
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

    def _delete_file(self, name: str) -> None:
        try:
            self._call(f"delete {self.location(name)}", "rm_file", self._path(name))
        except FileNotFoundError:
            pass

    def _delete(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                if is_sharded_checkpoint(name):
                    self._call(f"delete {self.location(name)}", "rm", self._path(name), recursive=True)
                else:
                    self._call(f"delete {self.location(name)}", "rm_file", self._path(name))
            except FileNotFoundError:
                pass  # gone already
            except Exception as exc:  # noqa: BLE001 - the checkpoint is safe; the next save prunes again
                logger.warning("could not delete %s (the next save tries again): %s",
                               self.location(name), exc)

    # --- checkpoints ------------------------------------------------------------

    def save(self, update_step: int, state: Mapping[str, Any], cancelled: Any = None) -> str:
        """Write ``state`` for ``update_step``, its checksum, then the pointer, then prune;
        returns its location. ``cancelled``: an Event that aborts the write (a second Ctrl-C)."""
        import torch

        check_plain(state, "state")
        name = checkpoint_name(update_step)
        # Read the old pointer first: if the store cannot be reached, nothing has changed yet.
        previous = list(self._vouched())
        writers: list[HashingWriter] = []  # one per attempt: a retried upload serialises again

        def serialise(file: IO[bytes]) -> None:
            writers.append(HashingWriter(file, cancelled))
            torch.save(dict(state), writers[-1])

        size = self._write(name, serialise)
        self._write(checksum_name(name), f"{writers[-1].digest.hexdigest()}  {name}\n".encode("utf-8"))
        self._commit(name, size, previous)
        return self.location(name)

    def save_sharded(self, update_step: int, shards: Mapping[str, Any], plain: Mapping[str, Any] | None,
                     group: Any = None) -> str:
        """A sharded checkpoint for ``update_step``, written by every process of ``group`` at once:
        this process's slices of ``shards``, and ``plain`` from rank 0 (the one that passes it),
        which then writes the pointer and prunes, as :meth:`save` does. Returns its location."""
        name = checkpoint_name(update_step, sharded=True)
        main = plain is not None
        if main:
            check_plain(plain, "state")
            previous = list(self._vouched())
            # A folder of an earlier attempt at this step is written over: without its index
            # until this save writes one, it is never taken for a checkpoint meanwhile. (Only
            # the index: the other processes may be making the folder already.)
            self._delete_file(f"{name}/{METADATA}")
        write_sharded(self.fs, self._path(name), shards, plain, group)  # returns once every process wrote
        if main:
            self._commit(name, self._size(name), previous)
        return self.location(name)

    def _commit(self, name: str, size: int | None, previous: list[PointerEntry]) -> None:
        """After checkpoint ``name`` is written: the pointer, then what ``keep_last`` lets go and
        what interrupted saves left."""
        names = self._names()
        doomed = set(prunable(names, self.keep_last, protected={name}))
        kept = [PointerEntry(name, size)]
        kept += [e for e in previous if e.name != name and e.name not in doomed]
        # The pointer goes last: until it is written, `latest` names the previous checkpoint.
        self._write(LATEST, format_pointer(kept[: self.keep_last]))
        # Only this process writes here and its own writes have finished: a .tmp left is an
        # interrupted save, a checksum without its checkpoint a pruned one, a sharded folder
        # without its index an interrupted sharded save; all would pile up.
        doomed |= {checksum_name(n) for n in doomed}
        orphans = [n for n in names if n != name and (
            is_leftover(n) or ((c := checksummed_checkpoint(n)) and c not in names)
            or (is_sharded_checkpoint(n) and not is_written(self.fs, self._path(n))))]
        self._delete(sorted(doomed & set(names)) + orphans)

    def load_sharded(self, location: str, shards: dict[str, Any],
                     check: Callable[[dict[str, Any]], None] = lambda plain: None,
                     optional: tuple[str, ...] = ()) -> dict[str, Any]:
        """Fill ``shards`` (a sharded run's own slices) in place from the sharded checkpoint at
        ``location``, in this folder or any URL; returns the whole state (see
        :func:`octfw.storage.sharded_checkpoints.read_into`). Every process calls it."""
        inside = self.location("")
        if location.startswith(inside):
            fs, path = self.fs, self._path(location[len(inside):].rstrip("/"))
        else:
            fs, path = open_filesystem(location, fresh=True)
        return read_into(fs, path.rstrip("/"), location, shards, check, optional)

    def remove(self) -> None:
        """Delete the folder and every checkpoint in it (a fallback copy, once it was uploaded)."""
        try:
            self._call(f"delete {self.url}", "rm", self.root, recursive=True)
        except FileNotFoundError:
            pass

    def claim(self, needed_bytes: int) -> None:
        """Before training: take the folder for this process (one writer: an OS lock on a local
        disk, a lease object on a store; :mod:`octfw.storage.owner`) and refuse one that cannot
        take a checkpoint of ``needed_bytes`` (a probe file written and deleted; room on a local
        disk). UserError naming the owner or the cause (no space, permission denied, unreachable)."""
        from octfw.storage.owner import FolderOwner
        from octfw.storage.reach import require_reachable

        where = self.setting or "checkpoint folder"
        require_reachable(self.url, where)  # seconds, not gcsfs's minute of retries per attempt
        probe = f".octfw-write-probe-{os.getpid()}"
        try:
            self._write(probe, b"octfw checks that it can write here\n")
            self._delete([probe])
        except Exception as exc:  # noqa: BLE001 - named below, or shown as it is
            cause = storage_cause(exc, self.url, needed_bytes) or f"{type(exc).__name__}: {exc}"
            raise UserError(f"{where}: cannot write checkpoints: {cause}") from None
        if self._renamed_into_place:
            free = free_bytes(self._root)
            if free is not None and free < needed_bytes:
                raise UserError(f"{where}: no space left on device at {self.url} "
                                f"({format_bytes(free)} free, a checkpoint needs {format_bytes(needed_bytes)})")
        owner = FolderOwner(self.url, "checkpoint folder", options=self.retry.options(self.fs))
        owner.acquire()
        self._owner = owner

    def release(self) -> None:
        """Give the folder up (the end of the run)."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.release()

    def _intact(self, name: str) -> bool:
        """Whether checkpoint ``name`` matches its recorded SHA-256 (True when none was recorded);
        a mismatch is warned about, naming the file."""
        path = self._path(name)
        if is_sharded_checkpoint(name):
            why = damage(self.fs, path, self.location(name))
            if why is not None:
                logger.warning("checkpoint %s is damaged (%s): skipped, the previous complete checkpoint is used",
                               self.location(name), why)
            return why is None
        if self._renamed_into_place:
            actual = sha256_of(path)
        else:
            self._downloaded = (name, self._call(f"download {self.location(name)}", "cat_file", path))
            actual = sha256_of(self._downloaded[1])
        expected = recorded_checksum(self.fs, path, self.retry)
        if expected is None or actual == expected:
            return True
        logger.warning("checkpoint %s is damaged (its SHA-256 does not match the one recorded when it "
                       "was written): skipped, the previous complete checkpoint is used", self.location(name))
        return False

    def latest(self) -> str | None:
        """The newest checkpoint the pointer vouches for (else, on a local disk, the newest
        file) whose bytes match its recorded SHA-256; damaged ones are skipped with a warning."""
        vouched = [entry.name for entry in self._vouched()]
        unlisted = sorted(set(self._complete_without_pointer()) - set(vouched), key=checkpoint_step, reverse=True)
        # Without a good pointer entry, every complete local file is a candidate, newest first.
        for name in vouched + unlisted:
            if self._intact(name):
                return self.location(name)
        return None

    def checkpoints(self) -> list[tuple[int, str]]:
        """Every complete checkpoint as (update step, location), oldest first (for ``octfw replay``)."""
        names = {entry.name for entry in self._vouched()} | set(self._complete_without_pointer())
        return sorted((step, self.location(n)) for n in names if (step := checkpoint_step(n)) is not None)

    def load(self, location: str) -> dict[str, Any]:
        """Read a checkpoint onto the CPU; UserError for a missing or refused file."""
        inside = self.location("")
        if location.startswith(inside):
            name = location[len(inside):]
            if is_sharded_checkpoint(name):
                return read_sharded(self.fs, self._path(name.rstrip("/")), location)
            downloaded, self._downloaded = self._downloaded, None  # latest() may have fetched it already
            data = downloaded[1] if downloaded and downloaded[0] == name else None
            return read_checkpoint(self.fs, self._path(name), location, self.retry, data)
        # `--resume URL` of a checkpoint elsewhere: its own filesystem, the same retries.
        return load_checkpoint(location, self.retry)


def load_checkpoint(url: str, retry: RetryPolicy = RetryPolicy()) -> dict[str, Any]:
    """Read the checkpoint file at ``url`` (local path, ``file://`` or fsspec URL) onto the CPU;
    the folder of a sharded checkpoint is read whole (:mod:`octfw.storage.sharded_checkpoints`).

    Checks it against the SHA-256 beside it first (:class:`CorruptCheckpoint`
    on a mismatch), then uses ``torch.load(weights_only=True)``; raises
    UserError for a missing file or one holding anything but tensors and
    plain Python data. Remote reads are tried as ``retry`` says.
    """
    fs, path = open_filesystem(url, fresh=True)
    if is_sharded_checkpoint(path):  # the folder of a sharded save: every process's slices, read whole
        if not fs.exists(path):
            raise UserError(f"checkpoint {url} does not exist")
        return read_sharded(fs, path.rstrip("/"), url)
    return read_checkpoint(fs, path, url, retry)
