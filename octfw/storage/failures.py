"""What went wrong with a write, in words a user acts on.

A full disk reaches octfw as torch's ``RuntimeError: [enforce fail at
inline_container.cc:664] . unexpected pos ...``, with the real ``OSError:
No space left on device`` only in the exception's context; a read-only
folder as ``OSError(EROFS)``; an unreachable store as an aiohttp or
``ConnectionError`` a few levels down. :func:`storage_cause` walks the chain
and names the cause once, for every place that writes (checkpoints, the run
folder's probe, prepared stores).
"""

from __future__ import annotations

import errno
import os
import shutil

__all__ = ["storage_cause", "free_bytes", "free_inodes", "format_bytes"]

_PERMISSION = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
               errno.EROFS: "read-only file system"}


def format_bytes(count: float) -> str:
    """``4.9 MB``, ``10.2 GB``: decimal units, as ``df -H`` and cloud consoles show them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def free_bytes(path: str) -> int | None:
    """Bytes free to this user on the disk that holds ``path`` (or its nearest existing parent)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def free_inodes(path: str) -> int | None:
    """Files that can still be created on the disk that holds ``path`` (None: not told)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return stats.f_favail if stats.f_files else None  # some file systems have no inode count


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def storage_cause(exc: BaseException, location: str, needed_bytes: int | None = None) -> str | None:
    """The cause of a failed write to ``location`` in one phrase, or None when it is none of
    the known ones (the caller then shows the error itself).

    ``needed_bytes``: what the write needed, so that a full disk reads "no space left on
    device at PATH (4.9 MB free, a checkpoint needs 10.2 MB)".
    """
    for link in _chain(exc):
        if type(link).__name__ == "FSTimeoutError":  # fsspec's deadline: the store did not answer
            link = TimeoutError(str(link))
        number = getattr(link, "errno", None)
        if number in (errno.ENOSPC, errno.EDQUOT):
            if free_inodes(location) == 0:  # bytes may be free: no file can be made
                free = free_bytes(location)
                return (f"no free inodes left on device at {location} (no file can be created"
                        + (f"; {format_bytes(free)} free" if free is not None else "") + ")")
            free = free_bytes(location)
            detail = [f"{format_bytes(free)} free"] if free is not None else []
            if needed_bytes:
                detail.append(f"a checkpoint needs {format_bytes(needed_bytes)}")
            return f"no space left on device at {location}" + (f" ({', '.join(detail)})" if detail else "")
        if number in _PERMISSION:
            return f"{_PERMISSION[number]} at {location}"
        if isinstance(link, (ConnectionError, TimeoutError)) or type(link).__name__ in (
                "ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "ServerTimeoutError"):
            said = str(exc) if exc is not link else f"{type(link).__name__}: {link}"
            return f"cannot reach the store of {location} ({said.rstrip(': ')})"
    return None
