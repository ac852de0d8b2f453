"""Local paths and fsspec URLs, and the one way octfw replaces a file.

- :func:`is_local` / :func:`local_path`: a plain path or a ``file://`` URL
  names a local file; ``local_path`` is its path on this machine (both are
  :class:`~octfw.recipe.fields.Location`'s rules, which config fields hold, so
  there is one place that strips ``file://``);
- :func:`open_filesystem`: (fsspec filesystem, path inside it) for any of
  them, through ``fsspec.core.url_to_fs``, with a UserError naming the extra
  to install when a ``gs://`` URL has no gcsfs;
- :func:`write_atomically`: replace a file so that a reader sees the old
  bytes or the new ones, never part of them;
- :func:`require_writable_folder`: a local folder made and proven writable,
  else one UserError naming the setting it came from;
- :class:`HashingWriter`: a file being written that hashes what goes through it.

fsspec is imported inside the functions: importing octfw (``octfw list``)
must load neither fsspec nor gcsfs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import uuid
from typing import IO, Any, Callable, Union

from octfw.display.errors import UserError
from octfw.recipe.fields import Location

__all__ = [
    "GCS_PROTOCOLS", "Data", "is_local", "local_path", "is_local_filesystem", "require_driver",
    "open_filesystem", "write_atomically", "require_writable_folder",
]

#: URL schemes of Google Cloud Storage (gcsfs).
GCS_PROTOCOLS = ("gs", "gcs")

#: What :func:`write_atomically` writes: the bytes, or a function that writes
#: them into a binary file (so a large ``torch.save`` streams to disk instead
#: of being held in memory twice).
Data = Union[bytes, Callable[[IO[bytes]], object]]


def is_local(url: str | os.PathLike[str]) -> bool:
    """Whether ``url`` is a local path or a ``file://`` URL."""
    return not Location(os.fspath(url)).is_remote


def local_path(url: str | os.PathLike[str]) -> str:
    """The path on this machine of a local path or ``file://`` URL; ValueError for a remote URL."""
    location = Location(os.fspath(url))
    if location.is_remote:
        raise ValueError(f"{str(location)!r} is not a local path or file:// URL")
    return location.local_path


def is_local_filesystem(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's local filesystem (files on this machine, with atomic rename)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _named(url: str, setting: str | None) -> str:
    return f"{setting} = {url!r}" if setting else repr(url)


def require_driver(url: str, setting: str | None = None) -> None:
    """UserError naming the ``gcs`` extra when ``url`` is on GCS and gcsfs is not installed.

    ``setting`` is the config key the URL came from, for the message. Cheap
    (no connection), so a component can call it when it is built rather than
    fail at its first write.
    """
    if "://" in url and url.split("://", 1)[0] in GCS_PROTOCOLS:
        try:
            import gcsfs  # noqa: F401 - only to learn whether it is installed
        except ImportError:
            raise UserError(f"{_named(url, setting)} needs gcsfs: pip install 'octfw[gcs]'") from None


def open_filesystem(url: str | os.PathLike[str], *, fresh: bool = False,
                    setting: str | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for a local path, ``file://`` URL or fsspec URL.

    ``fresh=True`` makes a new client instead of reusing fsspec's cached one:
    a cached client keeps the endpoint and credentials it was made with, which
    must not leak from one run (or test) into the next. A missing driver or
    an unknown protocol raises UserError, naming ``setting`` when given.
    """
    import fsspec

    text = os.fspath(url)
    require_driver(text, setting)
    try:
        return fsspec.core.url_to_fs(text, skip_instance_cache=fresh)
    except (ImportError, ValueError) as exc:  # a driver fsspec names, or an unknown protocol
        raise UserError(f"{_named(text, setting)}: {exc}") from None


def require_writable_folder(folder: str | os.PathLike[str], setting: str, hint: str = "") -> None:
    """Create the local ``folder`` if needed and write and remove a file in it.

    A UserError naming ``setting`` (how the user chose the folder, e.g.
    ``run.cache_dir = '/x'``), the system's reason and ``hint`` when either
    fails: a path under a regular file, a read-only mount, a full disk. A
    permission check (``os.access``) would not do: it says yes to root on a
    read-only mount.
    """
    path = os.fspath(folder)
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, f".tmp-probe-{uuid.uuid4().hex[:12]}"), "xb") as probe:
            probe.write(b"octfw")
        os.unlink(probe.name)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"{setting}: cannot write there ({reason}){hint}") from None


class HashingWriter:
    """A binary file being written that hashes what goes through it, so its SHA-256 costs no
    second read (a checkpoint's, each slice file of a sharded one).

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

    def __getattr__(self, name: str) -> Any:  # flush, tell, fileno: the file's own
        return getattr(self.file, name)


def _as_bytes(data: Data) -> bytes:
    if not callable(data):
        return bytes(data)
    buffer = io.BytesIO()
    data(buffer)
    return buffer.getvalue()


def _fsync_folder(folder: str) -> None:
    # A rename is durable only once the folder's entry for it is on disk.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_local_file(path: str, data: Data, temp_name: str | None, durable: bool) -> int:
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    # A unique name unless the caller gives one: several data-loader workers
    # (or runs) may write the same cache entry at once, each into its own file.
    temp = os.path.join(folder, temp_name or f".tmp-{uuid.uuid4().hex[:12]}-{os.path.basename(path)}")
    try:
        with open(temp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            size = os.fstat(f.fileno()).st_size
            if durable:
                os.fsync(f.fileno())
        os.replace(temp, path)  # atomic within one filesystem
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    if durable:
        _fsync_folder(folder)
    return size


def _put_object(fs: Any, path: str, data: Data, options: dict[str, Any]) -> int:
    payload = _as_bytes(data)
    if not getattr(fs, "async_impl", False):
        # Filesystems with real folders (memory, sftp, hdfs) need the parent;
        # object stores (gcsfs, s3fs: async) have none.
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, payload, **options)
    return len(payload)


def write_atomically(target: str | os.PathLike[str], data: Data, *, fs: Any = None,
                     temp_name: str | None = None, durable: bool = True, **options: Any) -> int:
    """Replace the file ``target`` with ``data``; returns the number of bytes written.

    ``target`` is a local path or URL, or, when ``fs`` is given, a path inside
    that fsspec filesystem.

    A local file is written to a temporary file in the same folder (named
    ``temp_name``, else a unique ``.tmp-*`` name), flushed, fsynced when
    ``durable``, renamed over ``target`` with ``os.replace`` (atomic on one
    filesystem), and then the folder is fsynced so the rename itself survives
    a power cut. If anything fails the temporary file is removed and
    ``target`` keeps its old bytes. ``durable=False`` skips both fsyncs, for
    files that are cheap to rebuild (a cache entry).

    A remote object is written in place with one ``pipe_file`` (``options``,
    e.g. ``timeout``, go to it): an object store publishes an object only when
    its single upload completes, and has no atomic rename (the GCS emulator
    has no ``moveTo`` at all), so never ``mv`` there.
    """
    if fs is None:
        if is_local(target):
            return _replace_local_file(local_path(target), data, temp_name, durable)
        fs, target = open_filesystem(target)
    elif is_local_filesystem(fs):
        return _replace_local_file(os.fspath(target), data, temp_name, durable)
    return _put_object(fs, os.fspath(target), data, options)
