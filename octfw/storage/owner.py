"""One writer per folder: an OS lock held for a process's life, and a record of who holds it.

A run folder (and a prepared store) must have one writer: two trainers in one
run folder would write the same checkpoint names and log every step twice.
:class:`FolderOwner` takes ``fcntl.flock`` on ``<folder>/owner.lock`` and
writes ``owner.json`` (host, pid, start time, command) beside it:

- a second process is refused at once with one line naming the owner
  (:class:`FolderInUse`, a UserError: exit code 2);
- the kernel releases the lock when its process ends, however it ends
  (``kill -9`` included), so an owner that is gone never blocks anyone: the
  next process takes the folder over, with a warning naming the old owner;
- only the process that writes takes it: rank 0 under torchrun and on a TPU
  pod, where the other processes write nothing into the folder.

``flock`` holds on a local disk, and on NFS v4 where the kernel maps it to a
lease-backed lock; a shared folder on a filesystem without locks (some FUSE
mounts of buckets) is not protected, which docs/stability.md says.

An object store has no locks: :class:`ObjectLease` is their twin, an
``owner.lease`` object created only if absent (``ifGenerationMatch=0`` on
GCS, which answers 412 to the second creator) and renewed by a daemon thread
every third of its time to live. A lease that was not renewed in time (its
process or VM is gone) is taken over with a warning. The GCS emulator the
tests use ignores the precondition, so there the lease is checked by reading
it first; on GCS itself the create is atomic.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from octfw.errors import UserError

__all__ = ["FolderOwner", "ObjectLease", "FolderInUse", "is_owned", "LOCK_FILE", "OWNER_FILE", "LEASE_FILE"]

logger = logging.getLogger(__name__)

LOCK_FILE = "owner.lock"
OWNER_FILE = "owner.json"
LEASE_FILE = "owner.lease"


class FolderInUse(UserError):
    """Another live process owns the folder."""


def _describe(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "another process (no owner record)"
    return f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('started')}"


def _this_process() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)}


def _read_owner(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_owned(folder: Path) -> dict[str, Any] | None:
    """The owner record of ``folder`` while a live process holds it; None when nobody does."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_owner(folder) or {}
    finally:
        os.close(fd)
    return None


class FolderOwner:
    """Holds ``folder`` for this process until :meth:`release` (or the process ends).

    ``what`` names the folder in messages ("run folder", "prepared store").
    """

    def __init__(self, folder: Path, what: str = "folder"):
        self.folder, self.what = Path(folder), what
        self._fd: int | None = None

    def __enter__(self) -> "FolderOwner":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the folder, or raise :class:`FolderInUse` naming its live owner."""
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUse(f"{self.what} {self.folder} is in use by {_describe(_read_owner(self.folder))}; "
                              "one process writes it at a time (wait for it, or stop it first)") from None
        previous = _read_owner(self.folder)
        if previous is not None and previous.get("pid") != os.getpid():
            logger.warning("taking over %s %s from %s, which is no longer running", self.what, self.folder,
                           _describe(previous))
        (self.folder / OWNER_FILE).write_text(json.dumps(_this_process(), indent=1) + "\n", encoding="utf-8")
        self._fd = fd

    def release(self) -> None:
        """Give the folder up: the owner record goes first, so nobody reads a stale one as live."""
        if self._fd is None:
            return
        try:
            (self.folder / OWNER_FILE).unlink(missing_ok=True)
        except OSError:
            pass  # the lock below is what counts
        os.close(self._fd)  # releases the flock
        self._fd = None


class ObjectLease:
    """Holds a folder of an object store (fsspec ``fs``, ``path`` of the lease object) for
    this process, renewing the lease every ``ttl_s / 3`` seconds until :meth:`release`."""

    def __init__(self, fs: Any, path: str, location: str, what: str = "folder", ttl_s: float = 120.0,
                 options: dict[str, Any] | None = None):
        self.fs, self.path, self.location, self.what, self.ttl_s = fs, path, location, what, ttl_s
        self.options = options or {}  # e.g. fsspec's timeout: a store that went away costs a known time
        self._record = _this_process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(self.path, **self.options))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # damaged: nobody's, taken over below

    def _payload(self) -> bytes:
        return json.dumps({**self._record, "expires": time.time() + self.ttl_s}).encode("utf-8")

    def _refuse(self, owner: dict[str, Any] | None) -> FolderInUse:
        until = dt.datetime.fromtimestamp(float((owner or {}).get("expires", 0))).astimezone()
        return FolderInUse(f"{self.what} {self.location} is in use by {_describe(owner)} (its lease runs to "
                           f"{until.isoformat(timespec='seconds')} unless renewed); one process writes it at a time")

    def acquire(self) -> None:
        """Take the lease, or raise :class:`FolderInUse` naming its live holder."""
        current = self._read()
        if current is not None:
            if float(current.get("expires", 0)) > time.time():
                raise self._refuse(current)
            logger.warning("taking over %s %s from %s, whose lease expired", self.what, self.location,
                           _describe(current))
            self.fs.pipe_file(self.path, self._payload(), **self.options)
        else:
            try:  # atomic on GCS: a second creator gets 412, which gcsfs raises as FileExistsError
                self.fs.pipe_file(self.path, self._payload(), mode="create", **self.options)
            except FileExistsError:
                raise self._refuse(self._read()) from None
        self._thread = threading.Thread(target=self._renew, name="octfw-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.fs.pipe_file(self.path, self._payload(), **self.options)
            except Exception as exc:  # noqa: BLE001 - the next renewal tries again; saves report the store
                logger.debug("could not renew the lease %s: %s", self.location, exc)

    def release(self) -> None:
        """Stop renewing and delete the lease."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        try:
            self.fs.rm_file(self.path, **self.options)
        except Exception as exc:  # noqa: BLE001 - it expires on its own
            logger.debug("could not delete the lease %s: %s", self.location, exc)
