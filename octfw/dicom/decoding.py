"""Decoding one OCT DICOM file into a checked float32 volume.

Reading accepts any single-channel multi-frame DICOM that pydicom can decode
with the installed decoders (uncompressed, RLE, JPEG 2000, JPEG-LS, ...),
checks it, and returns a float32 ``[D, H, W]`` :class:`~octfw.types.Sample`
(:func:`read_oct_volume`); :func:`decode_volume` is the pixel checking and
decoding that the series reader (:mod:`octfw.dicom.series`) shares.

A single-frame file is a volume only as one B-scan of a series of several
(:func:`octfw.dicom.series.read_oct_series`). Read on its own (a lone B-scan,
a fundus photo, a CT slice that strayed into the cohort) it is unusable, with
the reason :data:`SINGLE_FRAME`: resized to the transform's depth it would be
one B-scan repeated, a "volume" with no 3-D structure to learn from.

Every way a file can be unusable raises :class:`~octfw.display.errors.CorruptFile`
with a short reason, so the data pipeline can quarantine it and carry on; no
pydicom exception escapes. Patient identifiers are never read into a sample,
a provenance record or an error message: reasons are written here, from the
file's geometry only, never copied from an exception text.
"""

from __future__ import annotations

import os
import struct
import warnings
from typing import Any

import numpy as np

from octfw.dicom.header import (
    SpacingDefaulted,
    has_pixel_data_tag,
    normalise_manufacturer,
    read_dataset,
    silenced_warnings,
    voxel_spacing,
)
from octfw.display.errors import CorruptFile
from octfw.types import Provenance, Sample

__all__ = ["SINGLE_FRAME", "read_oct_volume", "decode_volume", "check_not_constant"]

#: Why a single-frame file (or a series of one) is quarantined.
SINGLE_FRAME = "single-frame 2D image; a 3D OCT volume needs several B-scans"

_PIXEL_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")


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
    ds, raw = read_dataset(url, fs, stop_before_pixels=False)
    try:
        with silenced_warnings():  # malformed values fail below, with a reason
            volume = decode_volume(url, ds, raw)
            spacing, missing = voxel_spacing(ds)
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



def decode_volume(url: str, ds: Any, raw: bytes, *, frame_of_series: bool = False) -> np.ndarray:
    """Validate the pixel module, decode, and return float32 [D, H, W].

    ``frame_of_series``: the file is one B-scan of a series of single-frame
    files; any grayscale 2-D image is accepted and its constancy is checked
    on the whole series instead.
    """
    keyword = next((k for k in _PIXEL_KEYWORDS if k in ds), None)
    if keyword is None:
        # pydicom drops an element the file ends inside of (compressed pixel
        # data cut short); its tag in the bytes tells truncation from absence.
        if has_pixel_data_tag(raw):
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
        check_not_constant(url, volume)
    return volume


def check_not_constant(url: str, volume: np.ndarray) -> None:
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

