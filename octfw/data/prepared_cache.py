"""A persistent, on-disk cache of prepared volumes.

A transform's deterministic half (decode, resample, normalise, fit to
``image_size``) is computed once per volume and kept here; later epochs and
later runs read a small float32 array instead of decoding DICOM again.

Layout: ``<folder>/<hh>/<key>.npz``, one file per volume, where ``folder``
is ``<cache_dir>/prepared/<transform.cache_key()>``, so a changed transform
option lands in another folder and never reuses stale entries. ``key``
hashes the volume's source URL and, for a local file or folder, its size and
modification time, so a file rewritten in place is prepared again (for a
series, its folder's, which changes when a file is added, removed or
replaced by rename). Remote objects (``gs://``) are keyed by URL alone:
archive objects are written once; clear the folder if one was rewritten.

An entry holds the prepared array plus the geometry of the volume it came
from (spacing, original shape, label), never anything else from the header.
Writes go to a temporary file that is renamed into place, so several
data-loader workers (or runs) may fill the cache at once and a reader never
sees half an entry; an entry that fails to load or does not match (wrong
shape, dtype, source, non-finite values) is treated as a miss and rewritten.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from octfw.storage.files import is_local, local_path, write_atomically
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
    """Prepared volumes of one transform configuration, under ``folder``.

    ``shape`` is the shape every entry must have (the transform's
    ``image_size``); an entry of another shape is a miss.
    """

    def __init__(self, folder: str | os.PathLike[str], shape: tuple[int, ...]):
        self.folder = Path(folder)
        self.shape = tuple(int(s) for s in shape)
        self._warned = False

    def __repr__(self) -> str:
        return f"PreparedCache({str(self.folder)!r})"

    def path(self, source: str) -> Path:
        """Where the entry of ``source`` lives (it may not exist)."""
        text = f"{FORMAT_VERSION}\0{source}\0{_local_stamp(source)}"
        key = hashlib.sha256(text.encode("utf-8")).hexdigest()
        # Two-character subfolders keep directories small for large cohorts.
        return self.folder / key[:2] / f"{key}.npz"

    def get(self, source: str) -> CachedVolume | None:
        """The entry of ``source``, or None when absent, damaged or mismatched."""
        path = self.path(source)
        try:
            with np.load(path, allow_pickle=False) as entry:
                prepared = entry["prepared"]
                meta = json.loads(bytes(entry["meta"]).decode("utf-8"))
        except FileNotFoundError:
            return None
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
        """Store ``prepared`` for ``source``, atomically.

        A cache that cannot be written (full disk, read-only folder) costs
        speed, not the run: it warns once per process and training goes on.
        """
        meta: dict[str, Any] = {
            "source": source,
            "spacing": [float(s) for s in provenance.spacing],
            "original_shape": [int(n) for n in provenance.original_shape],
            "label": provenance.label,
        }
        buffer = io.BytesIO()
        np.savez(buffer, prepared=np.asarray(prepared, dtype=np.float32),
                 meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8))
        try:
            # Not fsynced: an entry lost in a crash is only a miss (prepared
            # again), and an fsync per volume would slow every first epoch.
            write_atomically(self.path(source), buffer.getvalue(), durable=False)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(f"cannot write the prepared-volume cache in {self.folder} "
                              f"({exc.strerror or type(exc).__name__}); volumes are prepared "
                              "again every epoch", RuntimeWarning, stacklevel=2)
