"""Checkpoints of one run in one folder: naming, the ``latest`` pointer, retention, safe loading.

Every checkpointer keeps its files through :class:`CheckpointStorage`, on a
local disk or any fsspec store, so what is complete, what ``latest`` means and
what ``keep_last`` deletes are decided here, once. Layout of the folder::

    step_00000120.pt         one checkpoint per save; names sort by update step
    step_00000120.pt.sha256  its SHA-256, in ``sha256sum`` format (``sha256sum -c`` checks it)
    step_00000120.pt.tmp     a local save in progress, or one that was interrupted
    latest                   the pointer, written after the checkpoint and its checksum

The pointer (format 1) lists the kept checkpoints, newest first, each with
its size in bytes::

    {"format": 1, "checkpoints": [{"name": "step_00000120.pt", "bytes": 10212539}, ...]}

**Integrity.** The checksum is computed while the checkpoint is written (no
second read) and checked before ``torch.load`` sees a byte: by ``latest()``
(a mismatch is skipped with a warning naming it, and the previous good
checkpoint is used) and by every load, of ``latest`` or of an explicit path
(:func:`load_checkpoint` reads the ``.sha256`` file beside it), which raise
:class:`CorruptCheckpoint`. A checkpoint written before octfw recorded
checksums has none; it is loaded with a warning saying it is unverified.

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

import hashlib
import io
import json
import logging
import os
import re
import threading
from typing import IO, Any, Iterable, Iterator, Mapping

import attrs

from octfw.display.errors import UserError
from octfw.storage.failures import format_bytes, free_bytes, storage_cause
from octfw.storage.files import Data, is_local_filesystem, open_filesystem, write_atomically
from octfw.storage.retry import RetryPolicy

__all__ = [
    "StoredCheckpointer",
    "LATEST", "POINTER_FORMAT", "PointerEntry", "CheckpointStorage", "CorruptCheckpoint", "checksum_name",
    "checkpoint_name", "checkpoint_step", "prunable", "parse_pointer", "format_pointer",
    "check_plain", "safe_load", "load_checkpoint",
]

logger = logging.getLogger(__name__)

#: Name of the pointer to the newest complete checkpoint, next to the checkpoints.
LATEST = "latest"
#: Version of the pointer's JSON layout.
POINTER_FORMAT = 1

_COMPLETE = re.compile(r"^step_(\d{8,})\.pt$")
# What an interrupted local write leaves: a checkpoint's, its checksum's or the pointer's temporary file.
_LEFTOVER = re.compile(r"^(step_\d{8,}\.pt(\.sha256)?|latest)\.tmp$")
_CHECKSUM = re.compile(r"^(step_\d{8,}\.pt)\.sha256$")


class CorruptCheckpoint(UserError):
    """A checkpoint whose bytes do not match the SHA-256 recorded when it was written."""


# --- names and retention ------------------------------------------------------


def checkpoint_name(update_step: int) -> str:
    """Name of the checkpoint taken at ``update_step``."""
    return f"step_{update_step:08d}.pt"


def checksum_name(name: str) -> str:
    """Name of the file holding the SHA-256 of checkpoint ``name``."""
    return f"{name}.sha256"


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


@attrs.frozen
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


def _reason(exc: Exception) -> str:
    """What a ``torch.load`` error says about this file, without torch's advice to retry with
    ``weights_only=False``: that would run whatever code the file holds."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # the refused object or opcode follows this marker
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    specific = [line.split(". Please use", 1)[0] for line in lines
                if "weights_only" not in line and not line.startswith(("Please file an issue", "Check the doc"))]
    return (specific or ["not a checkpoint octfw can read"])[0]


def sha256_of(source: str | bytes) -> str:
    """SHA-256 (hex) of a local file's bytes, or of ``source`` itself when it is bytes."""
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_checksum(raw: bytes) -> str | None:
    """The hex digest of a ``.sha256`` file (``sha256sum`` format); None when it holds none."""
    first = raw.decode("utf-8", "replace").strip().split(maxsplit=1)
    return first[0].lower() if first and re.fullmatch(r"[0-9a-fA-F]{64}", first[0]) else None


def verify(location: str, actual: str, expected: str | None) -> None:
    """Raise :class:`CorruptCheckpoint` unless ``actual`` is the recorded checksum; warn when a
    checkpoint (a ``step_N.pt``) has none. Other files (an exported encoder) may have none."""
    if expected is None and checkpoint_step(location.rsplit("/", 1)[-1]) is None:
        return
    if expected is None:
        logger.warning("checkpoint %s has no recorded SHA-256 (written before octfw recorded them): "
                       "loaded unverified", location)
    elif actual != expected:
        raise CorruptCheckpoint(f"checkpoint {location} is damaged: its SHA-256 is {actual[:12]}..., "
                                f"recorded {expected[:12]}... when it was written; it is not loaded")


class _HashingWriter:
    """A binary file that hashes what goes through it, so a checkpoint's SHA-256 costs no second read.

    ``cancelled`` (an Event) aborts the write at the next block: a second Ctrl-C
    stops a save without waiting for it, and the temporary file is removed.
    """

    def __init__(self, file: IO[bytes], cancelled: Any = None):
        self.file, self.digest, self.cancelled = file, hashlib.sha256(), cancelled

    def write(self, data: Any) -> int:
        if self.cancelled is not None and self.cancelled.is_set():
            raise InterruptedError("checkpoint save cancelled")
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def safe_load(source: str | IO[bytes], location: str, what: str = "checkpoint") -> dict[str, Any]:
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
            f"{what} {location} cannot be loaded safely ({type(exc).__name__}: {_reason(exc)}); "
            "octfw loads tensors and plain Python data only"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - re-raised with the checkpoint's name
        raise UserError(
            f"{what} {location} cannot be read ({type(exc).__name__}: {_reason(exc)}); "
            f"the file is cut short or not {_a(what)}"
        ) from exc
    if not isinstance(state, dict):
        raise UserError(f"{what} {location} holds a {type(state).__name__}, not a dict")
    return state


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "a checkpoint", "an encoder file"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _recorded_checksum(fs: Any, path: str, retry: RetryPolicy) -> str | None:
    """The SHA-256 recorded beside the checkpoint at ``path``; None when there is none."""
    try:
        raw = retry.run(f"read {path}.sha256", fs.cat_file, checksum_name(path), **retry.options(fs))
    except FileNotFoundError:
        return None
    return parse_checksum(raw)


def _read_checkpoint(fs: Any, path: str, location: str, retry: RetryPolicy,
                     data: bytes | None = None) -> dict[str, Any]:
    """Verify the checkpoint at ``path`` against its recorded SHA-256, then load it.
    ``data``: its bytes, when a remote object was downloaded (and verified) already."""
    expected = _recorded_checksum(fs, path, retry)
    if is_local_filesystem(fs):
        if not os.path.isfile(path):
            raise UserError(f"checkpoint {location} does not exist")
        verify(location, sha256_of(path), expected)
        return safe_load(path, location)  # torch reads the file itself: no second copy in memory
    if data is None:
        try:
            data = retry.run(f"download {location}", fs.cat_file, path, **retry.options(fs))
        except FileNotFoundError:
            raise UserError(f"checkpoint {location} does not exist") from None
    verify(location, sha256_of(data), expected)
    return safe_load(io.BytesIO(data), location)


def load_checkpoint(url: str, retry: RetryPolicy = RetryPolicy()) -> dict[str, Any]:
    """Read the checkpoint file at ``url`` (local path, ``file://`` or fsspec URL) onto the CPU.

    Checks it against the SHA-256 beside it first (:class:`CorruptCheckpoint`
    on a mismatch), then uses ``torch.load(weights_only=True)``; raises
    UserError for a missing file or one holding anything but tensors and
    plain Python data. Remote reads are tried as ``retry`` says.
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

    def save(self, update_step: int, state: Mapping[str, Any], cancelled: Any = None) -> str:
        """Write ``state`` for ``update_step``, its checksum, then the pointer, then prune;
        returns its location. ``cancelled``: an Event that aborts the write (a second Ctrl-C)."""
        import torch

        check_plain(state, "state")
        name = checkpoint_name(update_step)
        # Read the old pointer first: if the store cannot be reached, nothing has changed yet.
        previous = list(self._vouched())
        writers: list[_HashingWriter] = []  # one per attempt: a retried upload serialises again

        def serialise(file: IO[bytes]) -> None:
            writers.append(_HashingWriter(file, cancelled))
            torch.save(dict(state), writers[-1])

        size = self._write(name, serialise)
        self._write(checksum_name(name), f"{writers[-1].digest.hexdigest()}  {name}\n".encode("utf-8"))
        names = self._names()
        doomed = set(prunable(names, self.keep_last, protected={name}))
        kept = [PointerEntry(name, size)]
        kept += [e for e in previous if e.name != name and e.name not in doomed]
        # The pointer goes last: until it is written, `latest` names the previous checkpoint.
        self._write(LATEST, format_pointer(kept[: self.keep_last]))
        # Only this process writes here and its own writes have finished: a .tmp left is an
        # interrupted save, a checksum without its checkpoint a pruned one; both would pile up.
        doomed |= {checksum_name(n) for n in doomed}
        orphans = [n for n in names if _LEFTOVER.match(n) or ((m := _CHECKSUM.match(n)) and m.group(1) not in names)]
        self._delete(sorted(doomed & set(names)) + orphans)
        return self.location(name)

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
        if self._renamed_into_place:
            actual = sha256_of(path)
        else:
            self._downloaded = (name, self._call(f"download {self.location(name)}", "cat_file", path))
            actual = sha256_of(self._downloaded[1])
        expected = _recorded_checksum(self.fs, path, self.retry)
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
            downloaded, self._downloaded = self._downloaded, None  # latest() may have fetched it already
            data = downloaded[1] if downloaded and downloaded[0] == name else None
            return _read_checkpoint(self.fs, self._path(name), location, self.retry, data)
        # `--resume URL` of a checkpoint elsewhere: its own filesystem, the same retries.
        return load_checkpoint(location, self.retry)


# --- a checkpointer over one storage folder ------------------------------------------------


class StoredCheckpointer:
    """The :class:`~octfw.types.Checkpointer` of one :class:`CheckpointStorage` folder: the
    ``local`` and ``gcs`` checkpointers are this with their own config, and a new backend
    (any fsspec URL: ``s3://``, ``az://``, ``memory://``) is this and a ``build`` (see
    docs/architecture.md, "How to add a checkpoint backend").

    Saves on rank 0 only; every rank may ask for ``latest()`` and ``load()`` to resume.

    ``storage`` is None when there is no folder (``octfw check`` without a run
    folder): nothing is listed, and a save raises UserError.
    """

    def __init__(self, storage: CheckpointStorage | None, rank: int = 0):
        self.storage = storage
        self.rank = rank
        self._cancelled = threading.Event()

    @property
    def location(self) -> str | None:
        """The checkpoint folder (a path or URL), for messages; None when there is none."""
        return self.storage.url if self.storage is not None else None

    def save(self, update_step: int, state: Mapping[str, Any]) -> str:
        """Write ``state`` for ``update_step`` and return its location; "" on ranks other than 0."""
        if self.rank != 0:
            return ""
        if self.storage is None:
            raise UserError("checkpointer: no folder to save into (no run folder and no checkpointer.dir)")
        return self.storage.save(update_step, state, cancelled=self._cancelled)

    def cancel(self) -> None:
        """Abort the save being written, and any later one (a second Ctrl-C: stop now). Its
        temporary file is removed; the pointer still names the last complete checkpoint."""
        self._cancelled.set()

    def claim(self, needed_bytes: int) -> None:
        """Before training (rank 0): hold the folder for this run and check that it can take a
        checkpoint of ``needed_bytes``; UserError naming the owner or the cause otherwise."""
        if self.rank == 0 and self.storage is not None:
            self.storage.claim(needed_bytes)

    def release(self) -> None:
        """Give the folder up at the end of the run."""
        if self.storage is not None:
            self.storage.release()

    def latest(self) -> str | None:
        """The newest complete checkpoint (see ``CheckpointStorage.latest``); None if there is none."""
        return self.storage.latest() if self.storage is not None else None

    def checkpoints(self) -> list[tuple[int, str]]:
        """Every complete checkpoint as (update step, location), oldest first (for ``octfw replay``)."""
        return self.storage.checkpoints() if self.storage is not None else []

    def load(self, location: str) -> dict[str, Any]:
        """Read a checkpoint onto the CPU; raises UserError for a missing or refused file."""
        if self.storage is not None:
            return self.storage.load(location)
        return load_checkpoint(location)
