"""Encoding an OCT volume as DICOM, and writing it.

Writing produces a multi-frame Ophthalmic Tomography Image Storage file, the
format OCT devices and ``oct-converter`` export (:func:`encode_oct_dicom`,
:func:`write_oct_dicom`); :mod:`octfw.dicom.decoding` reads it back.
"""

from __future__ import annotations

import io
import os
from typing import Any, Mapping, Sequence

import numpy as np

from octfw.dicom.files import write_bytes

__all__ = ["OCT_SOP_CLASS_UID", "encode_oct_dicom", "write_oct_dicom"]

#: Ophthalmic Tomography Image Storage.
OCT_SOP_CLASS_UID = "1.2.840.10008.5.1.4.1.1.77.1.5.4"

# Patient module keywords write_oct_dicom accepts. They are Type 2 in the
# Patient module, so they are always present, empty unless given.
_PATIENT_KEYWORDS = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex")


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
