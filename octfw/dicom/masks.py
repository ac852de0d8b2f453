"""Finding masks: a manifest's ``mask`` column, read as bool ``[D, H, W]``.

A mask is binary (0 or 1 everywhere; True: in the finding) and has its volume's
shape. Three formats, told apart by the file name:

- ``.npy``: a numpy array ``[D, H, W]`` in the volume's own axis order (no pickles).
- ``.nii`` / ``.nii.gz``: NIfTI, read with nibabel. Its data array is indexed
  ``(i, j, k) = (W, H, D)``: i across a B-scan (x), j along the A-scan (y), k over
  the B-scans (z), which is how ITK, SimpleITK (``GetImageFromArray`` of a
  ``[D, H, W]`` array) and 3D Slicer write a volume; it is transposed to
  ``[D, H, W]`` on reading. A mask written straight from a ``[D, H, W]`` numpy
  array (``nib.Nifti1Image(mask, affine)``) comes back reversed, and is refused
  for its shape with that said (unless every side is equal). The affine is not
  read: the mask is on the volume's voxel grid.
- anything else: a DICOM Segmentation (SEG) object with one segment, BINARY or
  FRACTIONAL (above half its maximum is in), its frames the volume's B-scans in
  order (``NumberOfFrames`` = D, ``Rows`` = H, ``Columns`` = W).

Every failure is a :class:`~octfw.display.errors.CorruptFile` naming the mask file.
"""

from __future__ import annotations

import gzip
import io

import numpy as np

from octfw.dicom.files import open_file
from octfw.display.errors import CorruptFile

__all__ = ["SEGMENTATION_SOP_CLASS", "NIFTI_SUFFIXES", "read_finding_mask", "read_layer_labels"]

SEGMENTATION_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.66.4"
NIFTI_SUFFIXES = (".nii", ".nii.gz")


def _read_bytes(url: str, what: str) -> bytes:
    """The bytes of ``url``; a missing or unreadable file is a CorruptFile naming ``what`` it is."""
    try:
        with open_file(url) as f:
            return f.read()
    except FileNotFoundError:
        raise CorruptFile(url, f"{what} not found") from None
    except OSError as exc:
        raise CorruptFile(url, f"{what} cannot be read ({type(exc).__name__})") from None


def read_finding_mask(url: str) -> np.ndarray:
    """The bool ``[D, H, W]`` mask at ``url`` (local path or fsspec URL); see the module docstring."""
    data = _read_bytes(url, "mask file")
    name = url.lower()
    if name.endswith(".npy"):
        array = _numpy(url, data)
    elif name.endswith(NIFTI_SUFFIXES):
        array = _nifti(url, data)
    else:
        array = _segmentation(url, data)
    if array.ndim != 3:
        raise CorruptFile(url, f"a finding mask must be 3-D [D, H, W], got shape {list(array.shape)}")
    if array.dtype == bool:
        return array
    if not np.isin(array, (0, 1)).all():
        values = np.unique(array)[:5].tolist()
        raise CorruptFile(url, f"a finding mask must be binary (0 or 1), found values {values}")
    return array.astype(bool)


def _numpy(url: str, data: bytes) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CorruptFile(url, f"not a numpy .npy array ({type(exc).__name__})") from None


def _nifti(url: str, data: bytes) -> np.ndarray:
    import nibabel

    if data[:2] == b"\x1f\x8b":  # gzip, whatever the suffix says
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise CorruptFile(url, f"damaged gzip data ({type(exc).__name__})") from None
    for image_class in (nibabel.Nifti1Image, nibabel.Nifti2Image):
        try:
            image = image_class.from_bytes(data)
            array = np.asanyarray(image.dataobj)
            break
        except Exception:  # noqa: BLE001 - nibabel raises many kinds; try NIfTI-2, then refuse
            continue
    else:
        raise CorruptFile(url, "not a NIfTI-1 or NIfTI-2 image")
    if array.ndim == 4 and array.shape[3] == 1:  # a 3-D mask stored with a time axis of 1
        array = array[..., 0]
    if array.ndim != 3:
        raise CorruptFile(url, f"a finding mask must be 3-D, got a NIfTI image of shape {list(array.shape)}")
    return np.ascontiguousarray(array.transpose(2, 1, 0))  # (i, j, k) = (W, H, D) -> [D, H, W]


def _segmentation(url: str, data: bytes) -> np.ndarray:
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(io.BytesIO(data))
    except (InvalidDicomError, EOFError, ValueError, TypeError) as exc:
        raise CorruptFile(url, "not a .npy, NIfTI (.nii, .nii.gz) or DICOM SEG mask "
                               f"({type(exc).__name__})") from None
    sop_class = str(ds.get("SOPClassUID", "") or "")
    if sop_class != SEGMENTATION_SOP_CLASS:
        raise CorruptFile(url, f"a DICOM mask must be a Segmentation (SOP class {SEGMENTATION_SOP_CLASS}), "
                               f"got SOP class {sop_class or 'none'}")
    segments = len(ds.get("SegmentSequence", []) or [])
    if segments != 1:
        raise CorruptFile(url, f"the segmentation holds {segments} segments; a finding mask has one")
    try:
        array = np.asarray(ds.pixel_array)
    except Exception as exc:  # noqa: BLE001 - every decoder failure means the same thing
        raise CorruptFile(url, f"cannot decode the segmentation's frames ({type(exc).__name__})") from None
    if array.ndim == 2:  # one frame
        array = array[None]
    if str(ds.get("SegmentationType", "BINARY")).upper() == "FRACTIONAL":
        maximum = float(ds.get("MaximumFractionalValue", 255) or 255)
        return array > maximum / 2
    return array


def read_layer_labels(url: str, names: int) -> np.ndarray:
    """The uint8 ``[D, H, W]`` layer labels at ``url`` (a ``.npy`` array in the volume's own axis
    order, values below ``names``, the count of the manifest's ``layer_names``).

    Every failure is a :class:`~octfw.display.errors.CorruptFile` naming the file: missing,
    unreadable, not ``.npy``, not 3-D, not integer, or a value without a name.
    """
    if not url.lower().endswith(".npy"):
        raise CorruptFile(url, "layer labels must be a numpy .npy array (uint8 [D, H, W])")
    data = _read_bytes(url, "layer label file")
    array = _numpy(url, data)
    if array.ndim != 3:
        raise CorruptFile(url, f"layer labels must be 3-D [D, H, W], got shape {list(array.shape)}")
    if array.dtype.kind not in "ui":
        raise CorruptFile(url, f"layer labels must be integers, got {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) >= names):
        raise CorruptFile(url, f"layer labels must lie in [0, {names}) (one per layer name), found "
                               f"{int(array.min())}..{int(array.max())}")
    return array.astype(np.uint8, copy=False)
