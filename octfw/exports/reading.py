"""Reading an exported encoder back, in each format ``octfw export`` writes
(:mod:`octfw.exports.formats`): the recorded ``info`` and the weights, checked to be an
octfw encoder this version reads. The network is rebuilt by
:func:`octfw.exports.pretrained.load_encoder`."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

from octfw.display.errors import UserError
from octfw.exports.formats import (BUNDLE_METADATA, BUNDLE_WEIGHTS, CONFIG_FILE, FORMAT, FORMAT_VERSION,
                                   WEIGHTS_FILE, is_export_folder)

__all__ = ["read_export", "is_export_path"]


def read_export(path: Path) -> dict[str, Any]:
    """What the export at ``path`` recorded (``info``) with its ``state_dict``: a
    ``safetensors`` or ``monai-bundle`` folder, a ``torchscript`` or ``octfw`` file.
    Raises UserError for a missing path, or one that is not an octfw encoder export
    of the format version and architecture this octfw reads."""
    if path.is_dir():
        data = _read_bundle(path) if (path / BUNDLE_METADATA).is_file() else _read_safetensors(path)
    elif path.is_file() and _is_torchscript(path):
        data = _read_torchscript(path)
    elif path.is_file():
        from octfw.storage.checkpoint_reading import safe_load

        data = safe_load(str(path), str(path), what="encoder file")  # on the CPU; moved by the caller
    else:
        raise UserError(f"{path}: no such encoder file or folder")
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise UserError(f"{path}: not an octfw encoder file or folder (write one with `octfw export`)")
    if data.get("format_version") != FORMAT_VERSION or data.get("architecture") != "vit3d":
        raise UserError(f"{path}: encoder format {data.get('format_version')!r} / architecture "
                        f"{data.get('architecture')!r} is not supported by this octfw "
                        f"(expects {FORMAT_VERSION} / 'vit3d')")
    return dict(data)


def is_export_path(path: Path) -> bool:
    """Whether ``path`` is an encoder export known without loading it: a safetensors or MONAI
    bundle folder, or a TorchScript file (an ``octfw`` file is told by its contents)."""
    return is_export_folder(path) if path.is_dir() else path.is_file() and _is_torchscript(path)


def _read_safetensors(folder: Path) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config.is_file() or not weights.is_file():
        raise UserError(f"{folder}: not an encoder folder (it needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
                        "write one with `octfw export --format safetensors`)")
    try:
        info = json.loads(config.read_text(encoding="utf-8"))
        state_dict = load_file(str(weights))
    except (ValueError, SafetensorError) as exc:
        raise UserError(f"{folder}: cannot be read ({type(exc).__name__}: {exc})") from None
    return {**info, "state_dict": state_dict} if isinstance(info, dict) else {}


def _is_torchscript(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (a zip holding ``constants.pkl`` and ``code/``),
    not a ``torch.save`` file (a zip holding ``data.pkl``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") for name in archive.namelist())


def _read_torchscript(path: Path) -> dict[str, Any]:
    """What ``octfw export --format torchscript`` wrote: ``info`` from its ``config.json`` extra
    file, the weights from the traced module's state dict (the eager encoder's names).
    ``torch.jit.load`` runs no Python code from the file; the network is rebuilt from octfw's
    own class, so the traced graph is not used."""
    extra = {CONFIG_FILE: ""}
    try:
        module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"{path}: a TorchScript file that cannot be read ({first})") from None
    if not extra[CONFIG_FILE]:
        raise UserError(f"{path}: a TorchScript file without octfw's {CONFIG_FILE}; run it with torch.jit.load, "
                        "or give a file or folder written by `octfw export`")
    try:
        info = json.loads(extra[CONFIG_FILE])
    except ValueError as exc:
        raise UserError(f"{path}: its {CONFIG_FILE} cannot be read ({exc})") from None
    if not isinstance(info, dict):
        return {}
    # A sin-cos position embedding is derived from the geometry, kept out of octfw's state
    # dict; a learned one is a weight.
    learned = isinstance(info.get("config"), dict) and info["config"].get("position") == "learned"
    state_dict = {k: v for k, v in module.state_dict().items() if k != "pos_embed" or learned}
    return {**info, "state_dict": state_dict}


def _read_bundle(folder: Path) -> dict[str, Any]:
    """What ``octfw export --format monai-bundle`` wrote: ``info`` from ``configs/metadata.json``
    (its ``octfw`` entry), the weights from ``models/model.pt``."""
    from octfw.storage.checkpoint_reading import safe_load

    weights = folder / BUNDLE_WEIGHTS
    if not weights.is_file():
        raise UserError(f"{folder}: a MONAI bundle without {BUNDLE_WEIGHTS}; give one written by "
                        "`octfw export --format monai-bundle`")
    try:
        metadata = json.loads((folder / BUNDLE_METADATA).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(f"{folder}: its {BUNDLE_METADATA} cannot be read ({exc})") from None
    info = metadata.get("octfw") if isinstance(metadata, dict) else None
    if not isinstance(info, dict):
        raise UserError(f"{folder}: a MONAI bundle that octfw did not write (its {BUNDLE_METADATA} has no 'octfw')")
    return {**info, "state_dict": safe_load(str(weights), str(weights), what="encoder file")}
