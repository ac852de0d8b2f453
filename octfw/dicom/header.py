"""A DICOM file parsed, and the facts of its header: domain, series, voxel spacing.

:func:`read_dataset` is the one parse every reader shares: every way a file
can fail to parse raises :class:`~octfw.display.errors.CorruptFile` with a
short reason, written here, never copied from a pydicom exception's text.
:func:`read_header` answers a file's domain and geometry without its pixels;
:func:`voxel_spacing` finds a volume's spacing wherever its header keeps it
(:class:`SpacingDefaulted` when it does not). No patient attribute is ever
read into what these return.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
import warnings
from typing import Any, Iterator, Sequence

import numpy as np

from octfw.dicom.files import open_file
from octfw.display.errors import CorruptFile, OctfwWarning
from octfw.storage.files import is_local

__all__ = [
    "UNKNOWN_DOMAIN",
    "SpacingDefaulted",
    "normalise_manufacturer",
    "read_header",
    "read_dataset",
    "silenced_warnings",
    "has_pixel_data_tag",
    "series_key",
    "voxel_spacing",
]

#: Domain of a file whose manufacturer is absent or unreadable.
UNKNOWN_DOMAIN = "unknown"

# Substring of the lower-cased Manufacturer -> domain. Vendors write their
# names many ways ("Heidelberg Engineering", "HEIDELBERG", "Carl Zeiss
# Meditec", "TOPCON Corporation"); a domain must not split over spelling.
_VENDORS: tuple[tuple[str, str], ...] = (
    ("heidelberg", "heidelberg"),
    ("topcon", "topcon"),
    ("zeiss", "zeiss"),
    ("optovue", "optovue"),
    ("nidek", "nidek"),
    ("canon", "canon"),
    ("optos", "optos"),
    ("tomey", "tomey"),
    ("bioptigen", "bioptigen"),
)

# The (7FE0,0010) Pixel Data tag as written in little and big endian files.
_PIXEL_DATA_TAG_LE = b"\xe0\x7f\x10\x00"
_PIXEL_DATA_TAG_BE = b"\x7f\xe0\x00\x10"


def normalise_manufacturer(manufacturer: str | None) -> str:
    """The domain name for a DICOM Manufacturer value.

    Known vendors map to one short name (``"Heidelberg Engineering"`` ->
    ``"heidelberg"``); others become a lower-case slug (``"GE MEDICAL
    SYSTEMS"`` -> ``"ge-medical-systems"``); an empty value is ``"unknown"``.
    """
    text = str(manufacturer or "").strip().lower()
    for needle, domain in _VENDORS:
        if needle in text:
            return domain
    slug = re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:40].strip("-")
    return slug or UNKNOWN_DOMAIN


# warnings.catch_warnings() is not thread-safe before Python 3.14: it saves the
# process-wide warnings.filters on entry and puts that list back on exit. The
# header threads of octfw.dicom.dataset interleave, so one thread saves
# the list another has just extended with "ignore" and restores it after that
# one has left: "ignore all warnings" stays installed for the rest of the
# process and silences every later warning (SpacingDefaulted, the prepared
# cache's "cannot write", ...). Hence one silencing thread at a time.
_SILENCING_LOCK = threading.RLock()


@contextlib.contextmanager
def silenced_warnings() -> Iterator[None]:
    """Silence warnings (pydicom's) in a block, safely from several threads."""
    with _SILENCING_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def read_dataset(url: str, fs: Any, stop_before_pixels: bool) -> tuple[Any, bytes | None]:
    """The parsed dataset and, for a full read, the file's bytes.

    Raises CorruptFile. pydicom's warnings are silenced because every check
    they stand for is made here, with a clearer reason.
    """
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        if stop_before_pixels and fs is None and not is_local(url):
            head = _remote_head(url)  # network I/O outside silenced_warnings(), so threads overlap it
            with silenced_warnings():
                return pydicom.dcmread(io.BytesIO(head), stop_before_pixels=True), None
        with open_file(url, fs) as f:
            if stop_before_pixels:
                with silenced_warnings():
                    return pydicom.dcmread(f, stop_before_pixels=True), None
            # One read of the whole file: remote files arrive in one request,
            # and the bytes tell a truncated file from one without pixels.
            raw = f.read()
        with silenced_warnings():
            return pydicom.dcmread(io.BytesIO(raw)), raw
    except FileNotFoundError:
        raise CorruptFile(url, "file not found") from None
    except InvalidDicomError:
        raise CorruptFile(url, "not a DICOM file (no DICM preamble)") from None
    except OSError as exc:
        raise CorruptFile(url, f"cannot read the file ({type(exc).__name__})") from exc
    except Exception as exc:  # noqa: BLE001 - any parser failure means an unusable file
        raise CorruptFile(url, f"unreadable DICOM header ({type(exc).__name__})") from exc


_HEAD_BYTES = 64 * 1024


def _remote_head(url: str) -> bytes:
    """The start of a remote file, up to and including its Pixel Data tag.

    Range requests instead of a file object: a partly read gcsfs file makes
    its background prefetcher wait seconds at close, and a header is a small
    prefix of the object. The range grows until the tag (or the end) is in it.
    """
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(url)
    length = _HEAD_BYTES
    while True:
        data = filesystem.cat_file(path, start=0, end=length)
        if len(data) < length or has_pixel_data_tag(data):
            return data
        length *= 4


def has_pixel_data_tag(data: bytes) -> bool:
    """Whether ``data`` holds the (7FE0,0010) Pixel Data tag, in either byte order."""
    return _PIXEL_DATA_TAG_LE in data or _PIXEL_DATA_TAG_BE in data


def read_header(url: str | os.PathLike[str], fs: Any = None) -> dict[str, Any]:
    """Cheap header facts for domain lookup, without reading pixel data.

    Returns ``manufacturer``, ``model_name``, ``domain``, ``modality``,
    ``sop_class_uid``, ``transfer_syntax``, ``number_of_frames``, ``rows``
    and ``columns``. Never any patient attribute. Raises CorruptFile.
    """
    url = os.fspath(url)
    ds, _ = read_dataset(url, fs, stop_before_pixels=True)
    try:
        with silenced_warnings():
            return _header_facts(ds)
    except Exception as exc:  # noqa: BLE001 - a malformed value is a corrupt header
        raise CorruptFile(url, f"malformed header value ({type(exc).__name__})") from exc


def _header_facts(ds: Any) -> dict[str, Any]:
    meta = getattr(ds, "file_meta", None)
    manufacturer = str(ds.get("Manufacturer", "") or "")
    return {
        "manufacturer": manufacturer,
        "model_name": str(ds.get("ManufacturerModelName", "") or ""),
        "domain": normalise_manufacturer(manufacturer),
        "modality": str(ds.get("Modality", "") or ""),
        "sop_class_uid": str(ds.get("SOPClassUID", "") or ""),
        "transfer_syntax": str(meta.get("TransferSyntaxUID", "") if meta else ""),
        "number_of_frames": int(ds.get("NumberOfFrames") or 1),
        "rows": int(ds.get("Rows") or 0),
        "columns": int(ds.get("Columns") or 0),
        "series_key": series_key(ds),
    }


def series_key(ds: Any) -> str:
    """A short hash of the SeriesInstanceUID ('' when absent), for grouping
    single-frame files. Hashed because a UID can be looked up in the
    hospital's systems; the UID itself is never kept."""
    import hashlib

    uid = str(ds.get("SeriesInstanceUID", "") or "").strip()
    return hashlib.sha256(uid.encode("ascii", "replace")).hexdigest()[:16] if uid else ""


class SpacingDefaulted(OctfwWarning):
    """A volume's header lacks (part of) its voxel spacing; 1.0 mm was used.

    The message names the domain, not the file, so Python's warning filters
    show it once per domain rather than once per file of a large cohort;
    ``url`` and ``missing`` say which file and which values.
    """

    def __init__(self, url: str, domain: str, missing: Sequence[str]):
        self.url = url
        self.domain = domain
        self.missing = tuple(missing)
        super().__init__(
            f"{domain} volumes lack {' and '.join(self.missing)} in their DICOM header; "
            "using 1.0 mm"
        )


def _positive_float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if np.isfinite(number) and number > 0 else None


def voxel_spacing(ds: Any) -> tuple[tuple[float, float, float], list[str]]:
    """(dz, dy, dx) in mm and the names of the values that were missing.

    Sources in order: shared functional groups, the first per-frame group,
    then the top-level attributes. Between B-scans, SpacingBetweenSlices (the
    distance between scan centres) is preferred over SliceThickness.
    """
    sources = []
    for group in ("SharedFunctionalGroupsSequence", "PerFrameFunctionalGroupsSequence"):
        items = ds.get(group) or []
        if items and "PixelMeasuresSequence" in items[0] and items[0].PixelMeasuresSequence:
            sources.append(items[0].PixelMeasuresSequence[0])
    sources.append(ds)

    dy = dx = dz = None
    for source in sources:
        if dy is None:
            pixel_spacing = source.get("PixelSpacing")
            if pixel_spacing is not None and len(pixel_spacing) == 2:
                row, column = (_positive_float(v) for v in pixel_spacing)
                if row is not None and column is not None:
                    dy, dx = row, column
        if dz is None:
            dz = _positive_float(source.get("SpacingBetweenSlices"))
            if dz is None:
                dz = _positive_float(source.get("SliceThickness"))
    missing = []
    if dz is None:
        missing.append("slice spacing")
    if dy is None:
        missing.append("pixel spacing")
    return (dz or 1.0, dy or 1.0, dx or 1.0), missing
