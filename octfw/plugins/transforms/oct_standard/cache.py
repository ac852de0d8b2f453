"""A persistent, on-disk cache of prepared volumes, bounded in bytes.

A transform's deterministic half (decode, resample, normalise, fit to
``image_size``) is computed once per volume and kept here; later epochs and
later runs read a small float32 array instead of decoding DICOM again.

Entries live in a :class:`~octfw.storage.disk_cache.DiskCache` under
``<cache_dir>/prepared``, one ``<hh>/<key>.npz`` file per volume, at most
``[transform] cache_max_bytes`` of them in all (least recently used
entries are evicted first). Every transform option set shares that one
folder and its one bound, so trying many options can never fill the disk;
entries of options no longer used are simply the first to go. ``key``
hashes the transform's ``cache_key()`` (a changed option never reuses an
entry), the volume's source URL and, for a local file or folder, its size
and modification time, so a file rewritten in place is prepared again (for
a series, its folder's, which changes when a file is added, removed or
replaced by rename). Remote objects (``gs://``) are keyed by URL alone:
archive objects are written once; clear the folder if one was rewritten.

An entry holds the prepared array plus the geometry of the volume it came
from (spacing, original shape, label), never anything else from the header.
Several data-loader workers (or runs) may fill the cache at once and a
reader never sees half an entry (DiskCache's guarantees, bound included);
an entry that fails to load or does not match (wrong shape, dtype, source,
non-finite values) is treated as a miss and rewritten. A cache that cannot
be written (full disk, read-only folder) warns once and training goes on.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from octfw.storage.disk_cache import DiskCache
from octfw.storage.files import is_local, local_path
from octfw.types import Provenance

__all__ = ["CachedVolume", "PreparedCache", "FORMAT_VERSION"]

#: Bumped when the entry layout changes; part of every entry's key.
FORMAT_VERSION = 1


@attrs.frozen(eq=False)
class CachedVolume:
    """One cache entry: the prepared array and the geometry of its source."""

    prepared: np.ndarray  #: float32, the transform's ``prepare`` output
    spacing: tuple[float, float, float]
    original_shape: tuple[int, ...]
    label: int | None


def _local_stamp(url: str) -> str:
    """Size and modification time of a local file or folder ('' when absent or remote)."""
    if not is_local(url):
        return ""
    # A series source "<folder>#series-<hash>" is stamped by its folder.
    path = local_path(url).split("#", 1)[0]
    try:
        stat = os.stat(path)
    except OSError:
        return ""
    return f"{stat.st_size}:{stat.st_mtime_ns}"


class PreparedCache:
    """Prepared volumes under ``folder``, at most ``max_bytes`` of them (None: unbounded, 0: off).

    ``shape`` is the shape every entry must have (the transform's
    ``image_size``); an entry of another shape is a miss. ``options`` (the
    transform's ``cache_key()``) is part of every key, so transforms with
    other options share the folder but never each other's entries.
    """

    def __init__(self, folder: str | os.PathLike[str], shape: tuple[int, ...],
                 max_bytes: int | None, options: str = ""):
        self.files = DiskCache(folder, max_bytes)
        self.shape = tuple(int(s) for s in shape)
        self.options = options

    @property
    def folder(self) -> Path:
        return self.files.folder

    def __repr__(self) -> str:
        return f"PreparedCache({str(self.folder)!r}, max_bytes={self.files.max_bytes!r})"

    def _key(self, source: str) -> str:
        text = f"{FORMAT_VERSION}\0{self.options}\0{source}\0{_local_stamp(source)}"
        return hashlib.sha256(text.encode("utf-8")).hexdigest() + ".npz"

    def path(self, source: str) -> Path:
        """Where the entry of ``source`` lives (it may not exist)."""
        return self.files.path(self._key(source))

    def get(self, source: str) -> CachedVolume | None:
        """The entry of ``source``, or None when absent, damaged or mismatched."""
        data = self.files.get(self._key(source))
        if data is None:
            return None
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as entry:
                prepared = entry["prepared"]
                meta = json.loads(bytes(entry["meta"]).decode("utf-8"))
        except Exception:  # noqa: BLE001 - a damaged entry of any kind is recomputed
            return None
        if (meta.get("source") != source or prepared.dtype != np.float32
                or tuple(prepared.shape) != self.shape or not np.isfinite(prepared).all()):
            return None
        try:
            spacing = tuple(float(s) for s in meta["spacing"])
            original_shape = tuple(int(n) for n in meta["original_shape"])
            label = None if meta.get("label") is None else int(meta["label"])
        except (KeyError, TypeError, ValueError):
            return None
        if len(spacing) != 3:
            return None
        return CachedVolume(prepared, spacing, original_shape, label)  # type: ignore[arg-type]

    def put(self, source: str, prepared: np.ndarray, provenance: Provenance) -> None:
        """Store ``prepared`` for ``source``, atomically, evicting the least recently used
        entries beyond the bound (an unwritable cache warns once, see the module)."""
        meta: dict[str, Any] = {
            "source": source,
            "spacing": [float(s) for s in provenance.spacing],
            "original_shape": [int(n) for n in provenance.original_shape],
            "label": provenance.label,
        }
        buffer = io.BytesIO()
        np.savez(buffer, prepared=np.asarray(prepared, dtype=np.float32),
                 meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8))
        self.files.put(self._key(source), buffer.getvalue())
