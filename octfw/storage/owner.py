"""One writer per folder: a lock held for a process's life, with a record of who holds it.

A run folder, a checkpoint folder and a prepared store each have one writer:
two trainers in one run folder would write the same checkpoint names and log
every step twice; two prepares into one store would race on its header.
:class:`FolderOwner` holds a folder (a local path or an object-store prefix)
through a lock file in it whose content is the owner record (host, pid, start
time, command, and a random token):

- **A local folder:** ``fcntl.flock`` on the lock file. The kernel releases
  it when its process ends, however it ends (``kill -9`` included), so an
  owner that is gone never blocks anyone: the next process takes the folder
  over, with a warning naming the old owner (its record is still in the
  file; a clean release empties it). ``flock`` holds on a local disk and on
  NFS v4; a filesystem without locks (some FUSE mounts of buckets) is not
  protected.
- **An object store** (no locks there): the lock file is a lease object,
  created only if absent (``ifGenerationMatch=0`` on GCS, which answers 412
  to a second creator), read back to check the token (stores that ignore the
  precondition, the GCS emulator among them), and renewed by a daemon thread
  every quarter of ``lease_s``. An owner whose lease was not renewed in time
  (its VM is gone), or whose pid is gone on this host, is taken over with a
  warning. A renewal never writes over a lease another process took.

A second process is refused at once with one line naming the owner
(:class:`FolderInUse`, a UserError: exit code 2). Only the process that
writes takes the lock: rank 0 under torchrun and on a TPU pod.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from octfw.display.errors import UserError
from octfw.storage.failures import storage_cause
from octfw.storage.files import is_local_filesystem, open_filesystem, write_atomically

__all__ = ["FolderOwner", "FolderInUse", "is_owned", "describe_owner", "LOCK_FILE"]

logger = logging.getLogger(__name__)

#: The lock file of a run folder or checkpoint folder.
LOCK_FILE = "owner.lock"


class FolderInUse(UserError):
    """Another live process owns the folder."""


def describe_owner(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "another process (owner not recorded yet)"
    return f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('started')}"


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        owner = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return owner if isinstance(owner, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def is_owned(folder: str | os.PathLike[str], lock_name: str = LOCK_FILE) -> dict[str, Any] | None:
    """The owner record of a local ``folder`` while a live process holds it; None when nobody does."""
    import fcntl

    try:
        fd = os.open(os.path.join(folder, lock_name), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _parse(os.pread(fd, 1 << 16, 0)) or {}
    finally:
        os.close(fd)
    return None


class FolderOwner:
    """Holds ``folder`` for this process from :meth:`acquire` to :meth:`release`.

    ``folder``: a local path or fsspec URL, or a path inside ``fs`` when
    given. ``what`` names it in messages ("run folder", "--out"); ``options``
    go to every object-store call (fsspec's ``timeout``).
    """

    def __init__(self, folder: str | os.PathLike[str], what: str = "folder", *, fs: Any = None,
                 lock_name: str = LOCK_FILE, lease_s: float = 120.0, options: dict[str, Any] | None = None):
        self.location = os.fspath(folder)
        self.fs, root = (fs, self.location) if fs is not None else open_filesystem(self.location)
        self.path = f"{root.rstrip('/')}/{lock_name}"
        self.what, self.lease_s, self.options = what, lease_s, options or {}
        self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                       "command": " ".join(sys.argv), "token": uuid.uuid4().hex}
        self._fd: int | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> "FolderOwner":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refuse(self, owner: dict[str, Any] | None) -> FolderInUse:
        return FolderInUse(f"{self.what} {self.location} is in use by {describe_owner(owner)}; one process "
                           "writes it at a time (wait for it to finish or stop it, then run again)")

    def _took_over(self, owner: dict[str, Any], why: str) -> None:
        logger.warning("taking over %s %s from %s, which %s", self.what, self.location, describe_owner(owner), why)

    def acquire(self) -> None:
        """Take the folder, or raise :class:`FolderInUse` naming its live owner (a UserError
        naming the cause when the lock cannot be written at all)."""
        try:
            if is_local_filesystem(self.fs):
                self._lock_local()
            else:
                self._lock_remote()
        except OSError as exc:
            cause = storage_cause(exc, self.location) or f"{type(exc).__name__}: {exc}"
            raise UserError(f"{self.what} {self.location}: cannot write its lock: {cause}") from None

    def release(self) -> None:
        """Give the folder up."""
        if self._fd is not None:
            import fcntl

            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # kept, empty: removing a lock file races with its next user
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join()
            self._renewer = None
            with contextlib.suppress(Exception):  # unreachable store: the lease expires on its own
                if (self._read_remote() or {}).get("token") == self.record["token"]:
                    self.fs.rm_file(self.path, **self.options)

    # --- a local folder --------------------------------------------------------------

    def _lock_local(self) -> None:
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _parse(os.pread(fd, 1 << 16, 0))
            os.close(fd)
            raise self._refuse(owner) from None
        previous = _parse(os.pread(fd, 1 << 16, 0))
        if previous:  # a holder empties the file when it releases it: this one never did
            self._took_over(previous, "is no longer running")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.record).encode("utf-8"), 0)
        self._fd = fd

    # --- an object store -------------------------------------------------------------

    def _read_remote(self) -> dict[str, Any] | None:
        try:
            return _parse(self.fs.cat_file(self.path, **self.options))
        except FileNotFoundError:
            return None

    def _write_remote(self, create: bool) -> None:
        record = {**self.record, "expires": time.time() + self.lease_s}
        # ifGenerationMatch=0 on GCS: the upload fails if the object exists.
        mode = {"mode": "create"} if create and "gs" in getattr(self.fs, "protocol", ()) else {}
        write_atomically(self.path, json.dumps(record).encode("utf-8"), fs=self.fs, **mode, **self.options)

    def _lock_remote(self) -> None:
        owner = self._read_remote()
        if owner is not None:
            if owner.get("host") == self.record["host"] and not _pid_alive(int(owner.get("pid", 0))):
                self._took_over(owner, "is no longer running")
            elif float(owner.get("expires", 0)) < time.time():
                self._took_over(owner, f"has not renewed its lease for {self.lease_s:.0f} s")
            else:
                raise self._refuse(owner)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path, **self.options)
        try:
            self._write_remote(create=True)
        except FileExistsError:
            raise self._refuse(self._read_remote()) from None
        mine = self._read_remote()
        if (mine or {}).get("token") != self.record["token"]:
            raise self._refuse(mine)  # another process wrote its record between ours and the read
        self._renewer = threading.Thread(target=self._renew, name="octfw-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                holder = self._read_remote()
                if (holder or {}).get("token") != self.record["token"]:
                    # Taken over after a lease this process failed to renew: never write over it.
                    logger.warning("%s %s was taken over by %s; this process no longer holds it",
                                   self.what, self.location, describe_owner(holder))
                    return
                self._write_remote(create=False)
            except Exception as exc:  # noqa: BLE001 - the store is away: the next renewal may succeed
                logger.debug("renewing %s failed: %s", self.path, exc)
