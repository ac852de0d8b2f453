"""Writing a phantom cohort: patients, two eyes each, as DICOM plus a manifest.

The families (:mod:`.tuning`, :mod:`.held_out`, :mod:`.context`) draw a patient's
anatomy and render one eye on their devices (:class:`.devices.Vendor`); this module
only assigns vendors, labels and patients, and writes, importing a family by name
when it writes it (:func:`family_module`), so no family imports it. Layout of a cohort folder::

    <folder>/<vendor>/<index>.dcm       one Ophthalmic Tomography file per eye
    <folder>/<vendor>/<index>.mask.npy  its finding mask, bool [D, H, W] (all False without the finding)
    <folder>/<vendor>/<index>.layers.npy  its retinal layer labels, uint8 [D, H, W] (the family's LAYER_NAMES)
    <folder>/manifest.jsonl             path, domain, label, patient, mask, layers, layer_names of every file
    <folder>/cohort.json            options, files, sizes; written last

``cohort.json`` goes last, so a folder without it (or with one for other
options, or with a file of the wrong size, or without the layer labels of
:data:`LAYERS_VERSION`) is written again.

A consumer reads the layer labels through the dataset (:class:`octfw.types.LayeredDataset`):
``dataset.layers(i)`` (uint8 ``[D, H, W]``, the volume's grid) and ``dataset.layer_names(i)``
(``LAYER_NAMES`` of the family's module: :mod:`.tuning`, :mod:`.held_out`, :mod:`.context`), then
``transform.prepare_labels(labels, dataset.load(i))`` for the prepared geometry.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from types import ModuleType
from typing import Any

import numpy as np

from octfw.dicom.files import open_file, write_bytes
from octfw.dicom.manifest import ManifestRow, write_manifest
from octfw.dicom.writing import encode_oct_dicom
from octfw.storage.files import open_filesystem

__all__ = ["GENERATOR_VERSION", "LAYERS_VERSION", "COHORT_FILE", "MANIFEST_FILE", "family_module",
           "cohort_options", "cohort_key", "write_phantom_cohort"]

#: Bumped whenever a family's output changes, so cached cohorts are written again.
GENERATOR_VERSION = 4  # 2: findings four times larger (sized by benchmarks/learning/phantom_tasks.py); 3: finding masks;
#                        4: the context family's reversal (benchmarks/learning/context_task.py)
#: Bumped whenever the layer label files change. Kept in ``cohort.json``, not in the options:
#: the cache folder and DICOM bytes stay, and a cohort without these labels is written again.
LAYERS_VERSION = 1
COHORT_FILE = "cohort.json"
MANIFEST_FILE = "manifest.jsonl"
EYES = ("OD", "OS")


def family_module(family: str) -> ModuleType:
    """The module that draws ``family``; imported here so the config stays light."""
    if family == "tuning":
        from octfw.plugins.datasets.phantom import tuning as module
    elif family == "held-out":
        from octfw.plugins.datasets.phantom import held_out as module
    elif family == "context":
        from octfw.plugins.datasets.phantom import context as module
    else:
        raise ValueError(f"unknown phantom family {family!r}")
    return module


def cohort_options(family: str, n_volumes: int, seed: int, labels: bool, finding_scale: float) -> dict[str, Any]:
    return {"generator_version": GENERATOR_VERSION, "family": family, "n_volumes": n_volumes,
            "seed": seed, "labels": labels, "finding_scale": finding_scale}


def cohort_key(options: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def _size(url: str) -> int | None:
    fs, path = open_filesystem(url)
    try:
        return int(fs.info(path)["size"])
    except FileNotFoundError:
        return None


def _is_complete(folder: str, options: dict[str, Any]) -> bool:
    try:
        with open_file(_join(folder, COHORT_FILE)) as f:
            record = json.loads(f.read().decode("utf-8"))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return False  # none, or damaged: write the cohort again
    if not isinstance(record, dict) or record.get("options") != options:
        return False
    if record.get("layers_version") != LAYERS_VERSION:
        return False  # written before layer labels (or with older ones)
    return all(_size(_join(folder, item["path"])) == item["size"] for item in record["files"])


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def write_phantom_cohort(folder: str, family: str, n_volumes: int, *, seed: int, labels: bool = False,
                         finding_scale: float = 1.0) -> str:
    """Write (or reuse) a cohort of ``family`` in ``folder``; return its manifest's location.

    Volumes ``2p`` and ``2p + 1`` are the two eyes of patient ``p``, on
    vendor ``p mod 3``: one anatomy, each eye its own noise, small shifts and
    finding (drawn with probability 1/2 per eye). Every draw comes from
    generators seeded with (seed, family, patient[, eye]), so the same
    options give the same bytes.
    """
    module = family_module(family)
    options = cohort_options(family, n_volumes, seed, labels, finding_scale)
    manifest = _join(folder, MANIFEST_FILE)
    if _is_complete(folder, options):
        return manifest
    # The record goes first, so a rewrite cut short is seen as incomplete.
    fs, record_path = open_filesystem(_join(folder, COHORT_FILE))
    if fs.exists(record_path):
        fs.rm_file(record_path)

    family_id = int.from_bytes(hashlib.sha256(family.encode()).digest()[:4], "little")
    files, rows = [], []
    for index in range(n_volumes):
        patient, eye = divmod(index, 2)
        vendor = module.VENDORS[patient % len(module.VENDORS)]
        anatomy = module.draw_patient(np.random.default_rng([seed, family_id, patient]))
        rng = np.random.default_rng([seed, family_id, patient, eye + 1])
        positive = bool(rng.random() < 0.5)
        volume, mask, layers = module.render_labelled(rng, anatomy, vendor, mirrored=eye == 1, positive=positive,
                                                      finding_scale=finding_scale)
        # The seed is in the key: cohorts of two seeds hold different patients.
        key = f"s{seed}-p{patient:04d}"
        name = f"{vendor.name}/{index:05d}.dcm"
        data = encode_oct_dicom(volume, vendor.spacing, vendor.name, vendor.model_name, {"PatientID": key},
                                uid_entropy=["phantom-oct", family, str(seed), name, str(GENERATOR_VERSION)])
        url = _join(folder, name)
        write_bytes(url, data)
        mask_name = f"{vendor.name}/{index:05d}.mask.npy"
        mask_data = _npy_bytes(mask)
        write_bytes(_join(folder, mask_name), mask_data)
        layers_name = f"{vendor.name}/{index:05d}.layers.npy"
        layers_data = _npy_bytes(layers)
        write_bytes(_join(folder, layers_name), layers_data)
        label = int(positive) if labels else None
        files.append({"path": name, "domain": vendor.name, "eye": EYES[eye], "label": label, "size": len(data)})
        files.append({"path": mask_name, "size": len(mask_data)})
        files.append({"path": layers_name, "size": len(layers_data)})
        rows.append(ManifestRow(path=url, domain=vendor.name, label=label, patient=key,
                                mask=_join(folder, mask_name), layers=_join(folder, layers_name),
                                layer_names=tuple(module.LAYER_NAMES)))

    write_manifest(manifest, rows)
    record = {"options": options, "files": files, "layers_version": LAYERS_VERSION,
              "layer_names": list(module.LAYER_NAMES)}
    write_bytes(_join(folder, COHORT_FILE), json.dumps(record, indent=1).encode("utf-8"))
    return manifest
