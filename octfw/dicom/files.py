"""The bytes of a file, local or remote: opening one to read, writing one whole.

Files are opened through fsspec, so ``gs://`` and other remote URLs work when
the matching filesystem package (gcsfs, ...) is installed; local paths and
``file://`` URLs are opened directly. The DICOM reading and writing, the
manifest, the masks and the cohorts written as DICOM all go through here.
"""

from __future__ import annotations

from typing import IO, Any

from octfw.storage.files import is_local, local_path, write_atomically

__all__ = ["open_file", "write_bytes"]


def open_file(url: str, fs: Any = None) -> IO[bytes]:
    """Open a local path, ``file://`` URL or fsspec URL for binary reading."""
    if fs is not None:
        return fs.open(url, "rb")
    if is_local(url):
        return open(local_path(url), "rb")
    import fsspec  # remote only: gcsfs and friends load on first use

    return fsspec.open(url, "rb").open()


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to a local path or fsspec URL, atomically (see ``write_atomically``).

    A reader (or a second process writing the same bytes) never sees half a
    file. Not fsynced: octfw writes synthetic cohorts with it, which a crash
    leaves incomplete and the next run writes again (``cohort.json`` goes
    last and records every size), and an fsync per file would slow writing
    thousands of them.
    """
    write_atomically(url, data, durable=False)
