"""What an exported encoder records, whatever its format, and the names of its files.

``octfw export --format`` writes one of :data:`EXPORT_FORMATS`
(:mod:`octfw.exports.writing` writes each, :mod:`octfw.exports.reading` reads each back):

- ``octfw``: one file, a dict ``torch.load(weights_only=True)`` reads: ``info``
  (below) and ``state_dict``, the encoder weights (CPU tensors).
- ``safetensors``: a Hugging Face Hub-style folder: ``config.json`` (``info``),
  ``model.safetensors`` (the weights) and ``README.md`` (a model card).
  ``PretrainedEncoder.save_pretrained`` writes it, ``from_pretrained`` reads it
  from a folder or a Hub repository.
- ``torchscript``: one file ``torch.jit.load`` runs without octfw:
  ``[B, C, D, H, W]`` -> patch tokens ``[B, N, E]``; ``info`` rides along as
  its ``config.json`` extra file.
- ``monai-bundle``: a MONAI bundle folder (``configs/metadata.json``,
  ``configs/inference.json``, ``scripts/vit3d.py``, ``models/model.pt``,
  ``models/model.ts``, ``docs/README.md``) that ``python -m monai.bundle run``
  loads and runs without octfw: it reads a ``[D, H, W]`` volume from
  ``--input_path`` with MONAI's ``LoadImage`` (DICOM, NIfTI with nibabel,
  ``.npy``), prepares it with MONAI transforms equal to octfw's
  ``oct-standard`` preparation, and saves the patch tokens to
  ``--output_path``. Its ``network_def`` is the encoder class (the source of
  :mod:`octfw.models.vit3d`, which imports torch only) and ``models/model.pt``
  its state dict: a MONAI user builds and fine-tunes it without octfw
  (:mod:`octfw.exports.monai_bundle`).

Every format records the same ``info`` (:func:`encoder_info`):

- ``format`` (``"octfw-encoder"``), ``format_version``, ``octfw_version``;
- ``architecture`` (``"vit3d"``) and ``config``: the arguments of
  :class:`octfw.models.vit3d.ViT3DEncoder` (``image_size``, ``patch_size``,
  ``in_channels``, ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``);
- ``transform``: the recipe's ``[transform]`` table, for reference: inputs
  should be prepared the same way (spacing, intensity percentiles, size);
- ``model``: the recipe's ``[model]`` table; ``checkpoint`` (its file name,
  never a local path), ``run`` (``<recipe>/<run folder>``) and
  ``update_step``: where the weights come from; ``versions`` of the run;
- ``license``, ``datasets`` and ``metrics`` (the run's evaluator results):
  what the model card states.

No exported file holds a local path: the checkpoint is named by its file name
and run (:func:`encoder_info`).

This module imports no torch: the export command's ``--help`` lists
:data:`EXPORT_FORMATS`.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Sequence

__all__ = ["FORMAT", "FORMAT_VERSION", "EXPORT_FORMATS", "FOLDER_FORMATS", "WEIGHTS_FILE", "CONFIG_FILE",
           "CARD_FILE", "DEFAULT_LICENSE", "BUNDLE_NETWORK", "BUNDLE_WEIGHTS",
           "BUNDLE_METADATA", "encoder_info", "dataset_label", "run_name", "is_new_or_empty",
           "is_export_folder"]

#: What an octfw encoder export says it is (``format`` in its ``info``), and its version.
FORMAT, FORMAT_VERSION = "octfw-encoder", 1
#: What ``octfw export --format`` writes, the default first.
EXPORT_FORMATS = ("octfw", "safetensors", "torchscript", "monai-bundle")
#: The formats that write a folder rather than one file.
FOLDER_FORMATS = ("safetensors", "monai-bundle")
#: The files of a safetensors export folder (the layout Hugging Face models use).
WEIGHTS_FILE, CONFIG_FILE, CARD_FILE = "model.safetensors", "config.json", "README.md"
#: The licence a model card states when the export was given none: "other" is the Hub's
#: value for a licence not in its list; the pretraining data's terms decide.
DEFAULT_LICENSE = "other"
#: The files of a MONAI bundle that hold the network: its class's source, its state dict,
#: and the file that makes the folder a bundle.
BUNDLE_NETWORK, BUNDLE_WEIGHTS, BUNDLE_METADATA = "scripts/vit3d.py", "models/model.pt", "configs/metadata.json"


def encoder_info(architecture: Mapping[str, Any], recipe: Mapping[str, Any], checkpoint: str, update_step: int,
                 versions: Any, *, license: str = DEFAULT_LICENSE, datasets: Sequence[str] | None = None,
                 metrics: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """What every format records beside the weights: the architecture (the ViT3D encoder's
    arguments), the recipe's ``[transform]`` (how inputs are prepared) and ``[model]``, where
    the weights come from, and the model card's ``license``, ``datasets`` and ``metrics``.

    An export is shared: it names the checkpoint by its file name and its run
    (``<recipe>/<run folder>``), never by a local path. ``datasets`` default to
    the recipe's ``[dataset]`` (:func:`dataset_label`); ``metrics`` are evaluator
    results (``evaluator``, ``metric``, ``value``, ``step``, ``dataset``).
    """
    from octfw.version import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "octfw_version": __version__,
        "architecture": "vit3d",
        "config": dict(architecture),
        "transform": dict(recipe["transform"]),
        "model": dict(recipe["model"]),
        "checkpoint": PurePosixPath(str(checkpoint)).name,
        "run": run_name(str(checkpoint)),
        "update_step": int(update_step),
        "versions": versions,
        "license": license,
        "datasets": list(datasets) if datasets is not None else (
            [dataset_label(recipe["dataset"])] if isinstance(recipe.get("dataset"), Mapping) else []),
        "metrics": [dict(m) for m in metrics],
    }


def run_name(checkpoint: str) -> str | None:
    """``<recipe>/<run folder>`` of a checkpoint in a run's ``checkpoints/`` folder, else None."""
    parts = PurePosixPath(checkpoint.replace("\\", "/")).parts
    if len(parts) >= 4 and parts[-2] == "checkpoints":
        return f"{parts[-4]}/{parts[-3]}"
    return None


def dataset_label(table: Mapping[str, Any]) -> str:
    """A dataset as a model card names it: the last folder of its ``path`` (globs and a
    manifest's file name left out), else its ``name``; never the local path itself."""
    name = str(table.get("name", "unknown"))
    path = table.get("path")
    if not isinstance(path, str) or not path:
        return name
    parts = [part for part in path.split("://")[-1].split("/") if part and not any(c in part for c in "*?[")]
    if len(parts) > 1 and PurePosixPath(parts[-1]).suffix:  # manifest.jsonl, volume.dcm: name the folder
        parts.pop()
    return parts[-1] if parts else name


def is_new_or_empty(folder: Path) -> bool:
    """Whether a folder export may be written to ``folder`` without replacing anything."""
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


def is_export_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a folder export (what ``--force`` may replace)."""
    return (folder / CONFIG_FILE).is_file() or (folder / BUNDLE_METADATA).is_file()
