"""Dataset manifests: a CSV or JSON-lines file listing volumes.

Columns (CSV header or JSON keys): ``path`` (required), ``domain``, ``split``,
``label``, ``patient`` and ``mask`` (all optional; empty or null means unknown). Other
columns are ignored, so a manifest may carry bookkeeping of its own.
``patient`` is any key shared by the volumes of one patient (use a
pseudonym): evaluation splits keep a patient's volumes on one side. It is
only compared, never written to a run's outputs. ``mask`` is the volume's
binary finding mask, of the volume's shape, for dense evaluation (``.npy``,
NIfTI ``.nii``/``.nii.gz`` or a DICOM SEG file: :mod:`octfw.dicom.masks`).
``layers`` is the volume's retinal layer labels, uint8 ``[D, H, W]`` of the volume's
shape (``.npy``: :func:`octfw.dicom.masks.read_layer_labels`), and
``layer_names`` what each value means, top to bottom, as one text joined by ``|``
(``vitreous|NFL|...``; value ``k`` is the ``k``-th name); written by ``synthetic-oct``
and ``phantom-oct``, read by dense layer evaluators. A relative ``path``, ``mask`` or
``layers`` is relative to the manifest's folder, on the same
filesystem (a manifest in ``gs://bucket/cohort/`` can list ``scans/a.dcm``).
"""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Iterable

import attrs

from octfw.dicom.files import open_file, write_bytes
from octfw.display.errors import UserError

__all__ = ["MANIFEST_SUFFIXES", "ManifestRow", "is_manifest", "read_manifest", "write_manifest"]

MANIFEST_SUFFIXES = (".csv", ".jsonl")


@attrs.frozen
class ManifestRow:
    """One volume listed by a manifest; ``path`` is absolute (a path or URL)."""

    path: str
    domain: str | None = None
    split: str | None = None
    label: int | None = None
    patient: str | None = None  #: groups volumes of one patient; compared only, never written out
    mask: str | None = None  #: the volume's binary finding mask file, absolute like ``path``
    layers: str | None = None  #: the volume's layer label file (uint8 ``[D, H, W]``), absolute like ``path``
    #: what each layer label value means (index = value), top to bottom; None without ``layers``
    layer_names: tuple[str, ...] | None = None


def is_manifest(location: str) -> bool:
    """Whether ``location`` names a manifest file (by its suffix)."""
    return str(location).lower().endswith(MANIFEST_SUFFIXES)


def _folder_of(url: str) -> str:
    return url.rsplit("/", 1)[0] if "/" in url else "."


def _resolve(manifest: str, path: str) -> str:
    if "://" in path or os.path.isabs(path):
        return path
    return f"{_folder_of(manifest)}/{path}"


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def _short(value: Any) -> str:
    """A cell as an error message shows it: a 400-digit number is not read in full."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _label(manifest: str, line: int, value: Any) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise UserError(f"{manifest}:{line}: label must be an integer, got {_short(value)}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond any float
        raise UserError(f"{manifest}:{line}: label must be an integer, got {_short(value)}") from None
    if not number.is_integer():
        raise UserError(f"{manifest}:{line}: label must be an integer, got {_short(value)}")
    return int(number)


def _row(manifest: str, line: int, record: dict[str, Any]) -> ManifestRow:
    path = _text(record.get("path"))
    if path is None:
        raise UserError(f"{manifest}:{line}: empty path")
    return ManifestRow(
        path=_resolve(manifest, path),
        domain=_text(record.get("domain")),
        split=_text(record.get("split")),
        label=_label(manifest, line, record.get("label")),
        patient=_text(record.get("patient")),
        mask=None if (mask := _text(record.get("mask"))) is None else _resolve(manifest, mask),
        layers=None if (layers := _text(record.get("layers"))) is None else _resolve(manifest, layers),
        layer_names=_layer_names(manifest, line, record.get("layer_names"), layers),
    )


def _layer_names(manifest: str, line: int, value: Any, layers: str | None) -> tuple[str, ...] | None:
    """``a|b|c`` (or, in JSON lines, a list of texts) as names; required with ``layers``."""
    names = [n.strip() for n in value] if isinstance(value, list) else \
        [n.strip() for n in (_text(value) or "").split("|") if n.strip()] if value is not None else []
    if layers is None:
        return None
    if not names or not all(names) or len(set(names)) != len(names) or len(names) > 256:
        raise UserError(f"{manifest}:{line}: a row with layers needs layer_names, distinct names joined by "
                        f"'|' (at most 256), got {_short(value)}")
    return tuple(names)


def read_manifest(url: str) -> list[ManifestRow]:
    """Every row of the manifest at ``url`` (local path or fsspec URL).

    Raises UserError naming the file (and line) for a missing file, a missing
    ``path`` column, an empty path, bad JSON or a non-integer label.
    """
    url = str(url)
    if not is_manifest(url):
        raise UserError(f"{url}: a manifest must end in {' or '.join(MANIFEST_SUFFIXES)}")
    try:
        with open_file(url) as f:
            text = f.read().decode("utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"dataset.path: manifest not found: {url}") from None
    except UnicodeDecodeError:
        raise UserError(f"{url}: not UTF-8 text") from None

    rows: list[ManifestRow] = []
    if url.lower().endswith(".csv"):
        reader = csv.DictReader(io.StringIO(text))
        try:
            if reader.fieldnames is None or "path" not in [n.strip() for n in reader.fieldnames]:
                raise UserError(f"{url}: no 'path' column (columns: {reader.fieldnames or []})")
            for record in reader:
                record = {str(k).strip(): v for k, v in record.items() if k is not None}
                rows.append(_row(url, reader.line_num, record))
        except csv.Error as exc:  # e.g. a carriage return alone inside an unquoted cell
            reason = str(exc).split(" - ")[0]  # without the csv module's advice to Python programmers
            raise UserError(f"{url}:{reader.line_num}: not valid CSV ({reason})") from None
        return rows

    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{url}:{line_number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{url}:{line_number}: expected a JSON object")
        if "path" not in record:
            raise UserError(f"{url}:{line_number}: no 'path' key")
        rows.append(_row(url, line_number, record))
    return rows


def write_manifest(url: str, rows: Iterable[ManifestRow], relative: bool = True) -> None:
    """Write ``rows`` as JSON lines to ``url`` (must end in ``.jsonl``).

    With ``relative``, paths inside the manifest's folder are written
    relative to it, so the folder can be moved or copied to a bucket whole.
    """
    url = str(url)
    if not url.lower().endswith(".jsonl"):
        raise ValueError(f"write_manifest writes JSON lines; {url!r} must end in .jsonl")
    folder = _folder_of(url) + "/"

    def written(path: str) -> str:
        return path[len(folder):] if relative and path.startswith(folder) else path

    lines = []
    for row in rows:
        record: dict[str, Any] = {"path": written(row.path), "domain": row.domain, "split": row.split,
                                  "label": row.label}
        # Each left out when unset: manifests without patients, masks or layers stay byte-identical.
        if row.patient is not None:
            record["patient"] = row.patient
        if row.mask is not None:
            record["mask"] = written(row.mask)
        if row.layers is not None:
            record["layers"] = written(row.layers)
            record["layer_names"] = "|".join(row.layer_names or ())
        lines.append(json.dumps(record))
    write_bytes(url, ("\n".join(lines) + "\n").encode("utf-8"))

