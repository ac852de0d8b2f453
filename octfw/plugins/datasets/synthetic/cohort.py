"""Synthetic multi-vendor OCT cohorts, written as real DICOM files: the options, the files, the cache.

A cohort is a function of its options and seed, so the quickstart, the tests
and every rank of a run see the same bytes. Its volumes are drawn by
:mod:`.retina` (rendered by :mod:`.rendering`) from the profiles of
:mod:`.vendors`, labelled as :mod:`.labels` says, and some broken as
:mod:`.corruption` says; this module validates the options and writes (or
reuses) the folder.

Layout of a cohort folder::

    <folder>/<domain>/<index>.dcm   one Ophthalmic Tomography file per volume
    <folder>/<domain>/<index>.layers.npy  its layer labels, uint8 [D, H, W] ("small" sizes only)
    <folder>/manifest.jsonl         path, domain, label (and layers, layer_names) of every file
    <folder>/cohort.json            options, files, sizes; written last

``cohort.json`` is written last, so a folder without it (or with one for
other options, or with a file missing or of the wrong size) is rewritten.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from typing import Any, Mapping, Sequence

import numpy as np

from octfw.dicom.files import open_file, write_bytes
from octfw.dicom.manifest import ManifestRow, write_manifest
from octfw.dicom.writing import encode_oct_dicom
from octfw.display.progress import progress_bar
from octfw.display.tables import counted
from octfw.plugins.datasets.synthetic.corruption import corrupt_bytes, corrupted_files
from octfw.plugins.datasets.synthetic.labels import LAYER_NAMES, task_labels
from octfw.plugins.datasets.synthetic.retina import synthetic_volume_and_layers
from octfw.plugins.datasets.synthetic.vendors import DEFAULT_DOMAINS, SIZES, VendorProfile
from octfw.storage.files import open_filesystem

__all__ = [
    "GENERATOR_VERSION",
    "FINDINGS_VERSION",
    "LAYERS_VERSION",
    "COHORT_FILE",
    "MANIFEST_FILE",
    "cohort_options",
    "cohort_key",
    "write_synthetic_cohort",
    "read_cohort",
]

#: Bumped whenever the generator's output changes, so cached cohorts are rewritten.
GENERATOR_VERSION = 2  # 2: a larger, brighter lesion (visible after resizing to 16 x 64 x 64)
#: Bumped whenever fluid, thinning or a finding_scale change; recorded in the
#: options of every cohort but the default lesion one, whose options (and so
#: cache folder and bytes) stay those of generator version 2.
FINDINGS_VERSION = 1
#: Bumped whenever the layer label files change. Recorded in ``cohort.json`` (not in the
#: options: cache folders and DICOM bytes stay), so a cohort written without labels, or
#: with older ones, is not complete and is written again (the same volumes, plus labels).
LAYERS_VERSION = 1

COHORT_FILE = "cohort.json"
MANIFEST_FILE = "manifest.jsonl"


def _profiles(sizes: str) -> dict[str, VendorProfile]:
    try:
        return SIZES[sizes]
    except KeyError:
        raise ValueError(f"unknown synthetic sizes {sizes!r}; known: {sorted(SIZES)}") from None


def _resolve_shapes(domains: Sequence[str], shapes: Mapping[str, Sequence[int]] | None,
                    profiles: Mapping[str, VendorProfile]) -> dict[str, list[int]]:
    unknown = [d for d in domains if d not in profiles]
    if unknown:
        raise ValueError(f"unknown synthetic domains {unknown}; known: {sorted(profiles)}")
    shapes = dict(shapes or {})
    resolved = {}
    for domain in domains:
        shape = [int(n) for n in shapes.pop(domain, profiles[domain].shape)]
        if len(shape) != 3 or min(shape) < 2:
            raise ValueError(f"shape for {domain!r} must be three sizes >= 2 [D, H, W], got {shape}")
        resolved[domain] = shape
    if shapes:
        raise ValueError(f"shapes given for domains not in the cohort: {sorted(shapes)}")
    return resolved


def cohort_options(
    n_volumes: int,
    domains: Sequence[str] = DEFAULT_DOMAINS,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    corrupt_fraction: float = 0.0,
    with_labels: bool = False,
    task: str = "lesion",
    finding_scale: float = 1.0,
    sizes: str = "small",
) -> dict[str, Any]:
    """The options that determine a cohort's bytes, as plain JSON data.

    ``task``, ``finding_scale`` and :data:`FINDINGS_VERSION` appear only
    when a task or scale differs from the defaults ("lesion", 1.0), and
    ``sizes`` only when it is not "small": the cohorts written before they
    existed keep their options, so their cache folders (named by
    :func:`cohort_key`) and bytes stay as they were, while every other task,
    scale or size gets its own.
    """
    if n_volumes < 1:
        raise ValueError(f"n_volumes must be >= 1, got {n_volumes}")
    if not domains or len(set(domains)) != len(domains):
        raise ValueError(f"domains must be distinct and non-empty, got {list(domains)}")
    if not 0.0 <= corrupt_fraction <= 1.0:
        raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    profiles = _profiles(sizes)
    task_labels(task)
    if not finding_scale > 0:
        raise ValueError(f"finding_scale must be > 0, got {finding_scale}")
    if (task != "lesion" or finding_scale != 1.0) and not with_labels:
        # Findings are drawn only in labelled cohorts; refusing beats ignoring.
        raise ValueError(f"task {task!r} and finding_scale {finding_scale} need with_labels")
    options = {
        "version": GENERATOR_VERSION,
        "n_volumes": int(n_volumes),
        "domains": list(domains),
        "shapes": _resolve_shapes(domains, shapes, profiles),
        "seed": int(seed),
        "corrupt_fraction": float(corrupt_fraction),
        "with_labels": bool(with_labels),
    }
    if task != "lesion" or finding_scale != 1.0:
        options["task"] = task
        options["finding_scale"] = float(finding_scale)
        options["findings_version"] = FINDINGS_VERSION
    if sizes != "small":
        options["sizes"] = sizes
    return options


def cohort_key(options: Mapping[str, Any]) -> str:
    """A short stable name for a cohort's options (a cache folder name)."""
    text = json.dumps(options, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def _size(url: str) -> int | None:
    fs, path = open_filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    return int(info["size"]) if info.get("type") == "file" else None


def _remove(url: str) -> None:
    fs, path = open_filesystem(url)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass  # absent already, or removed by another rank writing the same cohort


def read_cohort(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parsed ``cohort.json`` of ``folder``, or None when there is none."""
    url = _join(os.fspath(folder), COHORT_FILE)
    try:
        with open_file(url) as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return None  # a damaged record means a damaged cohort: rewrite it


def _writes_layers(sizes: str) -> bool:
    return sizes == "small"


def _is_complete(folder: str, record: dict[str, Any] | None, options: dict[str, Any]) -> bool:
    if not record or record.get("options") != options:
        return False
    if _writes_layers(options.get("sizes", "small")) and record.get("layers_version") != LAYERS_VERSION:
        return False  # written before layer labels (or with older ones)
    return all(_size(_join(folder, item["path"])) == item["size"]
               for item in [*record["files"], *record.get("layer_files", [])])


def write_synthetic_cohort(
    folder: str | os.PathLike[str],
    n_volumes: int,
    domains: Sequence[str] = DEFAULT_DOMAINS,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    corrupt_fraction: float = 0.0,
    with_labels: bool = False,
    task: str = "lesion",
    finding_scale: float = 1.0,
    sizes: str = "small",
) -> list[str]:
    """Write (or reuse) a synthetic cohort in ``folder``; return its file paths.

    Volume ``i`` belongs to ``domains[i % len(domains)]`` and is drawn from
    its own generator seeded with ``(seed, i)``, so the same options give
    byte-identical files. ``shapes`` overrides a domain's ``[D, H, W]``.
    ``corrupt_fraction`` of the files (rounded half up) are broken in turn
    as truncated, not DICOM, without pixel data, and constant. With
    ``with_labels``, each volume gets a label of ``task`` (:data:`.labels.TASKS`)
    and the finding that label names, recorded in the manifest; the default
    task, "lesion", is a bright lesion (label 1) or none (0).
    ``finding_scale`` multiplies the findings' size. ``sizes`` picks the
    profiles (:data:`.vendors.SIZES`): "small" 16-bit volumes or "device" ones, at
    the sizes and 8-bit depth devices export. ``folder`` may be a local path
    or fsspec URL.
    """
    folder = os.fspath(folder).rstrip("/")
    options = cohort_options(n_volumes, domains, shapes=shapes, seed=seed,
                             corrupt_fraction=corrupt_fraction, with_labels=with_labels,
                             task=task, finding_scale=finding_scale, sizes=sizes)
    findings = task_labels(task)
    profiles = SIZES[sizes]
    # Other tasks' and sizes' files must not share the small lesion cohorts'
    # UIDs; those cohorts' entropy is left as it was, so their files keep their bytes.
    entropy = [task, repr(finding_scale), str(FINDINGS_VERSION)] if "task" in options else []
    entropy += [sizes] if "sizes" in options else []
    previous = read_cohort(folder)
    if _is_complete(folder, previous, options):
        return [_join(folder, item["path"]) for item in previous["files"]]

    # Rewriting: drop the record first, so an interrupted rewrite is seen as
    # incomplete, and remove files of an older cohort that this one lacks.
    _remove(_join(folder, COHORT_FILE))
    corruption = corrupted_files(seed, n_volumes, corrupt_fraction)

    # The first command on a fresh cache writes the cohort, minutes at larger sizes: say so
    # rather than look stuck (and draw a bar where a person watches).
    logging.getLogger(__name__).info("writing the synthetic cohort (%s, %s sizes) once, to %s; later commands "
                                     "reuse it", counted(n_volumes, "volume"), sizes, folder)
    files, rows, layer_files = [], [], []
    with progress_bar("synthetic cohort", unit="volumes") as shown:
        for index in range(n_volumes):
            domain = domains[index % len(domains)]
            profile = profiles[domain]
            rng = np.random.default_rng([seed, index])
            label = None
            if with_labels:
                # A binary task draws as generator version 2 did (label 1 below 0.5).
                draw = rng.random()
                label = int(draw < 0.5) if len(findings) == 2 else int(draw * len(findings))
            volume, layers = synthetic_volume_and_layers(rng, options["shapes"][domain], profile,
                                                         finding=None if label is None else findings[label],
                                                         finding_scale=finding_scale,
                                                         layers=_writes_layers(sizes))
            name = f"{domain}/{index:05d}.dcm"

            def encode(array: np.ndarray, _name: str = name) -> bytes:
                # UIDs derive from the seed and file name: rewriting gives the same bytes.
                return encode_oct_dicom(array, profile.spacing, profile.manufacturer, profile.model_name,
                                        uid_entropy=[str(seed), _name, str(GENERATOR_VERSION), *entropy])

            data = encode(volume)
            kind = corruption.get(index)
            if kind is not None:
                data = corrupt_bytes(kind, data, volume, encode, rng)
            url = _join(folder, name)
            write_bytes(url, data)
            files.append({"path": name, "domain": domain, "label": label, "corrupt": kind, "size": len(data)})
            layers_url = None
            if layers is not None:
                layers_name = f"{domain}/{index:05d}.layers.npy"
                layers_data = _npy_bytes(layers)
                layers_url = _join(folder, layers_name)
                write_bytes(layers_url, layers_data)
                layer_files.append({"path": layers_name, "size": len(layers_data)})
            rows.append(ManifestRow(path=url, domain=domain, label=label, layers=layers_url,
                                    layer_names=None if layers is None else LAYER_NAMES))
            if shown is not None:
                shown(index + 1, n_volumes)

    if previous and isinstance(previous.get("files"), list):
        keep = {item["path"] for item in [*files, *layer_files]}
        for item in [*previous["files"], *(previous.get("layer_files") or [])]:
            if isinstance(item, dict) and item.get("path") not in keep:
                _remove(_join(folder, str(item["path"])))

    write_manifest(_join(folder, MANIFEST_FILE), rows)
    record = {
        "options": options,
        "domains": list(domains),
        "labels": [item["label"] for item in files],
        "files": files,
    }
    if _writes_layers(sizes):
        record["layers_version"] = LAYERS_VERSION
        record["layer_names"] = list(LAYER_NAMES)
        record["layer_files"] = layer_files
    write_bytes(_join(folder, COHORT_FILE), json.dumps(record, indent=1).encode("utf-8"))
    return [_join(folder, item["path"]) for item in files]
