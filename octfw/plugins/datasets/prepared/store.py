"""The prepared-dataset format: a cohort decoded, resampled, normalised and fitted once.

``octfw prepare`` writes it (:mod:`octfw.plugins.datasets.prepared.prepare` runs
:func:`prepare_volume` on a Dask cluster); the ``prepared`` dataset reads it
(:mod:`octfw.plugins.datasets.prepared.dataset`). A location (a local folder or a
``gs://`` prefix) holds::

    prepared.json            the header: format, transform options, counts, the datasets
                             prepared into it, and the names of the snapshot's index and
                             quarantine below; written last, in one atomic step
    index-<sha>.jsonl        one line per usable volume (source URL, domain, spacing,
                             original shape, label, split, patient, source content hash,
                             the volume's key, dtype and checksum); named by the SHA-256
                             of its bytes (stores written before: index.jsonl)
    quarantine-<sha>.jsonl   sources that could not be used, with the reason
    prepare.lock             who is preparing into the location now (host, pid, start)
    volumes/<key>/zarr.json  one zarr v3 array per volume: [D, H, W] = transform.image_size,
    volumes/<key>/c/0/0/0    uint8 or float16, one chunk, blosc zstd with bit shuffle
    layers/<key>/zarr.json   the volume's retinal layer labels where its dataset has them
    layers/<key>/c/0/0/0     (:class:`octfw.types.LayeredDataset`): uint8 [D, H, W], brought
                             to image_size by the transform's ``prepare_labels`` (nearest
                             label); its index line holds their checksum and names
    entries/<key>.json       the volume's commit record, written by the worker that
                             prepared it once its array is complete

Why this shape:

- **One array per volume, one chunk each.** A training sample reads a whole
  volume, so one object per volume is one GET; a volume is written by one
  task, so concurrent workers never share an object; any zarr tool opens a
  volume as it is (``zarr.open_array(location + "/volumes/" + key)``).
- **Commit records.** A volume becomes part of the dataset only through its
  entry, written after both array objects, and the index is built from
  entries alone: a worker killed mid-write leaves an orphan array that is
  never read, and a rerun redoes exactly the volumes without an entry.
- **Keys from the source and its stamp** (size and modification time, or
  the object store's content hash and generation): the same file always
  gets the same key, a rewritten file a new one, so a rerun prepares only
  added or changed files.
- **Compact voxels.** ``prepare`` outputs float32 in [0, 1]. A source with
  8-bit voxels is stored as uint8 (``round(255 x)``, error at most 1/510),
  any other as float16 (relative error at most 2^-11, absolute at most
  2^-12 on [0, 1]); :func:`quantize` and :func:`dequantize` are the only
  conversions, and tests bound both errors.
- **Snapshots.** A header names one index file, and index files are
  never rewritten (their name is their content's hash): a reader that read
  the header reads the index it names, so it sees the last complete
  snapshot while a new one is prepared, and the new one only once its
  header has replaced the old one. Volumes of the old snapshot stay until
  a prepare is asked to remove them (``--prune``, ``--replace``).
- **Checked reads.** Each index line holds the SHA-256 of its volume's chunk
  bytes; a read that does not match (a damaged object, an index of another
  dataset) raises :class:`~octfw.display.errors.CorruptFile`, so the sample is
  quarantined instead of trained on.

zarr encodes and decodes in memory (:class:`zarr.storage.MemoryStore`);
octfw moves the bytes itself through fsspec, so the same code writes
local folders atomically (:func:`~octfw.storage.files.write_atomically`)
and GCS objects in one upload each.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any, Iterable, Mapping, Sequence

import attrs
import numpy as np

from octfw.display.errors import CorruptFile, UserError
from octfw.storage.files import open_filesystem, write_atomically
from octfw.types import Provenance, dequantize  # noqa: F401 - dequantize: quantize's inverse, read here too

__all__ = [
    "FORMAT_VERSION", "HEADER_FILE", "INDEX_FILE", "QUARANTINE_FILE", "LOCK_FILE", "DTYPES",
    "IndexRow", "Header", "volume_key", "dataset_id", "snapshot_name", "quantize", "dequantize",
    "choose_dtype", "encode_volume", "decode_volume", "prepare_volume", "read_header", "read_index",
    "read_snapshot", "options_difference", "encode_lines", "write_lines", "join",
]

FORMAT_VERSION = 1
HEADER_FILE = "prepared.json"
#: The index and quarantine of a store whose header names none (written before snapshots).
INDEX_FILE = "index.jsonl"
QUARANTINE_FILE = "quarantine.jsonl"
LOCK_FILE = "prepare.lock"
VOLUMES = "volumes"
LAYERS = "layers"
ENTRIES = "entries"
#: The object names of one volume's array, inside ``volumes/<key>/``.
ARRAY_METADATA = "zarr.json"
CHUNK = "c/0/0/0"
#: Storage dtypes: ``auto`` picks uint8 for 8-bit sources, else float16.
DTYPES = ("auto", "uint8", "float16")
# zstd at a low level: most of its ratio at a small share of its time
# (benchmarks/data_path/data_scale.py); bit shuffle groups the bits that change slowly.
_COMPRESSOR = {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3, "shuffle": "bitshuffle"}}


def join(location: str, *parts: str) -> str:
    return posixpath.join(location.rstrip("/"), *parts)


@attrs.frozen
class IndexRow:
    """One usable volume of a prepared dataset (one line of the index)."""

    key: str
    source: str  #: the URL the volume was read from (file or series folder)
    domain: str
    spacing: tuple[float, float, float]
    original_shape: tuple[int, ...]
    dtype: str  #: "uint8" or "float16"
    checksum: str  #: SHA-256 of the chunk bytes, hex
    nbytes: int  #: stored (compressed) bytes of the chunk
    content_hash: str  #: of the source file(s): "md5:<b64>" from the object store, or "sha256:<hex>"
    label: int | None = None
    split: str | None = None
    patient: str | None = None
    dataset: str = ""  #: :func:`dataset_id` of the recipe dataset that listed it ("" before ids were kept)
    #: SHA-256 of the chunk bytes of the volume's layer labels (``layers/<key>``); None: it has none
    layers_checksum: str | None = None
    layer_names: tuple[str, ...] | None = None  #: what each layer label value means (index = value)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self, recurse=False,
                            value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v)
        if self.layers_checksum is None:  # rows without layer labels keep the bytes they had before
            del data["layers_checksum"], data["layer_names"]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "IndexRow":
        return cls(
            key=str(data["key"]), source=str(data["source"]), domain=str(data["domain"]),
            spacing=tuple(float(s) for s in data["spacing"]),  # type: ignore[arg-type]
            original_shape=tuple(int(n) for n in data["original_shape"]),
            dtype=str(data["dtype"]), checksum=str(data["checksum"]), nbytes=int(data["nbytes"]),
            content_hash=str(data["content_hash"]),
            label=None if data.get("label") is None else int(data["label"]),
            split=data.get("split"), patient=data.get("patient"), dataset=str(data.get("dataset") or ""),
            layers_checksum=None if data.get("layers_checksum") is None else str(data["layers_checksum"]),
            layer_names=None if data.get("layer_names") is None else tuple(str(n) for n in data["layer_names"]),
        )

    @property
    def provenance(self) -> Provenance:
        return Provenance(source=self.source, domain=self.domain, spacing=self.spacing,
                          original_shape=self.original_shape, label=self.label)


@attrs.frozen
class Header:
    """``prepared.json``: what the volumes were prepared with, and which snapshot is current.

    ``complete`` is false only in a location that never had a complete
    snapshot (its first prepare has not finished); a later prepare leaves
    the header alone until it replaces it with the next complete one.
    """

    transform: Mapping[str, Any]  #: the transform's ``prepare_options()``
    transform_key: str  #: its ``cache_key()``; a sample carries it as ``Sample.prepared_key``
    image_size: tuple[int, int, int]
    dtype: str  #: the storage policy it was prepared with (:data:`DTYPES`)
    complete: bool = False
    volumes: int = 0
    quarantined: int = 0
    index_sha256: str = ""  #: of the index file's bytes, so a replaced index is caught
    format: int = FORMAT_VERSION
    index: str = INDEX_FILE  #: the snapshot's index file
    quarantine: str = QUARANTINE_FILE  #: the snapshot's quarantine file
    #: The recipe ``[dataset]`` tables prepared into the location (:func:`dataset_id` names each);
    #: empty in stores written before they were kept.
    datasets: tuple[Mapping[str, Any], ...] = ()
    #: Part of every volume key: "" until a ``--replace`` changed the transform options, so the
    #: new volumes never overwrite the old snapshot's (see :func:`volume_key`).
    key_salt: str = ""

    def to_bytes(self) -> bytes:
        data = attrs.asdict(self, recurse=False)
        data["transform"] = dict(self.transform)
        data["image_size"] = list(self.image_size)
        data["datasets"] = [dict(d) for d in self.datasets]
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8")


def volume_key(source: str, stamp: str, salt: str = "") -> str:
    """The key of ``source`` as it is now: a new stamp (a rewritten file) is a new key.

    ``salt`` is the header's ``key_salt``; "" keeps the keys of stores written before it existed.
    """
    text = f"{FORMAT_VERSION}\0{source}\0{stamp}" + (f"\0{salt}" if salt else "")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def dataset_id(table: Mapping[str, Any]) -> str:
    """A recipe ``[dataset]`` table's identity: its name and every option, paths resolved.

    Two recipes prepare "the same dataset" when their tables are equal; files
    added to or removed from its folder or manifest do not change it.
    """
    return hashlib.sha256(json.dumps(table, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]


def snapshot_name(prefix: str, data: bytes) -> str:
    """``<prefix>-<sha256[:16]>.jsonl``: a file named by its content is never rewritten."""
    return f"{prefix}-{hashlib.sha256(data).hexdigest()[:16]}.jsonl"


# --- voxels ------------------------------------------------------------------


def choose_dtype(volume: np.ndarray, policy: str) -> str:
    """uint8 for a source whose voxels are all integers in [0, 255] (8-bit), else float16."""
    if policy != "auto":
        return policy
    if volume.size and volume.min() >= 0 and volume.max() <= 255 and np.array_equal(volume, np.rint(volume)):
        return "uint8"
    return "float16"


def quantize(prepared: np.ndarray, dtype: str) -> np.ndarray:
    """``prepare``'s float32 output in [0, 1] as stored voxels."""
    if dtype == "uint8":
        return np.rint(np.clip(prepared, 0.0, 1.0) * 255.0).astype(np.uint8)
    if dtype == "float16":
        return prepared.astype(np.float16)
    raise ValueError(f"storage dtype must be uint8 or float16, got {dtype!r}")


def encode_volume(stored: np.ndarray) -> dict[str, bytes]:
    """The objects of a one-chunk zarr v3 array holding ``stored``: name -> bytes."""
    import zarr

    objects: dict[str, Any] = {}
    array = zarr.create_array(store=zarr.storage.MemoryStore(objects), shape=stored.shape,
                              dtype=stored.dtype, chunks=stored.shape, compressors=[_COMPRESSOR],
                              fill_value=0, zarr_format=3)
    array[...] = stored
    return {name: buffer.to_bytes() for name, buffer in objects.items()}


def decode_volume(metadata: bytes, chunk: bytes) -> np.ndarray:
    """The stored voxels of one volume from its two objects (raises on undecodable bytes)."""
    import zarr
    from zarr.core.buffer import default_buffer_prototype

    buffer = default_buffer_prototype().buffer
    store = zarr.storage.MemoryStore({ARRAY_METADATA: buffer.from_bytes(metadata),
                                      CHUNK: buffer.from_bytes(chunk)})
    return zarr.open_array(store, mode="r", zarr_format=3)[...]


# --- writing (runs on Dask workers) -------------------------------------------


def _content_hash(files: Sequence[str]) -> str:
    """A hash of the source bytes: the object store's MD5 where it keeps one (no download), else SHA-256."""
    hashes = []
    for url in files:
        fs, path = open_filesystem(url)
        md5 = fs.info(path).get("md5Hash")
        if md5:
            hashes.append(f"md5:{md5}")
            continue
        digest = hashlib.sha256()
        with fs.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        hashes.append(f"sha256:{digest.hexdigest()}")
    if len(hashes) == 1:
        return hashes[0]
    return "sha256:" + hashlib.sha256("\n".join(hashes).encode("utf-8")).hexdigest()


def prepare_volume(dataset: Any, transform: Any, index: int, location: str, key: str,
                   dtype_policy: str, files: Sequence[str], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Read, prepare and store volume ``index`` under ``key``; returns its entry.

    The entry is ``{"row": {...}}`` (an :class:`IndexRow`) or
    ``{"quarantined": {"source", "reason"}}`` for a file that cannot be used.
    Either way it is written to ``entries/<key>.json`` last, so a killed
    worker leaves no entry and its volume is prepared again by the next run.
    ``extra`` holds label, split and patient, known to the dataset without I/O.
    """
    source = dataset.source(index)
    fs, root = open_filesystem(location)
    try:
        sample = dataset.load(index)
        prepared = np.asarray(transform.prepare(sample), dtype=np.float32)
        dtype = choose_dtype(np.asarray(sample.volume), dtype_policy)
        objects = encode_volume(quantize(prepared, dtype))
        content_hash = _content_hash(files)
        layers, layer_names = _prepared_layers(dataset, transform, index, sample)
    except CorruptFile as bad:
        entry: dict[str, Any] = {"quarantined": {"source": bad.url, "reason": bad.reason}}
    else:
        for name in (ARRAY_METADATA, CHUNK):  # the chunk last: its checksum is in the entry
            write_atomically(join(root, VOLUMES, key, name), objects[name], fs=fs, durable=False)
        layers_checksum = None
        if layers is not None:
            for name in (ARRAY_METADATA, CHUNK):
                write_atomically(join(root, LAYERS, key, name), layers[name], fs=fs, durable=False)
            layers_checksum = hashlib.sha256(layers[CHUNK]).hexdigest()
        provenance = sample.provenance
        row = IndexRow(
            key=key, source=source, domain=provenance.domain, spacing=tuple(provenance.spacing),
            original_shape=tuple(provenance.original_shape), dtype=dtype,
            checksum=hashlib.sha256(objects[CHUNK]).hexdigest(), nbytes=len(objects[CHUNK]),
            content_hash=content_hash, label=provenance.label if extra.get("label") is None else extra["label"],
            split=extra.get("split"), patient=extra.get("patient"),
            layers_checksum=layers_checksum, layer_names=layer_names,
        )
        entry = {"row": row.to_json()}
    write_atomically(join(root, ENTRIES, f"{key}.json"), json.dumps(entry).encode("utf-8"), fs=fs, durable=False)
    return entry


def _prepared_layers(dataset: Any, transform: Any, index: int,
                     sample: Any) -> tuple[dict[str, bytes] | None, tuple[str, ...] | None]:
    """The encoded objects of volume ``index``'s layer labels at the prepared geometry, and their
    names; (None, None) where the dataset has none or the transform cannot prepare labels.
    A label file that cannot be read quarantines the volume (CorruptFile naming it)."""
    from octfw.display.errors import ContractError
    from octfw.types import LabelPreparingTransform, LayeredDataset

    if not isinstance(dataset, LayeredDataset) or not isinstance(transform, LabelPreparingTransform):
        return None, None
    names = dataset.layer_names(index)
    labels = dataset.layers(index)
    if labels is None or names is None:
        return None, None
    try:
        prepared = np.asarray(transform.prepare_labels(labels, sample), dtype=np.uint8)
    except ContractError as bad:
        raise CorruptFile(str(dataset.layers_source(index)), str(bad)) from None
    return encode_volume(prepared), tuple(names)


# --- reading -------------------------------------------------------------------


def _read_text(fs: Any, path: str, location: str, what: str) -> str:
    try:
        return fs.cat_file(path).decode("utf-8")
    except FileNotFoundError:
        raise
    except PermissionError as exc:
        raise UserError(f"{location}: no permission to read {what} ({exc})") from None
    except OSError as exc:
        raise UserError(f"{location}: cannot read {what} ({type(exc).__name__}: {exc})") from None
    except UnicodeDecodeError:
        raise UserError(f"{location}: {what} is not UTF-8 text") from None


def read_header(location: str, *, must_be_complete: bool = True) -> Header | None:
    """The header at ``location``, or None where there is none.

    ``must_be_complete`` turns an interrupted preparation into a UserError
    that says how to finish it.
    """
    fs, root = open_filesystem(location)
    try:
        text = _read_text(fs, join(root, HEADER_FILE), location, HEADER_FILE)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        header = Header(
            transform=dict(data["transform"]), transform_key=str(data["transform_key"]),
            image_size=tuple(int(s) for s in data["image_size"]),  # type: ignore[arg-type]
            dtype=str(data["dtype"]), complete=bool(data["complete"]), volumes=int(data["volumes"]),
            quarantined=int(data["quarantined"]), index_sha256=str(data["index_sha256"]),
            format=int(data["format"]), index=str(data.get("index", INDEX_FILE)),
            quarantine=str(data.get("quarantine", QUARANTINE_FILE)),
            datasets=tuple(dict(d) for d in data.get("datasets", ())), key_salt=str(data.get("key_salt", "")),
        )
        if "/" in header.index or "/" in header.quarantine:
            raise ValueError("index and quarantine are file names in the location")
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{location}/{HEADER_FILE} is not a prepared-dataset header ({exc})") from None
    if header.format != FORMAT_VERSION:
        raise UserError(f"{location} was prepared in format {header.format}; this octfw reads format "
                        f"{FORMAT_VERSION}: prepare it again")
    if must_be_complete and not header.complete:
        raise UserError(f"{location} is a partly written prepared dataset; run `octfw prepare` "
                        "again to finish it")
    return header


def read_index(location: str, header: Header) -> list[IndexRow]:
    """Every row of the index the header names, checked against the header (count and SHA-256)."""
    fs, root = open_filesystem(location)
    name = header.index
    try:
        raw = fs.cat_file(join(root, name))
    except FileNotFoundError:
        raise UserError(f"{location} has a header but no {name}; run `octfw prepare` again") from None
    if hashlib.sha256(raw).hexdigest() != header.index_sha256:
        raise UserError(f"{location}/{name} does not match its header (changed after it was "
                        "written?); run `octfw prepare` again")
    rows = []
    for number, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        try:
            rows.append(IndexRow.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{location}/{name} line {number}: not an index row ({exc})") from None
    if len(rows) != header.volumes:
        raise UserError(f"{location}/{name} has {len(rows)} rows, its header says {header.volumes}")
    return rows


def read_snapshot(location: str) -> tuple[Header, list[IndexRow]] | None:
    """The current complete snapshot: (header, rows), or None where there is no header.

    A prepare that finishes between reading the header and its index removes
    index files two snapshots old at most, so a missing index is read once
    more from the newer header before it is an error.
    """
    header = read_header(location)
    if header is None:
        return None
    try:
        return header, read_index(location, header)
    except UserError:
        newer = read_header(location)
        if newer is None or newer == header:
            raise
        return newer, read_index(location, newer)


def options_difference(prepared: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """``key: prepared value != recipe value`` for every transform option that differs."""
    keys = sorted(set(prepared) | set(wanted))
    return [f"{k}: prepared {json.dumps(prepared.get(k))} != recipe {json.dumps(wanted.get(k))}"
            for k in keys if prepared.get(k) != wanted.get(k)]


def encode_lines(records: Iterable[Mapping[str, Any]]) -> bytes:
    """JSON lines, keys sorted: the same records always give the same bytes (and file name)."""
    return "".join(json.dumps(dict(r), sort_keys=True) + "\n" for r in records).encode("utf-8")


def write_lines(location: str, name: str, records: Iterable[Mapping[str, Any]]) -> bytes:
    """Write JSON lines atomically; returns the bytes written."""
    data = encode_lines(records)
    write_atomically(join(location, name), data)
    return data

