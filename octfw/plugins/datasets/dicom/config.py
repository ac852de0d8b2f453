"""Config of the ``dicom`` component (light: attrs only).

Validating a recipe imports it and nothing heavier; the implementation
reads it, and the package's ``__init__`` (:mod:`octfw.plugins.datasets.dicom`) registers it
and holds the factory.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import Location, choices, doc


def _extensions(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("must list at least one extension (\"\" for files without one)")
    bad = [e for e in value if e and not e.startswith(".")]
    if bad:
        raise ValueError(f"extensions start with '.' (or are \"\" for none), got {bad!r}")


@attrs.frozen
class DicomConfig:
    path: Location = doc(
        "Folder (searched recursively), glob, or manifest .csv/.jsonl with columns "
        "path and optional domain, split, label, patient (evaluation splits keep a patient's volumes "
        "on one side), mask (the volume's binary finding mask for dense-probe: .npy, NIfTI .nii/.nii.gz "
        "or DICOM SEG, relative to the manifest like path); local path or URL (gs://...)."
    )
    split: str | None = doc(
        "Keep only manifest rows of this split (needs a manifest); unset: all rows.",
        default=None,
    )
    domain_from: str = doc(
        "Where a volume's domain comes from: 'header' (DICOM Manufacturer), "
        "'manifest' (its domain column) or 'folder' (the parent folder's name).",
        default="header",
        validator=choices("header", "manifest", "folder"),
    )
    extensions: tuple[str, ...] = doc(
        "File name endings a folder listing keeps; \"\" keeps names without one "
        "(including UID-style names such as 1.2.840.113619.2.55).",
        default=(".dcm", ""),
        validator=_extensions,
    )
    series: bool = doc(
        "Read single-frame files that share a SeriesInstanceUID in one folder as one "
        "volume (reads every header when the dataset is built); false: each file is a volume "
        "(a single-frame file alone is quarantined: one B-scan is no 3D volume).",
        default=True,
    )
