"""A map-style dataset of OCT DICOM volumes on any fsspec filesystem.

The files are listed once, when the dataset is built: from a folder (walked
recursively), a glob, or a manifest. ``load`` reads one file with
:func:`octfw.dicom.decoding.read_oct_volume` and raises
:class:`~octfw.display.errors.CorruptFile` for an unusable one. ``domain`` answers
without decoding pixels: from the manifest, the parent folder's name, or the
file's header (read once, then remembered).

Series of single-frame files: OCT devices and PACS exports often store a
volume as one file per B-scan. With ``series=True`` (the default) a folder
or glob listing reads every file's header once, at build time, and the
single-frame files (NumberOfFrames 1) that share a SeriesInstanceUID *and a
folder* become one sample, read by
:func:`octfw.dicom.series.read_oct_series`. Its source URL is the folder
(``.../scan_0001``), or ``<folder>#series-<hash>`` when that folder holds
more than one such series. A lone single-frame file stays a sample of its
own, which loading quarantines (:data:`octfw.dicom.decoding.SINGLE_FRAME`).
A manifest row names a series by a path ending in ``/`` (the folder); other
rows are single files. The header reads also give every file's domain,
which the engine needs at start anyway.

The object holds only strings and small records, so it pickles into
data-loader workers; each worker opens files itself.
"""

from __future__ import annotations

import os
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import attrs

from octfw.dicom.decoding import read_oct_volume
from octfw.dicom.header import UNKNOWN_DOMAIN, read_header
from octfw.dicom.manifest import is_manifest, read_manifest
from octfw.dicom.series import read_oct_series
from octfw.display.errors import CorruptFile, UserError
from octfw.types import Sample

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = ["DOMAIN_SOURCES", "DicomEntry", "DicomDataset", "list_dicom_files"]

DOMAIN_SOURCES = ("header", "manifest", "folder")
_GLOB_CHARS = re.compile(r"[*?\[]")
# Files a folder of DICOMs holds that are not images.
_NOT_IMAGES = {"dicomdir"}
# Header reads for domain counts overlap network latency on remote storage.
_HEADER_THREADS = 8


@attrs.frozen
class DicomEntry:
    """One volume of the dataset: a file, or a series of single-frame files."""

    url: str  #: the file, or the series' folder URL
    domain: str | None = None  #: known from the manifest or folder; None: read the header
    label: int | None = None
    files: tuple[str, ...] = ()  #: a series' files (unordered); () for a single file
    patient: str | None = None  #: the manifest's patient key; never read from a DICOM header
    split: str | None = None  #: the manifest's split
    mask: str | None = None  #: the manifest's finding mask file
    layers: str | None = None  #: the manifest's layer label file
    layer_names: tuple[str, ...] | None = None  #: the manifest's names of the layer labels

    @property
    def first_file(self) -> str:
        return self.files[0] if self.files else self.url


def _extension_matches(name: str, extensions: Sequence[str]) -> bool:
    """``""`` matches a name without an extension, including UID-style names
    such as ``1.2.840.113619.2.55`` whose last dotted part is all digits."""
    stem, suffix = posixpath.splitext(name)
    wanted = {e.lower() for e in extensions}
    if suffix.lower() in wanted:
        return True
    return "" in wanted and (suffix == "" or suffix[1:].isdigit())


def _parent(url: str) -> str:
    return url.replace(os.sep, "/").rsplit("/", 1)[0] if "/" in url.replace(os.sep, "/") else "."


def _headers(urls: Sequence[str]) -> list[dict | None]:
    """Every file's header facts (None for an unreadable header), read in threads."""

    def one(url: str) -> dict | None:
        try:
            return read_header(url)
        except CorruptFile:
            return None

    if len(urls) <= 1:
        return [one(u) for u in urls]
    with ThreadPoolExecutor(max_workers=_HEADER_THREADS) as pool:
        return list(pool.map(one, urls))


def group_series(urls: Sequence[str]) -> list[tuple[str, tuple[str, ...], str | None]]:
    """Group listed files into volumes: ``(source, files, header domain)``.

    Single-frame files sharing a SeriesInstanceUID in one folder (two or
    more of them) become one series; every other file is its own volume
    with ``files == ()``. The header domain is None when the header could
    not be read (loading the file will quarantine it). Volumes come in the
    order of their first file.
    """
    headers = _headers(urls)
    groups: dict[tuple[str, str], list[int]] = {}
    for index, (url, header) in enumerate(zip(urls, headers)):
        if header is not None and header["number_of_frames"] == 1 and header["series_key"]:
            groups.setdefault((_parent(url), header["series_key"]), []).append(index)
    series = {key: members for key, members in groups.items() if len(members) >= 2}
    per_folder: dict[str, int] = {}
    for folder, _key in series:
        per_folder[folder] = per_folder.get(folder, 0) + 1
    member_of = {i: key for key, members in series.items() for i in members}

    volumes = []
    for index, (url, header) in enumerate(zip(urls, headers)):
        domain = header["domain"] if header is not None else None
        key = member_of.get(index)
        if key is None:
            volumes.append((url, (), domain))
            continue
        members = series[key]
        if index != members[0]:
            continue  # the series was added at its first file
        folder, series_key = key
        source = folder if per_folder[folder] == 1 else f"{folder}#series-{series_key[:8]}"
        volumes.append((source, tuple(urls[i] for i in members), domain))
    return volumes


def list_dicom_files(path: str, extensions: Sequence[str] = (".dcm", "")) -> list[str]:
    """The files a folder (recursively) or a glob names, sorted.

    A folder's files are filtered by ``extensions``; hidden files and
    ``DICOMDIR`` are skipped. A glob's matches are taken as they are. Remote
    URLs keep their protocol; local paths are returned as paths. Raises
    UserError when ``path`` does not exist; returns [] when nothing matches.
    """
    from octfw.storage.files import open_filesystem

    fs, root = open_filesystem(path)  # an unknown protocol is a UserError naming the path
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
    raise UserError(f"dataset.path does not exist: {path}")


class DicomDataset:
    """OCT DICOM volumes listed at build time; see the module docstring."""

    def __init__(self, entries: Sequence[DicomEntry], location: str) -> None:
        if not entries:
            raise UserError(f"no DICOM files in {location}")
        self.entries: tuple[DicomEntry, ...] = tuple(entries)
        self.location = location  #: the folder, glob or manifest the entries came from
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
        series: bool = True,
    ) -> "DicomDataset":
        """List the files at ``path``: a folder, a glob, or a ``.csv`` / ``.jsonl`` manifest.

        ``split`` keeps the manifest rows of that split. ``domain_from`` is
        ``"header"`` (the Manufacturer), ``"manifest"`` (its domain column,
        required on every row) or ``"folder"`` (the parent folder's name; for
        a series, the name of the folder that holds the series folder).
        ``series`` groups single-frame files of one series into one volume
        (see the module docstring). Raises UserError naming ``path`` when it
        lists no file.
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
            volumes = []
            for row in rows:
                if row.path.endswith("/"):  # a series folder
                    files = tuple(list_dicom_files(row.path, extensions))
                    if not files:
                        raise UserError(f"{path}: series folder {row.path} holds no DICOM files")
                    volumes.append((row.path.rstrip("/"), files, row.domain, row.label, None, row.patient,
                                    row.split, (row.mask, row.layers, row.layer_names)))
                else:
                    volumes.append((row.path, (), row.domain, row.label, None, row.patient, row.split,
                                    (row.mask, row.layers, row.layer_names)))
        else:
            urls = list_dicom_files(path, extensions)
            if not urls:
                raise UserError(
                    f"no DICOM files in {path} (extensions {list(extensions)}; '' = none)"
                )
            if series:
                volumes = [(source, files, None, None, header_domain, None, None, (None, None, None))
                           for source, files, header_domain in group_series(urls)]
            else:
                volumes = [(url, (), None, None, None, None, None, (None, None, None)) for url in urls]

        entries, header_domains = [], {}
        for source, files, manifest_domain, label, header_domain, patient, split_name, dense in volumes:
            mask, layers, layer_names = dense
            if domain_from == "manifest":
                domain = manifest_domain
            elif domain_from == "folder":
                domain = posixpath.basename(_parent(source)) or UNKNOWN_DOMAIN
            else:
                domain = None
                if header_domain is not None:
                    header_domains[len(entries)] = header_domain
            entries.append(DicomEntry(url=source, domain=domain, label=label, files=files, patient=patient,
                                      split=split_name, mask=mask, layers=layers, layer_names=layer_names))
        dataset = cls(entries, location=path)
        dataset._header_domains.update(header_domains)
        return dataset

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        series = sum(1 for e in self.entries if e.files)  # files until read: see engine.domains.listed
        return f"DicomDataset({len(self) - series} files, {series} series from {self.location})"

    def url(self, index: int) -> str:
        return self.entries[index].url

    def source(self, index: int) -> str:
        """The URL ``load(index)`` reports (file or series folder), without I/O:
        the key of the volume's cached prepared form."""
        return self.entries[index].url

    def files(self, index: int) -> tuple[str, ...]:
        """The files volume ``index`` is read from (a series' files, or the one file)."""
        entry = self.entries[index]
        return entry.files or (entry.url,)

    def split(self, index: int) -> str | None:
        """The manifest's split of ``index`` (None: no manifest or no split column)."""
        return self.entries[index].split

    def is_series(self, index: int) -> bool:
        return bool(self.entries[index].files)

    def label(self, index: int) -> int | None:
        return self.entries[index].label

    def patient(self, index: int) -> str | None:
        """The manifest's patient key of ``index`` (None: not given); evaluation splits group by it."""
        return self.entries[index].patient

    def mask_source(self, index: int) -> str | None:
        """The manifest's finding mask file of ``index`` (None: not given), without I/O."""
        return self.entries[index].mask

    def mask(self, index: int) -> "np.ndarray | None":
        """The finding mask of ``index``, bool ``[D, H, W]`` (None: not given); raises
        CorruptFile naming the mask file (:func:`octfw.dicom.masks.read_finding_mask`)."""
        source = self.entries[index].mask
        if source is None:
            return None
        from octfw.dicom.masks import read_finding_mask

        return read_finding_mask(source)

    def layers_source(self, index: int) -> str | None:
        """The manifest's layer label file of ``index`` (None: not given), without I/O."""
        return self.entries[index].layers

    def layer_names(self, index: int) -> tuple[str, ...] | None:
        """What each layer label value of ``index`` means (index = value), top to bottom; without I/O."""
        return self.entries[index].layer_names

    def layers(self, index: int) -> "np.ndarray | None":
        """The layer labels of ``index``, uint8 ``[D, H, W]`` (None: not given); raises CorruptFile
        naming the file (:func:`octfw.dicom.masks.read_layer_labels`)."""
        entry = self.entries[index]
        if entry.layers is None:
            return None
        from octfw.dicom.masks import read_layer_labels

        return read_layer_labels(entry.layers, len(entry.layer_names or ()))

    def load(self, index: int) -> Sample:
        """Decode volume ``index``; raises CorruptFile for an unusable file."""
        entry = self.entries[index]
        if entry.files:
            sample = read_oct_series(entry.files, entry.url, domain=entry.domain, label=entry.label)
        else:
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
                cached = read_header(entry.first_file)["domain"]
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
