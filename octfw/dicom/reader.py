"""Read and write OCT volumes stored as DICOM.

Writing produces a multi-frame Ophthalmic Tomography Image Storage file, the
format OCT devices and ``oct-converter`` export. Reading accepts any
single-channel multi-frame DICOM that pydicom can decode with the installed
decoders (uncompressed, RLE, JPEG 2000, JPEG-LS, ...), checks it, and returns
a float32 ``[D, H, W]`` :class:`~octfw.types.Sample`.

A single-frame file is a volume only as one B-scan of a series of several
(:func:`read_oct_series`). Read on its own (a lone B-scan, a fundus photo, a
CT slice that strayed into the cohort) it is unusable, with the reason
:data:`SINGLE_FRAME`: resized to the transform's depth it would be one
B-scan repeated, a "volume" with no 3-D structure to learn from.

Every way a file can be unusable raises :class:`~octfw.display.errors.CorruptFile`
with a short reason, so the data pipeline can quarantine it and carry on; no
pydicom exception escapes. Patient identifiers are never read into a sample,
a provenance record or an error message: reasons are written here, from the
file's geometry only, never copied from an exception text.

Files are opened through fsspec, so ``gs://`` and other remote URLs work when
the matching filesystem package (gcsfs, ...) is installed; local paths and
``file://`` URLs are opened directly.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
import threading
import warnings
from typing import IO, Any, Iterator, Mapping, Sequence

import numpy as np

from octfw.display.errors import CorruptFile, OctfwWarning
from octfw.storage.files import is_local, local_path, write_atomically
from octfw.types import Provenance, Sample

__all__ = [
    "OCT_SOP_CLASS_UID",
    "UNKNOWN_DOMAIN",
    "SINGLE_FRAME",
    "SpacingDefaulted",
    "normalise_manufacturer",
    "encode_oct_dicom",
    "write_oct_dicom",
    "write_bytes",
    "open_file",
    "read_oct_volume",
    "read_oct_series",
    "read_header",
]

#: Ophthalmic Tomography Image Storage.
OCT_SOP_CLASS_UID = "1.2.840.10008.5.1.4.1.1.77.1.5.4"
#: Domain of a file whose manufacturer is absent or unreadable.
UNKNOWN_DOMAIN = "unknown"
#: Why a single-frame file (or a series of one) is quarantined.
SINGLE_FRAME = "single-frame 2D image; a 3D OCT volume needs several B-scans"

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

# Patient module keywords write_oct_dicom accepts. They are Type 2 in the
# Patient module, so they are always present, empty unless given.
_PATIENT_KEYWORDS = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex")

_PIXEL_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
# The (7FE0,0010) Pixel Data tag as written in little and big endian files.
_PIXEL_DATA_TAG_LE = b"\xe0\x7f\x10\x00"
_PIXEL_DATA_TAG_BE = b"\x7f\xe0\x00\x10"


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


# --- names and locations --------------------------------------------------


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


# --- writing --------------------------------------------------------------


def encode_oct_dicom(
    volume: np.ndarray,
    spacing: Sequence[float],
    manufacturer: str,
    model_name: str,
    patient: Mapping[str, str] | None = None,
    *,
    uid_entropy: Sequence[str] | None = None,
    transfer_syntax: str = "1.2.840.10008.1.2.1",
) -> bytes:
    """The bytes of an Ophthalmic Tomography Image Storage file for ``volume``.

    ``volume`` is uint16 or uint8 ``[D, H, W]`` (B-scans, axial, lateral),
    stored with as many bits (devices export 8-bit B-scans); ``spacing`` is
    ``(dz, dy, dx)`` in mm. ``patient`` may hold PatientName, PatientID,
    PatientBirthDate and PatientSex. ``uid_entropy`` makes the UIDs, and so
    the whole file, a function of the given strings (same input, same bytes);
    without it the UIDs are random. ``transfer_syntax`` defaults to explicit
    VR little endian; a compressed one needs its encoder installed.
    """
    import pydicom
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import UID, PYDICOM_IMPLEMENTATION_UID, ExplicitVRLittleEndian, generate_uid

    volume = np.asarray(volume)
    if volume.ndim != 3 or volume.dtype not in (np.uint8, np.uint16):
        raise ValueError(f"volume must be uint16 or uint8 [D, H, W], got {volume.dtype} {volume.shape}")
    if len(spacing) != 3 or not all(np.isfinite(s) and s > 0 for s in spacing):
        raise ValueError(f"spacing must be three positive (dz, dy, dx) values in mm, got {spacing!r}")
    patient = dict(patient or {})
    unknown = sorted(set(patient) - set(_PATIENT_KEYWORDS))
    if unknown:
        raise ValueError(f"unknown patient keys {unknown}; allowed: {list(_PATIENT_KEYWORDS)}")

    def uid(role: str) -> UID:
        if uid_entropy is None:
            return generate_uid()
        return generate_uid(entropy_srcs=[*map(str, uid_entropy), role])

    depth, rows, columns = volume.shape
    dz, dy, dx = (float(s) for s in spacing)
    sop_instance_uid = uid("sop")

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = UID(OCT_SOP_CLASS_UID)
    meta.MediaStorageSOPInstanceUID = sop_instance_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID

    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = UID(OCT_SOP_CLASS_UID)
    ds.SOPInstanceUID = sop_instance_uid
    ds.StudyInstanceUID = uid("study")
    ds.SeriesInstanceUID = uid("series")
    ds.FrameOfReferenceUID = uid("frame-of-reference")
    ds.Modality = "OPT"
    ds.ImageType = ["ORIGINAL", "PRIMARY"]
    ds.Manufacturer = manufacturer
    ds.ManufacturerModelName = model_name
    for keyword in _PATIENT_KEYWORDS:
        setattr(ds, keyword, patient.get(keyword, ""))
    # Type 2 study and series attributes: present, empty when unknown.
    for keyword in ("StudyDate", "StudyTime", "StudyID", "AccessionNumber",
                    "ReferringPhysicianName", "ContentDate", "ContentTime"):
        setattr(ds, keyword, "")
    ds.SeriesNumber = 1
    ds.InstanceNumber = 1
    ds.Laterality = ""

    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.NumberOfFrames = depth
    ds.Rows = rows
    ds.Columns = columns
    bits = volume.dtype.itemsize * 8
    ds.BitsAllocated = bits
    ds.BitsStored = bits
    ds.HighBit = bits - 1
    ds.PixelRepresentation = 0
    # Spacing lives in the functional groups for enhanced multi-frame
    # objects; SpacingBetweenSlices is repeated at the top level for readers
    # that only look there.
    measures = Dataset()
    measures.PixelSpacing = [dy, dx]
    measures.SliceThickness = dz
    measures.SpacingBetweenSlices = dz
    shared = Dataset()
    shared.PixelMeasuresSequence = [measures]
    ds.SharedFunctionalGroupsSequence = [shared]
    per_frame = []
    for index in range(depth):
        content = Dataset()
        content.StackID = "1"
        content.InStackPositionNumber = index + 1
        item = Dataset()
        item.FrameContentSequence = [content]
        per_frame.append(item)
    ds.PerFrameFunctionalGroupsSequence = per_frame
    ds.SpacingBetweenSlices = dz
    # Little endian; pydicom writes 8-bit pixels as OB, padded to even length.
    ds.PixelData = np.ascontiguousarray(volume, dtype=volume.dtype.newbyteorder("<")).tobytes()

    if UID(transfer_syntax) != ExplicitVRLittleEndian:
        ds.compress(transfer_syntax, generate_instance_uid=False)

    buffer = io.BytesIO()
    pydicom.dcmwrite(buffer, ds, enforce_file_format=True)
    return buffer.getvalue()


def write_oct_dicom(path: str | os.PathLike[str], volume: np.ndarray, *args: Any, **kwargs: Any) -> str:
    """Write ``volume`` as an OCT DICOM file at ``path`` (local or fsspec URL).

    The other arguments are :func:`encode_oct_dicom`'s. Returns ``path`` as a string.
    """
    url = os.fspath(path)
    write_bytes(url, encode_oct_dicom(volume, *args, **kwargs))
    return url


# --- reading --------------------------------------------------------------

# warnings.catch_warnings() is not thread-safe before Python 3.14: it saves the
# process-wide warnings.filters on entry and puts that list back on exit. The
# header threads of octfw.dicom.dataset interleave, so one thread saves
# the list another has just extended with "ignore" and restores it after that
# one has left: "ignore all warnings" stays installed for the rest of the
# process and silences every later warning (SpacingDefaulted, the prepared
# cache's "cannot write", ...). Hence one silencing thread at a time.
_QUIET_LOCK = threading.RLock()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence warnings (pydicom's) in a block, safely from several threads."""
    with _QUIET_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _read_dataset(url: str, fs: Any, stop_before_pixels: bool) -> tuple[Any, bytes | None]:
    """The parsed dataset and, for a full read, the file's bytes.

    Raises CorruptFile. pydicom's warnings are silenced because every check
    they stand for is made here, with a clearer reason.
    """
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        if stop_before_pixels and fs is None and not is_local(url):
            head = _remote_head(url)  # network I/O outside _quiet(), so threads overlap it
            with _quiet():
                return pydicom.dcmread(io.BytesIO(head), stop_before_pixels=True), None
        with open_file(url, fs) as f:
            if stop_before_pixels:
                with _quiet():
                    return pydicom.dcmread(f, stop_before_pixels=True), None
            # One read of the whole file: remote files arrive in one request,
            # and the bytes tell a truncated file from one without pixels.
            raw = f.read()
        with _quiet():
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
        if len(data) < length or _PIXEL_DATA_TAG_LE in data or _PIXEL_DATA_TAG_BE in data:
            return data
        length *= 4


def read_header(url: str | os.PathLike[str], fs: Any = None) -> dict[str, Any]:
    """Cheap header facts for domain lookup, without reading pixel data.

    Returns ``manufacturer``, ``model_name``, ``domain``, ``modality``,
    ``sop_class_uid``, ``transfer_syntax``, ``number_of_frames``, ``rows``
    and ``columns``. Never any patient attribute. Raises CorruptFile.
    """
    url = os.fspath(url)
    ds, _ = _read_dataset(url, fs, stop_before_pixels=True)
    try:
        with _quiet():
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
        "series_key": _series_key(ds),
    }


def _series_key(ds: Any) -> str:
    """A short hash of the SeriesInstanceUID ('' when absent), for grouping
    single-frame files. Hashed because a UID can be looked up in the
    hospital's systems; the UID itself is never kept."""
    import hashlib

    uid = str(ds.get("SeriesInstanceUID", "") or "").strip()
    return hashlib.sha256(uid.encode("ascii", "replace")).hexdigest()[:16] if uid else ""


def read_oct_volume(
    url_or_path: str | os.PathLike[str],
    fs: Any = None,
    *,
    domain: str | None = None,
    label: int | None = None,
) -> Sample:
    """Read one OCT volume: float32 ``[D, H, W]`` plus provenance.

    ``fs`` is an optional fsspec filesystem to open ``url_or_path`` with.
    ``domain`` overrides the domain taken from the Manufacturer (a manifest's
    or folder's domain); ``label`` is carried into the provenance.
    A header without spacing gets 1.0 mm on the missing axes and a
    :class:`SpacingDefaulted` warning. Raises CorruptFile for any unusable file.
    """
    url = os.fspath(url_or_path)
    ds, raw = _read_dataset(url, fs, stop_before_pixels=False)
    try:
        with _quiet():  # malformed values fail below, with a reason
            volume = _decode_volume(url, ds, raw)
            spacing, missing = _spacing(ds)
            manufacturer = ds.get("Manufacturer", "")
    except CorruptFile:
        raise
    except Exception as exc:  # noqa: BLE001 - no pydicom error escapes as anything else
        raise CorruptFile(url, f"unreadable DICOM ({type(exc).__name__})") from exc
    domain = domain if domain is not None else normalise_manufacturer(manufacturer)
    if missing:
        warnings.warn(SpacingDefaulted(url, domain, missing), stacklevel=2)
    provenance = Provenance(
        source=url,
        domain=domain,
        spacing=spacing,
        original_shape=tuple(int(n) for n in volume.shape),
        label=label,
    )
    return Sample(volume=volume, provenance=provenance)


def read_oct_series(
    urls: Sequence[str],
    source: str,
    fs: Any = None,
    *,
    domain: str | None = None,
    label: int | None = None,
) -> Sample:
    """Read a series of single-frame files (one B-scan each) as one volume.

    ``source`` names the series (its folder URL) in the provenance and in
    every error. Each file must hold one grayscale frame of the same Rows x
    Columns, from the same SeriesInstanceUID; one unusable frame makes the
    whole series unusable (a volume with a hole is not a volume). Frames
    are ordered by InstanceNumber when every file has a distinct one, else
    by ImagePositionPatient along the slice normal, else by URL. Spacing:
    PixelSpacing of the first frame; between frames SpacingBetweenSlices or
    SliceThickness, else the median distance between consecutive
    ImagePositionPatient. Raises CorruptFile (with ``source`` as its URL).
    """
    if len(urls) == 0:
        raise CorruptFile(source, "empty series: no files")
    if len(urls) == 1:
        raise CorruptFile(source, SINGLE_FRAME)
    frames = []
    for url in urls:
        name = url.rsplit("/", 1)[-1]
        try:
            ds, raw = _read_dataset(url, fs, stop_before_pixels=False)
            with _quiet():
                count = int(ds.get("NumberOfFrames") or 1)
                if count != 1:
                    raise CorruptFile(url, f"{count} frames; a file of a series holds one B-scan")
                pixels = _decode_volume(url, ds, raw, frame_of_series=True)
                frames.append({
                    "url": url,
                    "pixels": pixels[0],
                    "series": _series_key(ds),
                    "instance": _int_or_none(ds.get("InstanceNumber")),
                    "position": _floats(ds.get("ImagePositionPatient"), 3),
                    "orientation": _floats(ds.get("ImageOrientationPatient"), 6),
                    "spacing": _spacing(ds),
                    "manufacturer": str(ds.get("Manufacturer", "") or ""),
                })
        except CorruptFile as bad:
            raise CorruptFile(source, f"frame {name}: {bad.reason}") from None
        except Exception as exc:  # noqa: BLE001 - no pydicom error escapes as anything else
            raise CorruptFile(source, f"frame {name}: unreadable DICOM ({type(exc).__name__})") from exc

    if len({f["series"] for f in frames}) > 1:
        raise CorruptFile(source, "files from more than one series (SeriesInstanceUID differs)")
    shapes = sorted({f["pixels"].shape for f in frames})
    if len(shapes) > 1:
        raise CorruptFile(source, f"frames differ in size: {[list(s) for s in shapes]}")
    frames = _order_frames(frames)
    volume = np.stack([f["pixels"] for f in frames])
    _check_not_constant(source, volume)

    (dz, dy, dx), missing = frames[0]["spacing"]
    if "slice spacing" in missing:
        gap = _position_gap(frames)
        if gap is not None:
            dz = gap
            missing = [m for m in missing if m != "slice spacing"]
    domain = domain if domain is not None else normalise_manufacturer(frames[0]["manufacturer"])
    if missing:
        warnings.warn(SpacingDefaulted(source, domain, missing), stacklevel=2)
    provenance = Provenance(
        source=source,
        domain=domain,
        spacing=(dz, dy, dx),
        original_shape=tuple(int(n) for n in volume.shape),
        label=label,
    )
    return Sample(volume=volume, provenance=provenance)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None and str(value).strip() != "" else None
    except (TypeError, ValueError):
        return None


def _floats(value: Any, count: int) -> tuple[float, ...] | None:
    try:
        numbers = tuple(float(v) for v in value) if value is not None else ()
    except (TypeError, ValueError):
        return None
    return numbers if len(numbers) == count and all(np.isfinite(numbers)) else None


def _normal(frame: dict[str, Any]) -> np.ndarray:
    orientation = frame["orientation"]
    if orientation is None:
        return np.array([0.0, 0.0, 1.0])
    row, column = np.array(orientation[:3]), np.array(orientation[3:])
    return np.cross(row, column)


def _order_frames(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    instances = [f["instance"] for f in frames]
    if None not in instances and len(set(instances)) == len(instances):
        return sorted(frames, key=lambda f: f["instance"])
    if all(f["position"] is not None for f in frames):
        normal = _normal(frames[0])
        along = [float(np.dot(f["position"], normal)) for f in frames]
        if len(set(along)) == len(along):
            return [f for _, f in sorted(zip(along, frames), key=lambda pair: pair[0])]
    return sorted(frames, key=lambda f: f["url"])


def _position_gap(frames: list[dict[str, Any]]) -> float | None:
    """Median distance between consecutive frames along the normal, or None."""
    if len(frames) < 2 or any(f["position"] is None for f in frames):
        return None
    normal = _normal(frames[0])
    along = np.array([float(np.dot(f["position"], normal)) for f in frames])
    gap = float(np.median(np.abs(np.diff(along))))
    return gap if np.isfinite(gap) and gap > 0 else None


def _decode_volume(url: str, ds: Any, raw: bytes, *, frame_of_series: bool = False) -> np.ndarray:
    """Validate the pixel module, decode, and return float32 [D, H, W].

    ``frame_of_series``: the file is one B-scan of a series of single-frame
    files; any grayscale 2-D image is accepted and its constancy is checked
    on the whole series instead.
    """
    keyword = next((k for k in _PIXEL_KEYWORDS if k in ds), None)
    if keyword is None:
        # pydicom drops an element the file ends inside of (compressed pixel
        # data cut short); its tag in the bytes tells truncation from absence.
        if _PIXEL_DATA_TAG_LE in raw or _PIXEL_DATA_TAG_BE in raw:
            raise CorruptFile(url, "truncated file: it ends inside the pixel data")
        raise CorruptFile(url, "no PixelData element")
    rows, columns = int(ds.get("Rows") or 0), int(ds.get("Columns") or 0)
    frames = int(ds.get("NumberOfFrames") or 1)
    samples = int(ds.get("SamplesPerPixel") or 1)
    if samples != 1:
        raise CorruptFile(url, f"{samples} samples per pixel; expected a grayscale image")
    if rows < 2 or columns < 2 or frames < 1:
        raise CorruptFile(url, f"wrong dimensions: {frames} frames of {rows} x {columns}")
    if frames == 1 and not frame_of_series:
        raise CorruptFile(url, SINGLE_FRAME)  # before decoding: nothing to learn from it

    meta = getattr(ds, "file_meta", None)
    transfer_syntax = meta.get("TransferSyntaxUID") if meta is not None else None
    if transfer_syntax is not None and transfer_syntax.is_encapsulated:
        _check_encapsulated(url, ds, frames)
        _check_decoder(url, transfer_syntax)
    else:
        _check_native_length(url, ds, keyword, frames, rows, columns)

    try:
        array = ds.pixel_array
    except Exception as exc:  # noqa: BLE001 - every decoder failure means the same thing
        name = transfer_syntax.name if transfer_syntax is not None else "unknown transfer syntax"
        raise CorruptFile(url, f"cannot decode pixel data ({name}, {type(exc).__name__})") from exc

    if frames == 1 and array.ndim == 2:  # one B-scan of a series
        array = array[np.newaxis]
    if array.ndim != 3:
        raise CorruptFile(url, f"decoded to shape {tuple(array.shape)}; expected 3-D [D, H, W]")
    if array.shape[0] != frames:
        raise CorruptFile(
            url, f"frame count mismatch: NumberOfFrames is {frames}, decoded {array.shape[0]}"
        )
    if min(array.shape[1:]) < 2 or (array.shape[0] < 2 and not frame_of_series):
        raise CorruptFile(url, f"wrong dimensions: shape {tuple(array.shape)} has an axis < 2")

    volume = array.astype(np.float32, copy=False)
    if not np.isfinite(volume).all():
        bad = int(np.size(volume) - np.count_nonzero(np.isfinite(volume)))
        raise CorruptFile(url, f"{bad} non-finite voxels")
    if not frame_of_series:
        _check_not_constant(url, volume)
    return volume


def _check_not_constant(url: str, volume: np.ndarray) -> None:
    low, high = float(volume.min()), float(volume.max())
    if low == high:
        raise CorruptFile(url, f"constant volume (every voxel is {low:g})")


def _check_native_length(url: str, ds: Any, keyword: str, frames: int, rows: int, columns: int) -> None:
    """Catch truncated files and frame counts that disagree with the data.

    pydicom reads a truncated file without complaint and returns a short
    PixelData value, so the length is checked against the header here.
    """
    bits = int(ds.get("BitsAllocated") or 0)
    if keyword == "FloatPixelData":
        bits = 32
    elif keyword == "DoubleFloatPixelData":
        bits = 64
    if bits not in (1, 8, 16, 32, 64):
        raise CorruptFile(url, f"unsupported BitsAllocated {bits}")
    actual = len(ds[keyword].value)
    if bits == 1:
        expected = (frames * rows * columns + 7) // 8
        frame_bits = rows * columns
        have_frames = actual * 8 // frame_bits
    else:
        frame_bytes = rows * columns * bits // 8
        expected = frames * frame_bytes
        have_frames = actual // frame_bytes
    if actual < expected:
        if bits != 1 and actual % frame_bytes == 0:
            raise CorruptFile(
                url,
                f"frame count mismatch: NumberOfFrames is {frames}, pixel data holds "
                f"{have_frames} (wrong header or a file cut at a frame boundary)",
            )
        raise CorruptFile(url, f"truncated pixel data: {actual} of {expected} bytes")
    if have_frames > frames:
        raise CorruptFile(
            url, f"frame count mismatch: NumberOfFrames is {frames}, pixel data holds {have_frames}"
        )


def _check_encapsulated(url: str, ds: Any, frames: int) -> None:
    """Count the compressed fragments before decoding: a truncated file or a
    wrong NumberOfFrames shows up here with a clearer reason than a decoder's."""
    from pydicom.encaps import parse_basic_offsets, parse_fragments

    data = ds.PixelData
    try:
        offsets = parse_basic_offsets(data)
        (table_length,) = struct.unpack("<I", data[4:8])
        fragments, _positions = parse_fragments(data[8 + table_length:])
    except Exception as exc:  # noqa: BLE001
        raise CorruptFile(url, f"truncated or malformed compressed pixel data ({type(exc).__name__})") from exc
    if offsets and len(offsets) != frames:
        raise CorruptFile(
            url, f"frame count mismatch: NumberOfFrames is {frames}, offset table lists {len(offsets)}"
        )
    if fragments < frames:
        raise CorruptFile(
            url, f"frame count mismatch: NumberOfFrames is {frames}, pixel data holds {fragments} fragments"
        )


def _check_decoder(url: str, transfer_syntax: Any) -> None:
    from pydicom.pixels import get_decoder

    try:
        decoder = get_decoder(transfer_syntax)
    except NotImplementedError:
        raise CorruptFile(url, f"unsupported transfer syntax {transfer_syntax}") from None
    if not decoder.is_available:
        raise CorruptFile(
            url, f"no installed decoder for {transfer_syntax.name} (install octfw[codecs])"
        )


def _positive_float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if np.isfinite(number) and number > 0 else None


def _spacing(ds: Any) -> tuple[tuple[float, float, float], list[str]]:
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
