"""The files an exported encoder is written as: one writer per ``octfw export --format``.

- ``octfw``: one file, a dict ``torch.load(weights_only=True)`` reads (weights and ``info``).
- ``safetensors``: a Hugging Face Hub-style folder: ``config.json`` (``info``),
  ``model.safetensors`` (the weights) and ``README.md`` (a model card).
  ``PretrainedEncoder.save_pretrained`` writes it, ``from_pretrained`` reads it
  from a folder or a Hub repository.
- ``torchscript``: one file ``torch.jit.load`` runs without octfw:
  ``[B, C, D, H, W]`` -> patch tokens ``[B, N, E]``; ``info`` rides along as
  its ``config.json`` extra file.
- ``monai-bundle``: a MONAI bundle folder (``configs/metadata.json``,
  ``configs/inference.json``, ``models/model.ts``, ``docs/README.md``) that
  ``python -m monai.bundle run`` loads and runs without octfw: it reads a
  ``[D, H, W]`` volume from ``--input_path`` (``.npy``), prepares it with MONAI
  transforms equal to octfw's ``oct-standard`` preparation, and saves the patch
  tokens to ``--output_path``.

Every file is written atomically, and the file that makes a folder an export
(``config.json``, ``configs/metadata.json``) last: a crash leaves no folder
that loads half-written.

This module knows files, not training: it is given the encoder module, its
weights and ``info`` (what ``octfw.encoder.export_encoder`` recorded).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from octfw.storage.files import write_atomically

if TYPE_CHECKING:  # torch is imported where it is used: the export command's --help lists EXPORT_FORMATS
    import torch
    from torch import nn

__all__ = ["FORMAT", "FORMAT_VERSION", "EXPORT_FORMATS", "FOLDER_FORMATS", "WEIGHTS_FILE", "CONFIG_FILE",
           "CARD_FILE", "encoder_info", "is_new_or_empty", "write_export", "model_card", "bundle_inference_config"]

#: What an octfw encoder export says it is (``format`` in its ``info``), and its version.
FORMAT, FORMAT_VERSION = "octfw-encoder", 1
#: What ``octfw export --format`` writes, the default first.
EXPORT_FORMATS = ("octfw", "safetensors", "torchscript", "monai-bundle")
#: The formats that write a folder rather than one file.
FOLDER_FORMATS = ("safetensors", "monai-bundle")
#: The files of a safetensors export folder (the layout Hugging Face models use).
WEIGHTS_FILE, CONFIG_FILE, CARD_FILE = "model.safetensors", "config.json", "README.md"


def encoder_info(architecture: Mapping[str, Any], recipe: Mapping[str, Any], checkpoint: str, update_step: int,
                 versions: Any) -> dict[str, Any]:
    """What every format records beside the weights: the architecture (the ViT3D encoder's
    arguments), the recipe's ``[transform]`` (how inputs are prepared) and ``[model]``, and
    where the weights come from."""
    from octfw.version import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "octfw_version": __version__,
        "architecture": "vit3d",
        "config": dict(architecture),
        "transform": dict(recipe["transform"]),
        "model": dict(recipe["model"]),
        "checkpoint": str(checkpoint),
        "update_step": int(update_step),
        "versions": versions,
    }


def write_export(export_format: str, out: Path, encoder: nn.Module, info: Mapping[str, Any]) -> None:
    """Write ``encoder`` (a ViT3D encoder: ``[B, C, D, H, W]`` -> ``[B, N, E]``) to ``out``.

    A folder format is written into a hidden sibling folder first and renamed
    onto ``out`` (new or empty) when complete: a failed export leaves nothing.
    """
    import torch

    weights = {k: v.detach().cpu().contiguous().clone() for k, v in encoder.state_dict().items()}
    if export_format == "octfw":
        write_atomically(out, lambda f: torch.save({**info, "state_dict": weights}, f))
    elif export_format == "torchscript":
        _write_torchscript(out, encoder, info)
    elif export_format in FOLDER_FORMATS:
        with _folder_in_place(out) as folder:
            if export_format == "safetensors":
                _write_safetensors_folder(folder, weights, info)
            else:
                _write_monai_bundle(folder, encoder, info)
    else:  # the caller checked the name against EXPORT_FORMATS
        raise ValueError(f"unknown export format {export_format!r}")


def is_new_or_empty(folder: Path) -> bool:
    """Whether a folder export may be written to ``folder`` without replacing anything."""
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


@contextlib.contextmanager
def _folder_in_place(out: Path) -> Iterator[Path]:
    """A temporary folder beside ``out``, renamed onto it if the block succeeds, else removed.
    A non-empty ``out`` is replaced only then (kept, if the block fails)."""
    token = uuid.uuid4().hex[:8]
    temporary, previous = out.parent / f".tmp-{out.name}-{token}", out.parent / f".old-{out.name}-{token}"
    temporary.mkdir()
    try:
        yield temporary
        if not is_new_or_empty(out):
            os.replace(out, previous)
        os.replace(temporary, out)  # rename(2) replaces an empty folder
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.rmtree(previous, ignore_errors=True)


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, default=str) + "\n").encode("utf-8")


def _write_safetensors_folder(folder: Path, weights: Mapping[str, torch.Tensor],
                              info: Mapping[str, Any]) -> None:
    """The Hub layout: model card, weights, then ``config.json`` last."""
    from safetensors.torch import save

    folder.mkdir(parents=True, exist_ok=True)
    parameters = sum(t.numel() for t in weights.values())
    write_atomically(folder / CARD_FILE, model_card(info, parameters).encode("utf-8"))
    write_atomically(folder / WEIGHTS_FILE, save(dict(weights), metadata={"format": FORMAT}))
    write_atomically(folder / CONFIG_FILE, _json(info))


def _traced(encoder: nn.Module) -> torch.jit.ScriptModule:
    import torch

    config = encoder.architecture()
    example = torch.zeros(1, config["in_channels"], *config["image_size"])
    with torch.no_grad():
        return torch.jit.trace(encoder.eval(), example)


def _write_torchscript(out: Path, encoder: nn.Module, info: Mapping[str, Any]) -> None:
    import torch

    extra = {CONFIG_FILE: json.dumps(info, default=str)}
    traced = _traced(encoder)
    write_atomically(out, lambda f: torch.jit.save(traced, f, _extra_files=extra))


def model_card(info: Mapping[str, Any], parameters: int) -> str:
    """``README.md`` of a Hub folder: what the encoder is, where it comes from, how to use it."""
    config, transform = info["config"], dict(info.get("transform") or {})
    model = dict(info.get("model") or {})
    grid = [s // p for s, p in zip(config["image_size"], config["patch_size"])]
    tokens = grid[0] * grid[1] * grid[2]
    lines = [
        "---",
        "library_name: octfw",
        "pipeline_tag: feature-extraction",
        "tags: [octfw, oct, 3d, self-supervised, vit]",
        "---",
        "",
        f"# {model.get('name', 'octfw')} 3D OCT encoder",
        "",
        f"A ViT3D encoder ({parameters:,} parameters: embed_dim {config['embed_dim']}, depth {config['depth']}, "
        f"{config['num_heads']} heads) pretrained with octfw {info.get('octfw_version', '')} "
        f"for {info.get('update_step', 0):,} update steps (checkpoint `{info.get('checkpoint', '')}`).",
        "",
        f"Input: `[B, {config['in_channels']}, {', '.join(map(str, config['image_size']))}]` (B, C, D, H, W), "
        f"prepared by the `[transform]` below. Output: {tokens} patch tokens `[B, {tokens}, {config['embed_dim']}]` "
        f"in row-major order over the {'x'.join(map(str, grid))} patch grid; their mean is the volume's embedding.",
        "",
        "```python",
        "from octfw.encoder import PretrainedEncoder",
        "encoder = PretrainedEncoder.from_pretrained(\"path/or/org-name\")",
        "tokens = encoder.embed(\"scan.dcm\")                      # prepared as in training",
        "embedding = encoder.embed(volume, spacing=(dz, dy, dx), pooled=True)  # a [D, H, W] array, mm",
        "```",
        "",
        "Without octfw, the weights load with `safetensors.torch.load_file(\"model.safetensors\")`; "
        "`config.json` holds the architecture (`config`) and the preparation (`transform`).",
        "",
        "## Preparation (`[transform]` of the pretraining recipe)",
        "",
        "```json",
        json.dumps(transform, indent=2, default=str),
        "```",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------
# MONAI bundle


def bundle_preprocessing(transform: Mapping[str, Any], image_size: list[int]) -> list[dict[str, Any]]:
    """MONAI transforms equal to ``oct-standard``'s ``prepare`` for a ``[1, D, H, W]`` volume
    already at the transform's ``target_spacing``: percentiles to [0, 1] (clipped), fit to
    ``image_size``, clip. Empty for another transform (the bundle then takes prepared input)."""
    if transform.get("name") != "oct-standard":
        return []
    low, high = transform.get("percentiles", (1.0, 99.0))
    if transform.get("fit", "resize") == "resize":
        fit = {"_target_": "Resize", "spatial_size": list(image_size), "mode": "trilinear",
               "anti_aliasing": bool(transform.get("anti_aliasing", True))}
    else:
        fit = {"_target_": "ResizeWithPadOrCrop", "spatial_size": list(image_size), "mode": "constant"}
    return [
        {"_target_": "ScaleIntensityRangePercentiles", "lower": low, "upper": high,
         "b_min": 0.0, "b_max": 1.0, "clip": True},
        fit,
        # interpolation can overshoot by rounding: back to [0, 1], as octfw does
        {"_target_": "ScaleIntensityRange", "a_min": 0.0, "a_max": 1.0, "b_min": 0.0, "b_max": 1.0, "clip": True},
    ]


def bundle_inference_config(info: Mapping[str, Any]) -> dict[str, Any]:
    """``configs/inference.json``: the network from ``models/model.ts``, the preparation, and ``run``."""
    config = info["config"]
    steps = bundle_preprocessing(dict(info.get("transform") or {}), config["image_size"])
    image = "$torch.as_tensor(numpy.load(@input_path), dtype=torch.float32)[None]"  # [1, D, H, W]
    prepared = "@preprocessing(@image)" if steps else "@image"
    return {
        "imports": ["$import numpy", "$import torch", "$import monai"],
        "bundle_root": ".",
        "device": "$torch.device('cpu')",
        "network_def": "$torch.jit.load(@bundle_root + '/models/model.ts', map_location=@device)",
        "network": "$@network_def.eval()",
        "input_path": "volume.npy",
        "output_path": "tokens.npy",
        "image": image,
        "preprocessing": {"_target_": "Compose", "transforms": steps},
        "prepared": f"$torch.as_tensor({prepared}).as_subclass(torch.Tensor)[None].to(@device)",
        "tokens": "$@network(@prepared)",
        "run": ["$numpy.save(@output_path, @tokens.detach().cpu().numpy())"],
    }


def _bundle_metadata(info: Mapping[str, Any]) -> dict[str, Any]:
    import monai
    import numpy
    import torch

    config = info["config"]
    grid = [s // p for s, p in zip(config["image_size"], config["patch_size"])]
    transform = dict(info.get("transform") or {})
    spacing = transform.get("target_spacing")
    return {
        "version": "0.1.0",
        "changelog": {"0.1.0": f"exported by octfw {info.get('octfw_version', '')}"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": numpy.__version__,
        "required_packages_version": {},
        "name": f"octfw {dict(info.get('model') or {}).get('name', '')} 3D OCT encoder".replace("  ", " "),
        "task": "self-supervised 3D OCT representation (patch tokens)",
        "description": (
            f"ViT3D encoder pretrained with octfw for {info.get('update_step', 0)} update steps. "
            "`python -m monai.bundle run --config_file configs/inference.json --bundle_root . "
            "--input_path VOLUME.npy --output_path TOKENS.npy` embeds one [D, H, W] volume"
            + (f" at spacing {spacing} mm (dz, dy, dx)" if spacing else "")
            + (" (raw intensities: the bundle prepares it)" if bundle_preprocessing(transform, config["image_size"])
               else f" already prepared by octfw's transform {transform.get('name')!r}")
            + "."
        ),
        "authors": "octfw",
        "copyright": "see the pretraining data's licence",
        "network_data_format": {
            "inputs": {"image": {
                "type": "image", "format": "magnitude", "modality": "OCT",
                "num_channels": config["in_channels"], "spatial_shape": list(config["image_size"]),
                "dtype": "float32", "value_range": [0, 1], "is_patch_data": False,
                "channel_def": {"0": "OCT"},
            }},
            "outputs": {"pred": {
                "type": "tokens", "format": "patch tokens, row-major over the patch grid",
                "num_channels": config["embed_dim"], "spatial_shape": [grid[0] * grid[1] * grid[2]],
                "dtype": "float32", "is_patch_data": False, "channel_def": {},
            }},
        },
        "octfw": dict(info),  # what the export recorded: checkpoint, update step, recipe tables
    }


def _write_monai_bundle(folder: Path, encoder: nn.Module, info: Mapping[str, Any]) -> None:
    (folder / "configs").mkdir(parents=True, exist_ok=True)
    (folder / "models").mkdir(exist_ok=True)
    (folder / "docs").mkdir(exist_ok=True)
    _write_torchscript(folder / "models" / "model.ts", encoder, info)
    parameters = sum(p.numel() for p in encoder.parameters())
    write_atomically(folder / "docs" / "README.md", model_card(info, parameters).encode("utf-8"))
    write_atomically(folder / "configs" / "inference.json", _json(bundle_inference_config(info)))
    write_atomically(folder / "configs" / "metadata.json", _json(_bundle_metadata(info)))
