"""Config of the ``oct-vendor`` component (light: attrs only).

Validating a recipe imports it and nothing heavier; the implementation
reads it, and the package's ``__init__`` (:mod:`octfw.plugins.datasets.vendor`) registers it
and holds the factory.
"""

from __future__ import annotations

import posixpath
from typing import Any

import attrs

from octfw.recipe.fields import Location, choices, doc, length, positive

__all__ = ["FORMATS", "VENDOR_EXTENSIONS", "DOMAIN_SOURCES", "OctVendorConfig"]

#: File suffix -> (domain, oct-converter reader class, format name).
FORMATS: dict[str, tuple[str, str, str]] = {
    ".e2e": ("heidelberg", "E2E", "Heidelberg E2E"),
    ".fds": ("topcon", "FDS", "Topcon FDS"),
    ".fda": ("topcon", "FDA", "Topcon FDA"),
    ".img": ("zeiss", "IMG", "Zeiss IMG"),
    ".oct": ("bioptigen", "BOCT", "Bioptigen OCT"),
}
#: The suffixes of the raw vendor formats (lower case).
VENDOR_EXTENSIONS: tuple[str, ...] = tuple(FORMATS)
DOMAIN_SOURCES = ("format", "folder", "manifest")

_each_positive = attrs.validators.deep_iterable(member_validator=positive)


def _extensions(instance: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("must list at least one extension")
    unknown = [e for e in value if e.lower() not in VENDOR_EXTENSIONS]
    if unknown:
        raise ValueError(f"unknown vendor extensions {unknown!r}; known: {list(VENDOR_EXTENSIONS)!r}")


@attrs.frozen
class OctVendorConfig:
    path: Location = doc(
        "Folder (searched recursively), glob, or manifest .csv/.jsonl of vendor files; "
        "local path or URL (gs://...)."
    )
    split: str | None = doc(
        "Keep only manifest rows of this split (needs a manifest); unset: all rows.",
        default=None,
    )
    domain_from: str = doc(
        "Where a volume's domain comes from: 'format' (.e2e heidelberg, .fds/.fda topcon, "
        ".img zeiss, .oct bioptigen), 'folder' (the parent folder's name) or 'manifest'.",
        default="format",
        validator=choices(*DOMAIN_SOURCES),
    )
    extensions: tuple[str, ...] = doc(
        "File name endings a folder listing keeps (case-insensitive).",
        default=VENDOR_EXTENSIONS,
        validator=_extensions,
    )
    img_shape: tuple[int, int] = doc(
        "Zeiss .img only: [rows, cols] of one B-scan (the file does not record it).",
        default=(1024, 512),
        validator=[length(2), _each_positive],
    )
    img_interlaced: bool = doc("Zeiss .img only: the B-scans are interlaced.", default=False)
    default_spacing: tuple[float, float, float] | None = doc(
        "[dz, dy, dx] mm for the axes a file does not record: all three for Zeiss .img and "
        "Bioptigen .OCT, dz and dx for Heidelberg .e2e (Topcon records all); "
        "unset: 1.0 mm with a warning.",
        default=None,
        validator=attrs.validators.optional([length(3), _each_positive]),
    )

    @classmethod
    def recognises(cls, fs: Any, path: str) -> bool:
        """A file with a vendor suffix (:class:`octfw.types.RecognisingDatasetConfig`)."""
        return posixpath.splitext(path)[1].lower() in VENDOR_EXTENSIONS
