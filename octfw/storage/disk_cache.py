"""A byte-bounded, least-recently-used cache of files in a local folder.

:class:`DiskCache` keeps one file per key, ``<folder>/<key[:2]>/<key>``, and
is safe for several processes (data-loader workers, several runs) using one
folder at once:

- a reader sees a whole entry or none: an entry is written to a temporary
  file (``.tmp-*``) in its subfolder and renamed into place;
- "recently used" is a file's modification time, set on every write and hit
  (not its access time, which ``noatime`` and ``relatime`` mounts do not
  keep); eviction removes the oldest entries first;
- the entries' byte count is shared, in ``<folder>/.usage``, read and
  updated under an exclusive ``flock`` by every bounded ``put``; the rename
  into place happens under that lock, after eviction made room. So a put far
  below the bound costs one small locked read and write, never a scan; the
  folder is scanned only when ``.usage`` is missing or damaged or the count
  would cross the bound. A count kept per process would not do: N data-loader
  workers filling an empty cache would each see only their own writes and
  store N times the bound before any of them evicted.

The guarantee: entries are renamed into place only under the lock, after
eviction made room, so at every moment the entries' total size (file
sizes, as :meth:`DiskCache.total_bytes` counts them) is at most
``max_bytes``, as long as every writer of the folder is a DiskCache with
that bound and nothing else changes the folder. Beyond it:

- while writes are in flight, their temporary files take up to one entry per
  concurrent writer (process or thread) more;
- a writer killed between its rename and its count update (a window of one
  small write), or files added by hand, leave the count short: the total can
  then exceed the bound by that much until the next scan recounts the folder
  (at the latest when the count crosses the bound). Files removed by hand
  only make the next scan come sooner;
- a temporary file left by a killed writer is removed by a scan once it is
  an hour old;
- an unbounded DiskCache (``max_bytes=None``) neither counts nor evicts, and
  a writer with a larger bound evicts only down to its own.

A disk that cannot be written (full, read-only) costs speed, never the run:
``put`` warns once per DiskCache and carries on without storing. The folder
must be local: ``flock`` and atomic rename are what the guarantee rests on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import logging
import uuid
from pathlib import Path

__all__ = ["DiskCache"]

#: The shared byte count of the entries, in the folder itself.
USAGE_FILE = ".usage"

#: Prefix of temporary files; keys may not start with "." so none is an entry.
TEMP_PREFIX = ".tmp-"

#: A temporary file this old was left by a killed writer (a write takes seconds).
STALE_TEMP_NS = 3600 * 10**9


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class DiskCache:
    """Files by key in ``folder``, at most ``max_bytes`` of them (None: unbounded, 0: off)."""

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int | None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes!r}")
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self._warned = False

    def __repr__(self) -> str:
        return f"DiskCache({str(self.folder)!r}, max_bytes={self.max_bytes!r})"

    def path(self, key: str) -> Path:
        """Where the entry of ``key`` lives (it may not exist)."""
        if not key or key.startswith(".") or "/" in key or os.sep in key or "\0" in key:
            raise ValueError(f"a cache key must be a file name not starting with '.', got {key!r}")
        # Two-character subfolders keep directories small for large cohorts.
        return self.folder / key[:2] / key

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or None; a hit marks the entry as recently used."""
        if self.max_bytes == 0:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:  # absent, evicted meanwhile, or unreadable: a miss either way
            return None
        with contextlib.suppress(OSError):  # evicted since the read, or not ours to touch: still a hit
            now = time.time_ns()
            os.utime(path, ns=(now, now))
        return data

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` atomically, evicting least-recently-used entries to stay
        within ``max_bytes``. An entry larger than ``max_bytes`` is not stored."""
        if self.max_bytes == 0 or (self.max_bytes is not None and len(data) > self.max_bytes):
            return
        path = self.path(key)
        # A unique name: several writers may store the same key at once, each into its own file.
        temp = path.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                # Written outside the lock, so concurrent writers do not wait on each other's disk.
                with open(temp, "xb") as f:
                    f.write(data)
                # Not fsynced: an entry lost in a crash is only a miss. Timestamped here, with the
                # clock hits use, so it is the newest entry (the kernel's file clock is coarser).
                now = time.time_ns()
                os.utime(temp, ns=(now, now))
                if self.max_bytes is None:
                    os.replace(temp, path)
                else:
                    self._replace_within_bound(temp, path, len(data))
            finally:
                # Still there only when something failed; one that cannot be removed now is
                # removed by a later scan once stale.
                with contextlib.suppress(OSError):
                    os.unlink(temp)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                logging.getLogger(__name__).warning(
                    "cannot write to the cache in %s (%s); going on without caching",
                    self.folder, exc.strerror or type(exc).__name__)

    def total_bytes(self) -> int:
        """Total size of the entries, counted by a scan of the folder (temporary files excluded)."""
        return sum(size for _used, size, _path in self._scan())

    def _replace_within_bound(self, temp: Path, path: Path, size: int) -> None:
        """Under the folder's lock: evict until ``size`` more bytes fit, rename, update the count."""
        assert self.max_bytes is not None
        fd = os.open(self.folder / USAGE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        with os.fdopen(fd, "r+b") as usage:
            # Opened per put: an flock belongs to the open file, which a forked worker would share.
            fcntl.flock(usage, fcntl.LOCK_EX)  # released when the file closes
            text = usage.read()
            total = int(text) if text.isdigit() else None  # None: new or damaged, count by a scan
            old = _size(path)  # an entry being replaced frees its bytes
            if total is None or total - old + size > self.max_bytes:
                total = self._evict(self.max_bytes - size)
                old = _size(path)
            os.replace(temp, path)
            usage.seek(0)
            usage.write(str(total - old + size).encode("ascii"))
            usage.truncate()

    def _evict(self, limit: int) -> int:
        """Remove the least recently used entries until they total at most ``limit``; the total."""
        entries = sorted(self._scan())
        total = sum(size for _used, size, _path in entries)
        for _used, size, path in entries:
            if total <= limit:
                break
            with contextlib.suppress(FileNotFoundError):  # removed by hand meanwhile
                path.unlink()
            total -= size
        return total

    def _scan(self) -> list[tuple[int, int, Path]]:
        """(last used ns, size, path) of every entry; removes stale temporary files on the way.

        Files may vanish under a scan (another process renames or evicts them): skipped.
        """
        entries = []
        now = time.time_ns()
        for sub in _listing(self.folder):
            if not sub.is_dir(follow_symlinks=False):
                continue  # the .usage file
            for file in _listing(sub.path):
                try:
                    stat = file.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not file.is_file(follow_symlinks=False):
                    continue
                if not file.name.startswith("."):
                    entries.append((stat.st_mtime_ns, stat.st_size, Path(file.path)))
                elif file.name.startswith(TEMP_PREFIX) and now - stat.st_mtime_ns > STALE_TEMP_NS:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(file.path)
        return entries


def _listing(folder: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    """The entries of ``folder``; none when it does not exist (yet, or any more)."""
    try:
        with os.scandir(folder) as listing:
            return list(listing)
    except FileNotFoundError:
        return []
