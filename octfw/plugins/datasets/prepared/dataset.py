"""The ``prepared`` dataset: volumes that ``octfw prepare`` stored, streamed from their location.

Building it reads ``prepared.json`` and the index it names only: no file of
the cohort is listed, opened or decoded, so 100,000 volumes are ready in
seconds on every host. ``load(i)`` reads one volume's chunk (one GET on
GCS), checks it against the index's SHA-256, decodes it and returns the
prepared float32 array as the sample's volume, marked with the transform
key it was prepared with (:attr:`octfw.types.Sample.prepared_key`): the
transform then skips its deterministic half and draws only the views and
masks. Each data-loader worker reads only the samples its order hands it.

Retinal layer labels, where the prepared dataset had them, were stored beside the volumes
(``layers/<key>``) at the prepared geometry: ``layers(i)`` reads them (uint8
``transform.image_size``, checked against the index's SHA-256) and ``layer_names(i)``
names their values (:class:`octfw.types.LayeredDataset`); ``transform.prepare_labels``
hands them back unchanged, so a consumer reads them the same way from either dataset.

A remote location can be cached on local disk, bounded in bytes
(least-recently-used volumes are evicted; see
:class:`octfw.storage.disk_cache.DiskCache`); the cache keeps the
compressed chunk, so a volume costs its compressed size on disk.

Bad data never becomes a silently wrong array: a chunk that is missing,
fails its checksum, does not decode or has the wrong shape raises
:class:`~octfw.display.errors.CorruptFile` and the sample is quarantined.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping, Sequence

from octfw.plugins.datasets.prepared.store import (
    ARRAY_METADATA, CHUNK, HEADER_FILE, LAYERS, VOLUMES, Header, IndexRow, decode_volume, join,
    options_difference, read_snapshot,
)
from octfw.display.errors import CorruptFile, UserError
from octfw.storage.files import is_local, open_filesystem
from octfw.types import Sample, StorableTransform

__all__ = ["PreparedDataset", "check_transform_matches"]


class PreparedDataset:
    """The volumes of one prepared location (optionally one split of them)."""

    def __init__(self, location: str, header: Header, rows: Sequence[IndexRow], cache: Any = None):
        if not rows:
            raise UserError(f"no volumes in the prepared dataset at {location}")
        self.location = location
        self.header = header
        self.rows: tuple[IndexRow, ...] = tuple(rows)
        self.cache = cache  #: a DiskCache of compressed chunks, or None
        # zarr.json is the same for every volume of one dtype (same shape and codecs), so each
        # process keeps the first that decodes, per dtype, instead of reading one per sample.
        self._metadata: dict[str, bytes] = {}

    @classmethod
    def open(cls, location: str, *, split: str | None = None, cache: Any = None) -> "PreparedDataset":
        """Read the header and index at ``location`` (and nothing else).

        It is the location's last complete snapshot: a prepare running into
        it meanwhile changes nothing this dataset reads (volumes are removed
        only by ``octfw prepare --prune`` or ``--replace``).
        """
        location = str(location).rstrip("/")
        snapshot = read_snapshot(location)
        if snapshot is None:
            raise UserError(f"dataset.path {location}: no prepared dataset there (no {HEADER_FILE}); "
                            f"make one with `octfw prepare RECIPE --out {location}`")
        header, rows = snapshot
        if split is not None:
            rows = [row for row in rows if row.split == split]
            if not rows:
                raise UserError(f"no volumes with split {split!r} in the prepared dataset at {location}")
        return cls(location, header, rows, None if is_local(location) else cache)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"PreparedDataset({len(self)} volumes from {self.location})"

    # --- what the engine asks without I/O -------------------------------

    @property
    def prepared_key(self) -> str:
        """The transform key the volumes were prepared with (``cache_key()`` of the transform)."""
        return self.header.transform_key

    @property
    def prepare_options(self) -> Mapping[str, Any]:
        return self.header.transform

    def check_transform(self, transform: Any) -> None:
        """UserError when ``transform`` would prepare volumes other than these were (engine pre-flight)."""
        check_transform_matches(self, transform)

    def source(self, index: int) -> str:
        return self.rows[index].source

    def domain(self, index: int) -> str:
        return self.rows[index].domain

    def label(self, index: int) -> int | None:
        return self.rows[index].label

    def patient(self, index: int) -> str | None:
        return self.rows[index].patient

    def layers_source(self, index: int) -> str | None:
        """Where volume ``index``'s prepared layer labels are stored (None: it has none); no I/O."""
        row = self.rows[index]
        return None if row.layers_checksum is None else join(self.location, LAYERS, row.key)

    def layer_names(self, index: int) -> tuple[str, ...] | None:
        """What each layer label value of ``index`` means (index = value), top to bottom; no I/O."""
        return self.rows[index].layer_names

    def layers(self, index: int) -> "Any":
        """Volume ``index``'s layer labels as prepared: uint8 ``image_size`` (None: it has none).

        Raises CorruptFile naming the volume's source when they are missing, fail their
        checksum or do not decode."""
        row = self.rows[index]
        if row.layers_checksum is None:
            return None
        fs, root = open_filesystem(self.location)
        where = f"its prepared layer labels {LAYERS}/{row.key} in {self.location}"
        try:
            metadata = fs.cat_file(join(root, LAYERS, row.key, ARRAY_METADATA))
            chunk = fs.cat_file(join(root, LAYERS, row.key, CHUNK))
        except FileNotFoundError:
            raise CorruptFile(row.source, f"{where} are missing") from None
        if hashlib.sha256(chunk).hexdigest() != row.layers_checksum:
            raise CorruptFile(row.source, f"{where} do not match the index entry (checksum)")
        try:
            labels = decode_volume(metadata, chunk)
        except Exception as exc:  # noqa: BLE001 - any decoding failure means the same thing
            raise CorruptFile(row.source, f"{where} do not decode ({type(exc).__name__})") from None
        if tuple(labels.shape) != self.header.image_size or str(labels.dtype) != "uint8":
            raise CorruptFile(row.source, f"{where} are {labels.dtype} {list(labels.shape)}, not uint8 "
                                          f"{list(self.header.image_size)}")
        return labels

    # --- reading one volume ----------------------------------------------

    def _read(self, fs: Any, root: str, row: IndexRow, name: str) -> bytes:
        try:
            return fs.cat_file(join(root, VOLUMES, row.key, name))
        except FileNotFoundError:
            raise CorruptFile(row.source, f"its prepared volume {row.key} is missing from "
                                          f"{self.location}") from None
        except PermissionError as exc:
            raise UserError(f"{self.location}: no permission to read prepared volumes ({exc})") from None

    def _chunk(self, fs: Any, root: str, row: IndexRow) -> bytes:
        cached = self.cache.get(row.key) if self.cache is not None else None
        if cached is not None and hashlib.sha256(cached).hexdigest() == row.checksum:
            return cached
        chunk = self._read(fs, root, row, CHUNK)
        if hashlib.sha256(chunk).hexdigest() != row.checksum:
            raise CorruptFile(row.source, f"its prepared volume {row.key} in {self.location} does not "
                                          "match its index entry (checksum)")
        if self.cache is not None:
            self.cache.put(row.key, chunk)
        return chunk

    def load(self, index: int) -> Sample:
        row = self.rows[index]
        fs, root = open_filesystem(self.location)
        chunk = self._chunk(fs, root, row)
        # A volume's own zarr.json until one of its dtype has decoded: a damaged one is that
        # volume's damage (quarantined), never the store's, whichever volume is read first.
        metadata = self._metadata.get(row.dtype)
        own = metadata is None
        if own:
            metadata = self._read(fs, root, row, ARRAY_METADATA)
        try:
            stored = decode_volume(metadata, chunk)
        except Exception as exc:  # noqa: BLE001 - any decoding failure quarantines the sample
            raise CorruptFile(row.source, f"its prepared volume {row.key} does not decode "
                                          f"({type(exc).__name__}: {str(exc)[:200]})") from None
        if tuple(stored.shape) != self.header.image_size or str(stored.dtype) != row.dtype:
            raise CorruptFile(row.source, f"its prepared volume {row.key} is {stored.dtype} "
                                          f"{list(stored.shape)}, the index says {row.dtype} "
                                          f"{list(self.header.image_size)}")
        if own:  # decoded to what the index says: the metadata every volume of this dtype shares
            self._metadata[row.dtype] = metadata
        # As stored (uint8 or float16): the transform converts what it uses, and unaugmented uint8
        # views travel as bytes to the device (octfw.types.BATCH_KEYS).
        return Sample(volume=stored, provenance=row.provenance, prepared_key=self.prepared_key)


def check_transform_matches(dataset: Any, transform: Any, where: str = "dataset.path") -> None:
    """UserError naming every option that differs when a prepared dataset meets another transform."""
    prepared = getattr(dataset, "prepare_options", None)
    if prepared is None:
        return
    if not isinstance(transform, StorableTransform):
        raise UserError(f"{where} {dataset.location} holds prepared volumes, but the transform "
                        f"{type(transform).__name__} has no prepare_options() to check them against")
    differences = options_difference(prepared, transform.prepare_options())
    if differences:
        raise UserError(f"{where} {dataset.location} was prepared with other transform options: "
                        f"{'; '.join(differences)}. Set [transform] to match, or run `octfw prepare` "
                        "with this recipe into a new location")


def cache_folder(cache_dir: str | Path, location: str) -> Path:
    """Where one location's chunks are cached on this host."""
    return Path(cache_dir) / "prepared-volumes" / hashlib.sha256(location.encode("utf-8")).hexdigest()[:16]

