"""A map-style dataset of OCT DICOM volumes on any fsspec filesystem.

The files are listed once, when the dataset is built: from a folder (walked
recursively), a glob, or a manifest. ``load`` reads one file with
:func:`octfw.data.dicom_io.read_oct_volume` and raises
:class:`~octfw.errors.CorruptFile` for an unusable one. ``domain`` answers
without decoding pixels: from the manifest, the parent folder's name, or the
file's header (read once, then remembered).

The object holds only strings and small records, so it pickles into
data-loader workers; each worker opens files itself.
"""

from __future__ import annotations

import os
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import attrs

from octfw.data.dicom_io import UNKNOWN_DOMAIN, read_header, read_oct_volume
from octfw.data.manifest import is_manifest, read_manifest
from octfw.errors import CorruptFile, UserError
from octfw.types import Sample

__all__ = ["DOMAIN_SOURCES", "DicomEntry", "DicomDataset", "list_dicom_files"]

DOMAIN_SOURCES = ("header", "manifest", "folder")
_GLOB_CHARS = re.compile(r"[*?\[]")
# Files a folder of DICOMs holds that are not images.
_NOT_IMAGES = {"dicomdir"}
# Header reads for domain counts overlap network latency on remote storage.
_HEADER_THREADS = 8


@attrs.frozen
class DicomEntry:
    """One file of the dataset."""

    url: str
    domain: str | None = None  #: known from the manifest or folder; None: read the header
    label: int | None = None


def _extension_matches(name: str, extensions: Sequence[str]) -> bool:
    """``""`` matches a name without an extension, including UID-style names
    such as ``1.2.840.113619.2.55`` whose last dotted part is all digits."""
    stem, suffix = posixpath.splitext(name)
    wanted = {e.lower() for e in extensions}
    if suffix.lower() in wanted:
        return True
    return "" in wanted and (suffix == "" or suffix[1:].isdigit())


def list_dicom_files(path: str, extensions: Sequence[str] = (".dcm", "")) -> list[str]:
    """The files a folder (recursively) or a glob names, sorted.

    A folder's files are filtered by ``extensions``; hidden files and
    ``DICOMDIR`` are skipped. A glob's matches are taken as they are. Remote
    URLs keep their protocol; local paths are returned as paths. Raises
    UserError when ``path`` does not exist; returns [] when nothing matches.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    keep_protocol = "://" in path

    def as_url(found: str) -> str:
        return fs.unstrip_protocol(found) if keep_protocol else found

    if _GLOB_CHARS.search(root):
        matches = fs.glob(root, detail=True)
        return sorted(as_url(p) for p, info in matches.items() if info.get("type") == "file")
    if fs.isdir(root):
        found = []
        base = root.rstrip("/")
        for file_path in fs.find(root):
            relative = file_path[len(base):].lstrip("/")
            parts = relative.split("/")
            if any(part.startswith(".") for part in parts) or parts[-1].lower() in _NOT_IMAGES:
                continue
            if _extension_matches(parts[-1], extensions):
                found.append(as_url(file_path))
        return sorted(found)
    if fs.isfile(root):
        return [as_url(root)]
    raise UserError(f"dataset path does not exist: {path}")


class DicomDataset:
    """OCT DICOM volumes listed at build time; see the module docstring."""

    def __init__(self, entries: Sequence[DicomEntry], source: str) -> None:
        if not entries:
            raise UserError(f"no DICOM files in {source}")
        self.entries: tuple[DicomEntry, ...] = tuple(entries)
        self.source = source
        # Domains read from headers, by index; filled lazily, per process.
        self._header_domains: dict[int, str] = {}

    @classmethod
    def from_location(
        cls,
        path: str | os.PathLike[str],
        *,
        split: str | None = None,
        domain_from: str = "header",
        extensions: Sequence[str] = (".dcm", ""),
    ) -> "DicomDataset":
        """List the files at ``path``: a folder, a glob, or a ``.csv`` / ``.jsonl`` manifest.

        ``split`` keeps the manifest rows of that split. ``domain_from`` is
        ``"header"`` (the Manufacturer), ``"manifest"`` (its domain column,
        required on every row) or ``"folder"`` (the parent folder's name).
        Raises UserError naming ``path`` when it lists no file.
        """
        path = os.fspath(path)
        if domain_from not in DOMAIN_SOURCES:
            raise UserError(f"dataset.domain_from must be one of {DOMAIN_SOURCES}, got {domain_from!r}")
        manifest = is_manifest(path)
        if not manifest and (split is not None or domain_from == "manifest"):
            option = "split" if split is not None else "domain_from = 'manifest'"
            raise UserError(f"dataset.{option} needs a manifest (.csv or .jsonl) path, got {path}")

        if manifest:
            rows = read_manifest(path)
            if split is not None:
                rows = [row for row in rows if row.split == split]
                if not rows:
                    raise UserError(f"no rows with split {split!r} in {path}")
            if domain_from == "manifest":
                missing = [row.path for row in rows if row.domain is None]
                if missing:
                    raise UserError(
                        f"{path}: {len(missing)} rows have no domain (first: {missing[0]}); "
                        "fill the domain column or use domain_from = 'header'"
                    )
            pairs = [(row.path, row.domain, row.label) for row in rows]
        else:
            urls = list_dicom_files(path, extensions)
            if not urls:
                raise UserError(
                    f"no DICOM files in {path} (extensions {list(extensions)}; '' = none)"
                )
            pairs = [(url, None, None) for url in urls]

        entries = []
        for url, manifest_domain, label in pairs:
            if domain_from == "manifest":
                domain = manifest_domain
            elif domain_from == "folder":
                domain = posixpath.basename(posixpath.dirname(url.replace(os.sep, "/"))) or UNKNOWN_DOMAIN
            else:
                domain = None
            entries.append(DicomEntry(url=url, domain=domain, label=label))
        return cls(entries, source=path)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"DicomDataset({len(self)} files from {self.source})"

    def url(self, index: int) -> str:
        return self.entries[index].url

    def label(self, index: int) -> int | None:
        return self.entries[index].label

    def load(self, index: int) -> Sample:
        """Decode volume ``index``; raises CorruptFile for an unusable file."""
        entry = self.entries[index]
        sample = read_oct_volume(entry.url, domain=entry.domain, label=entry.label)
        if entry.domain is None:
            self._header_domains[index] = sample.provenance.domain
        return sample

    def domain(self, index: int) -> str:
        """The domain of ``index`` without decoding pixels.

        With header domains, the header is read once; a file whose header
        cannot be read is ``"unknown"`` (``load`` will quarantine it).
        """
        entry = self.entries[index]
        if entry.domain is not None:
            return entry.domain
        cached = self._header_domains.get(index)
        if cached is None:
            try:
                cached = read_header(entry.url)["domain"]
            except CorruptFile:
                cached = UNKNOWN_DOMAIN
            self._header_domains[index] = cached
        return cached

    def domain_counts(self) -> dict[str, int]:
        """Number of files per domain, sorted by domain name."""
        if len(self) > 1 and any(e.domain is None for e in self.entries):
            with ThreadPoolExecutor(max_workers=_HEADER_THREADS) as pool:
                domains = list(pool.map(self.domain, range(len(self))))
        else:
            domains = [self.domain(i) for i in range(len(self))]
        counts: dict[str, int] = {}
        for domain in domains:
            counts[domain] = counts.get(domain, 0) + 1
        return dict(sorted(counts.items()))
