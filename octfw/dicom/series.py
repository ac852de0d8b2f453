"""Assembling one OCT volume from a series of single-frame DICOM files, one B-scan each.

OCT devices and PACS exports often store a volume as one file per B-scan;
:class:`~octfw.dicom.dataset.DicomDataset` groups them by folder and
SeriesInstanceUID, and :func:`read_oct_series` decodes every frame (through
:func:`octfw.dicom.decoding.decode_volume`), puts them in order and finds
the spacing between them. One unusable frame makes the series unusable, as
a :class:`~octfw.display.errors.CorruptFile` naming the series and the frame.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from octfw.dicom.decoding import SINGLE_FRAME, check_not_constant, decode_volume
from octfw.dicom.header import (
    SpacingDefaulted,
    normalise_manufacturer,
    read_dataset,
    series_key,
    silenced_warnings,
    voxel_spacing,
)
from octfw.display.errors import CorruptFile
from octfw.types import Provenance, Sample

__all__ = ["read_oct_series"]


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
            ds, raw = read_dataset(url, fs, stop_before_pixels=False)
            with silenced_warnings():
                count = int(ds.get("NumberOfFrames") or 1)
                if count != 1:
                    raise CorruptFile(url, f"{count} frames; a file of a series holds one B-scan")
                pixels = decode_volume(url, ds, raw, frame_of_series=True)
                frames.append({
                    "url": url,
                    "pixels": pixels[0],
                    "series": series_key(ds),
                    "instance": _int_or_none(ds.get("InstanceNumber")),
                    "position": _floats(ds.get("ImagePositionPatient"), 3),
                    "orientation": _floats(ds.get("ImageOrientationPatient"), 6),
                    "spacing": voxel_spacing(ds),
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
    check_not_constant(source, volume)

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
