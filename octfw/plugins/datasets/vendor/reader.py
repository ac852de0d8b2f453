"""Raw vendor OCT files read through the ``oct-converter`` package.

OCT archives hold the devices' own formats as often as DICOM: Heidelberg
``.e2e``, Topcon ``.fds`` / ``.fda``, Zeiss ``.img`` and Bioptigen ``.OCT``.
``oct-converter`` (the ``vendor`` extra) parses them; this module turns its
result into a :class:`~octfw.types.Sample` ``[D, H, W]`` (B-scans, axial,
lateral) with the same checks, provenance and quarantine behaviour as
:mod:`octfw.dicom.decoding`:

- every failure is a :class:`~octfw.display.errors.CorruptFile` whose reason is
  written here (never an exception's text, which may quote file contents).
  A truncated ``.e2e`` is caught here, because oct-converter skips the
  chunks it cannot read and would return a shorter volume;
- the patient fields oct-converter extracts (name, ID, birth date) are never
  read; provenance is the file URL, the domain and the geometry;
- spacing ``(dz, dy, dx)`` comes from the file for each axis the format
  records, else from ``default_spacing``, else 1.0 mm with a
  :class:`~octfw.dicom.header.SpacingDefaulted` warning. Topcon ``.fds`` /
  ``.fda`` record all three; Heidelberg ``.e2e`` only the axial one as
  oct-converter reads it; Zeiss ``.img`` and Bioptigen ``.OCT`` none (see
  :func:`_recorded_spacing`). Zeiss ``.img`` files record no B-scan size
  either: give ``img_shape`` for them;
- Bioptigen B-scans, which oct-converter returns A-scan by A-scan, are
  transposed to axial x lateral like the others.

oct-converter 0.7.0 needs :mod:`octfw.plugins.datasets.vendor.oct_converter_compat` on numpy
2.3+, applied by :func:`require_oct_converter`. The domain is the vendor the
format belongs to (``.e2e`` -> heidelberg, ...), the parent folder's name,
or the manifest's domain column. Remote files (``gs://``) are copied to a
temporary local file first, because the readers open paths.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import tempfile
import warnings
from typing import Any, Sequence

import attrs
import numpy as np

from octfw.dicom.header import UNKNOWN_DOMAIN, SpacingDefaulted
from octfw.dicom.manifest import is_manifest, read_manifest
from octfw.plugins.datasets.vendor.config import DOMAIN_SOURCES, FORMATS, VENDOR_EXTENSIONS
from octfw.display.errors import CorruptFile, UserError
from octfw.storage.files import is_local, local_path
from octfw.types import Provenance, Sample

__all__ = [
    "FORMATS",
    "VENDOR_EXTENSIONS",
    "require_oct_converter",
    "read_vendor_volume",
    "VendorEntry",
    "VendorDataset",
]



def require_oct_converter() -> Any:
    """The ``oct_converter.readers`` module, or a UserError naming the extra."""
    try:
        import oct_converter.readers as readers
    except ImportError as exc:
        raise UserError(
            "the oct-vendor dataset needs the oct-converter package: pip install 'octfw[vendor]' "
            f"(import failed: {type(exc).__name__}: {exc})"
        ) from None
    from octfw.plugins.datasets.vendor.oct_converter_compat import patch_oct_converter

    patch_oct_converter()  # its Topcon readers need np.fromstring, gone in numpy 2.3
    return readers


@contextlib.contextmanager
def _local_copy(url: str):
    """A local path holding ``url``'s bytes (the path itself for local files)."""
    if is_local(url):
        yield local_path(url)
        return
    import fsspec

    suffix = posixpath.splitext(url)[1]
    fd, path = tempfile.mkstemp(prefix="octfw-vendor-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as out, fsspec.open(url, "rb") as remote:
            out.write(remote.read())
        yield path
    finally:
        os.unlink(path)


class _Truncated(Exception):
    """The file ends before data its own directory lists."""


def _read_with_oct_converter(readers: Any, kind: str, path: str, img_shape: Sequence[int],
                             img_interlaced: bool) -> Any:
    # oct-converter prints progress and chunk names; keep them off the console.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = getattr(readers, kind)(path)
        if kind == "IMG":
            rows, cols = (int(n) for n in img_shape)
            return reader.read_oct_volume(rows=rows, cols=cols, interlaced=img_interlaced)
        volumes = reader.read_oct_volume()
    if kind == "E2E" and _e2e_truncated(reader, path):
        raise _Truncated
    if isinstance(volumes, list):  # E2E and Bioptigen files may hold several volumes; take the first
        return volumes[0] if volumes else None
    return volumes


def _e2e_truncated(reader: Any, path: str) -> bool:
    """Whether a chunk listed in an E2E file's directory runs past the file's end.

    oct-converter skips chunks it cannot parse, so a truncated .e2e would
    otherwise read as a volume missing its last B-scans. A listed chunk is
    a 60-byte header plus ``size`` bytes at ``start`` (the entries
    oct-converter itself reads are those with ``start > pos``).
    """
    from oct_converter.readers.binary_structs import e2e_binary

    directory, entry, chunk_header = (e2e_binary.main_directory_structure,
                                      e2e_binary.sub_directory_structure, e2e_binary.chunk_structure)
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
        for position in reader.directory_stack:
            f.seek(position + reader.byte_skip)
            for _ in range(directory.parse(f.read(directory.sizeof())).num_entries):
                listed = entry.parse(f.read(entry.sizeof()))
                end = reader.byte_skip + listed.start + chunk_header.sizeof() + listed.size
                if listed.start > listed.pos and end > file_size:
                    return True
    return False


def _bscans(kind: str, oct_volume: Any) -> np.ndarray:
    """The B-scans as float32 [D, H, W] (H axial, W lateral)."""
    frames = [np.asarray(frame) for frame in oct_volume.volume]
    if kind == "BOCT":  # Bioptigen frames come A-scan by A-scan: [lateral, axial]
        frames = [frame.T for frame in frames]
    return np.stack(frames).astype(np.float32)


def _recorded_spacing(kind: str, oct_volume: Any) -> tuple[float | None, float | None, float | None]:
    """(dz, dy, dx) in mm as far as the file records them, else None per axis.

    oct-converter's ``pixel_spacing`` has no single convention: the Topcon
    readers return (lateral, between B-scans, axial) computed from the
    file's scan size; the E2E reader returns (``scalex``, axial,
    ``slice_thickness``) where only the axial value comes from the file and
    the other two are its constant keyword defaults (0.01, 0.05), so they
    are not used; the Zeiss and Bioptigen readers return none.
    """
    found = getattr(oct_volume, "pixel_spacing", None)
    try:
        values = [float(v) for v in found]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        return None, None, None
    if len(values) != 3:
        return None, None, None
    values = [v if np.isfinite(v) and v > 0 else None for v in values]
    if kind in ("FDS", "FDA"):
        lateral, between, axial = values
        return between, axial, lateral
    if kind == "E2E":
        return None, values[1], None
    return None, None, None


def _spacing(kind: str, oct_volume: Any, default: Sequence[float] | None
             ) -> tuple[tuple[float, float, float], list[str]]:
    """(dz, dy, dx): the file's values, each missing one from ``default``, else
    1.0; and the names of the values that fell back to 1.0."""
    recorded = _recorded_spacing(kind, oct_volume)
    fallback = (1.0, 1.0, 1.0) if default is None else tuple(float(s) for s in default)
    spacing = tuple(r if r is not None else f for r, f in zip(recorded, fallback))
    names = ["slice spacing", "axial pixel spacing", "lateral pixel spacing"]
    missing = [n for n, r in zip(names, recorded) if r is None] if default is None else []
    if missing[-2:] == names[1:]:  # neither in-plane value: name it as the DICOM reader does
        missing[-2:] = ["pixel spacing"]
    return spacing, missing  # type: ignore[return-value]


def read_vendor_volume(
    url: str | os.PathLike[str],
    *,
    domain: str | None = None,
    label: int | None = None,
    img_shape: Sequence[int] = (1024, 512),
    img_interlaced: bool = False,
    default_spacing: Sequence[float] | None = None,
) -> Sample:
    """Read one vendor OCT file: float32 ``[D, H, W]`` plus provenance.

    ``domain`` overrides the vendor of the format. ``img_shape`` is the
    ``(rows, cols)`` of a Zeiss ``.img`` B-scan. Raises CorruptFile for any
    unusable file and UserError when oct-converter is not installed.
    """
    url = os.fspath(url)
    suffix = posixpath.splitext(url)[1].lower()
    if suffix not in FORMATS:
        raise CorruptFile(url, f"not a vendor OCT file (suffix {suffix or 'none'}; "
                               f"known: {', '.join(VENDOR_EXTENSIONS)})")
    format_domain, kind, name = FORMATS[suffix]
    readers = require_oct_converter()
    try:
        with _local_copy(url) as path:
            oct_volume = _read_with_oct_converter(readers, kind, path, img_shape, img_interlaced)
    except FileNotFoundError:
        raise CorruptFile(url, "file not found") from None
    except _Truncated:
        raise CorruptFile(url, f"the {name} file is truncated "
                               "(its directory lists data past its end)") from None
    except Exception as exc:  # noqa: BLE001 - any parser failure means an unusable file
        raise CorruptFile(url, f"cannot read the {name} file ({type(exc).__name__})") from exc
    if oct_volume is None:
        raise CorruptFile(url, f"the {name} file holds no OCT volume")

    try:
        volume = _bscans(kind, oct_volume)
    except Exception as exc:  # noqa: BLE001 - ragged or empty frame lists
        raise CorruptFile(url, f"B-scans of the {name} file do not form a volume ({type(exc).__name__})") from exc
    if volume.ndim != 3 or min(volume.shape[1:]) < 2:
        raise CorruptFile(url, f"wrong dimensions: decoded to shape {list(volume.shape)}")
    bad = int(volume.size - np.count_nonzero(np.isfinite(volume)))
    if bad:
        raise CorruptFile(url, f"{bad} non-finite voxels")
    low, high = float(volume.min()), float(volume.max())
    if low == high:
        raise CorruptFile(url, f"constant volume (every voxel is {low:g})")

    domain = domain if domain is not None else format_domain
    spacing, missing = _spacing(kind, oct_volume, default_spacing)
    if missing:
        warnings.warn(SpacingDefaulted(url, domain, missing), stacklevel=2)
    provenance = Provenance(source=url, domain=domain, spacing=spacing,
                            original_shape=tuple(int(n) for n in volume.shape), label=label)
    return Sample(volume=volume, provenance=provenance)


@attrs.frozen
class VendorEntry:
    url: str
    domain: str
    label: int | None = None


class VendorDataset:
    """Vendor OCT files listed at build time; the ``oct-vendor`` dataset.

    Same listing rules as the ``dicom`` dataset (folder searched
    recursively, glob, or manifest); see the module docstring for domains
    and spacing. Holds only strings, so it pickles into loader workers.
    """

    def __init__(self, entries: Sequence[VendorEntry], location: str, *,
                 img_shape: Sequence[int] = (1024, 512), img_interlaced: bool = False,
                 default_spacing: Sequence[float] | None = None) -> None:
        if not entries:
            raise UserError(f"no vendor OCT files in {location}")
        self.entries = tuple(entries)
        self.location = location
        self.img_shape = tuple(int(n) for n in img_shape)
        self.img_interlaced = img_interlaced
        self.default_spacing = None if default_spacing is None else tuple(float(s) for s in default_spacing)

    @classmethod
    def from_location(cls, path: str | os.PathLike[str], *, split: str | None = None,
                      domain_from: str = "format", extensions: Sequence[str] = VENDOR_EXTENSIONS,
                      **options: Any) -> "VendorDataset":
        """List vendor files at ``path`` (folder, glob or manifest); ``options``
        go to the constructor (``img_shape``, ``img_interlaced``, ``default_spacing``)."""
        from octfw.dicom.dataset import list_dicom_files

        path = os.fspath(path)
        if domain_from not in DOMAIN_SOURCES:
            raise UserError(f"dataset.domain_from must be one of {DOMAIN_SOURCES}, got {domain_from!r}")
        if is_manifest(path):
            rows = read_manifest(path)
            if split is not None:
                rows = [row for row in rows if row.split == split]
                if not rows:
                    raise UserError(f"no rows with split {split!r} in {path}")
            listed = [(row.path, row.domain, row.label) for row in rows]
        else:
            if split is not None or domain_from == "manifest":
                option = "split" if split is not None else "domain_from = 'manifest'"
                raise UserError(f"dataset.{option} needs a manifest (.csv or .jsonl) path, got {path}")
            listed = [(url, None, None) for url in list_dicom_files(path, extensions)]
        entries = []
        for url, manifest_domain, label in listed:
            if domain_from == "manifest":
                if manifest_domain is None:
                    raise UserError(f"{path}: row {url} has no domain; fill the domain column "
                                    "or use domain_from = 'format'")
                domain = manifest_domain
            elif domain_from == "folder":
                domain = posixpath.basename(posixpath.dirname(url.replace(os.sep, "/"))) or UNKNOWN_DOMAIN
            else:
                domain = FORMATS.get(posixpath.splitext(url)[1].lower(), (UNKNOWN_DOMAIN,))[0]
            entries.append(VendorEntry(url, domain, label))
        return cls(entries, path, **options)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"VendorDataset({len(self)} files from {self.location})"

    def source(self, index: int) -> str:
        return self.entries[index].url

    def domain(self, index: int) -> str:
        return self.entries[index].domain

    def label(self, index: int) -> int | None:
        return self.entries[index].label

    def load(self, index: int) -> Sample:
        entry = self.entries[index]
        return read_vendor_volume(entry.url, domain=entry.domain, label=entry.label,
                                  img_shape=self.img_shape, img_interlaced=self.img_interlaced,
                                  default_spacing=self.default_spacing)

    def domain_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self.entries:
            counts[entry.domain] = counts.get(entry.domain, 0) + 1
        return dict(sorted(counts.items()))
