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
  ``configs/inference.json``, ``scripts/vit3d.py``, ``models/model.pt``,
  ``models/model.ts``, ``docs/README.md``) that ``python -m monai.bundle run``
  loads and runs without octfw: it reads a ``[D, H, W]`` volume from
  ``--input_path`` with MONAI's ``LoadImage`` (DICOM, NIfTI with nibabel,
  ``.npy``), prepares it with MONAI transforms equal to octfw's
  ``oct-standard`` preparation, and saves the patch tokens to
  ``--output_path``. Its ``network_def`` is the encoder class (the source of
  :mod:`octfw.models.vit3d`, which imports torch only) and ``models/model.pt``
  its state dict: a MONAI user builds and fine-tunes it without octfw.

No exported file holds a local path: the checkpoint is named by its file name
and run (:func:`encoder_info`).

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
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from octfw.storage.files import write_atomically

if TYPE_CHECKING:  # torch is imported where it is used: the export command's --help lists EXPORT_FORMATS
    import torch
    from torch import nn

__all__ = ["FORMAT", "FORMAT_VERSION", "EXPORT_FORMATS", "FOLDER_FORMATS", "WEIGHTS_FILE", "CONFIG_FILE",
           "CARD_FILE", "DEFAULT_LICENSE", "BUNDLE_NETWORK", "BUNDLE_WEIGHTS",
           "BUNDLE_METADATA", "encoder_info", "dataset_label", "run_name", "is_new_or_empty",
           "is_export_folder", "write_export", "model_card", "bundle_inference_config"]

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
                _write_monai_bundle(folder, encoder, weights, info)
    else:  # the caller checked the name against EXPORT_FORMATS
        raise ValueError(f"unknown export format {export_format!r}")


def is_new_or_empty(folder: Path) -> bool:
    """Whether a folder export may be written to ``folder`` without replacing anything."""
    return not folder.exists() or (folder.is_dir() and not any(folder.iterdir()))


def is_export_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a folder export (what ``--force`` may replace)."""
    return (folder / CONFIG_FILE).is_file() or (folder / BUNDLE_METADATA).is_file()


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
    title = f"{model.get('name', 'octfw')} 3D OCT encoder"
    source = f"checkpoint `{info.get('checkpoint', '')}`" + (f" of run `{info['run']}`" if info.get("run") else "")
    lines = [
        *_front_matter(info, title),
        "",
        f"# {title}",
        "",
        f"A ViT3D encoder ({parameters:,} parameters: embed_dim {config['embed_dim']}, depth {config['depth']}, "
        f"{config['num_heads']} heads) pretrained with octfw {info.get('octfw_version', '')} "
        f"for {info.get('update_step', 0):,} update steps ({source}) "
        f"on {', '.join(info.get('datasets') or ['unrecorded data'])}.",
        "",
        f"Licence: `{info.get('license') or DEFAULT_LICENSE}`"
        + (" (not stated at export: the pretraining data's terms decide)"
           if (info.get("license") or DEFAULT_LICENSE) == DEFAULT_LICENSE else "") + ".",
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
        *_metrics_section(info.get("metrics") or []),
    ]
    return "\n".join(lines)


def _metrics_section(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The evaluator results as a table, or a sentence saying there are none."""
    if not results:
        return ["## Evaluation", "", "No evaluator results were recorded with this export.", ""]
    rows = [f"| {r['evaluator']} | {r['metric']} | {float(r['value']):.4f} | {r.get('dataset') or ''} | {r['step']} |"
            for r in results]
    return ["## Evaluation (the run's evaluators, on frozen features)", "",
            "| evaluator | metric | value | dataset | update step |", "|---|---|---|---|---|", *rows, ""]


def _front_matter(info: Mapping[str, Any], title: str) -> list[str]:
    """The model card's YAML metadata as the Hub reads it: licence, datasets, and the
    evaluator results as ``metrics`` and ``model-index``. Strings and numbers are written
    as JSON, which YAML reads unchanged."""
    q = json.dumps
    lines = ["---", "library_name: octfw", "pipeline_tag: feature-extraction",
             f"license: {q(info.get('license') or DEFAULT_LICENSE)}",
             "tags: [octfw, oct, 3d, self-supervised, vit]"]
    datasets = [str(d) for d in info.get("datasets") or []]
    if datasets:
        lines += ["datasets:", *(f"- {q(d)}" for d in datasets)]
    results = list(info.get("metrics") or [])
    if results:
        lines += ["metrics:", *(f"- {q(m)}" for m in dict.fromkeys(str(r["metric"]) for r in results))]
        lines += ["model-index:", f"- name: {q(title)}", "  results:"]
        # One result per evaluator and its dataset, with each of its metrics.
        groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for r in results:
            groups.setdefault((str(r["evaluator"]), str(r.get("dataset") or "unknown")), []).append(r)
        for (evaluator, dataset), group in groups.items():
            lines += ["  - task:", "      type: feature-extraction",
                      f"      name: {q(evaluator + ' on frozen features')}",
                      "    dataset:", f"      name: {q(dataset)}", f"      type: {q(dataset)}", "    metrics:"]
            for r in group:
                lines += [f"    - type: {q(str(r['metric']))}", f"      value: {q(float(r['value']))}",
                          f"      name: {q(evaluator + '/' + str(r['metric']))}"]
    return [*lines, "---"]


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
    """``configs/inference.json``: the network (``network_def``: the class in ``scripts/vit3d.py``
    with the recorded architecture; its weights in ``models/model.pt``), ``LoadImage`` for
    DICOM, NIfTI and ``.npy``, the preparation, and ``run``.

    The class is loaded by file path (``runpy``), so the config works from any working
    folder, through ``monai.bundle.run`` or a ``ConfigParser`` alike. ``run`` loads the
    weights before it embeds: each of its items is resolved in turn.
    """
    config = info["config"]
    steps = bundle_preprocessing(dict(info.get("transform") or {}), config["image_size"])
    prepared = "@preprocessing(@image)" if steps else "@image"
    return {
        "imports": ["$import numpy", "$import runpy", "$import torch", "$import monai"],
        "bundle_root": ".",
        "device": "$torch.device('cpu')",
        "network_module": f"$runpy.run_path(@bundle_root + '/{BUNDLE_NETWORK}')",
        "network_def": {"_target_": "$@network_module['ViT3DEncoder']", **config},
        "network": "$@network_def.to(@device)",
        "weights_path": f"$@bundle_root + '/{BUNDLE_WEIGHTS}'",
        "load_weights": "$@network.load_state_dict(torch.load(@weights_path, map_location=@device, weights_only=True))",
        "input_path": "volume.npy",
        "output_path": "tokens.npy",
        # A DICOM file or series, a NIfTI file (with nibabel installed) or a .npy array, as
        # [1, D, H, W]. Pydicom's reader keeps the frame axis first (swap_ij false), as octfw
        # reads DICOM; the others are MONAI's defaults.
        "loader": {"_target_": "LoadImage", "reader": [{"_target_": "PydicomReader", "swap_ij": False}],
                   "image_only": True, "ensure_channel_first": True, "dtype": "$numpy.float32"},
        "image": "$@loader(@input_path)",
        "preprocessing": {"_target_": "Compose", "transforms": steps},
        "prepared": f"$torch.as_tensor({prepared}).as_subclass(torch.Tensor)[None].to(@device)",
        "tokens": "$@network.eval()(@prepared)",
        "run": ["$@load_weights", "$numpy.save(@output_path, @tokens.detach().cpu().numpy())"],
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
        # LoadImage's readers: DICOM with pydicom, NIfTI with nibabel; .npy needs neither.
        "optional_packages_version": {name: version for name in ("pydicom", "nibabel")
                                      if (version := _installed_version(name)) is not None},
        "name": f"octfw {dict(info.get('model') or {}).get('name', '')} 3D OCT encoder".replace("  ", " "),
        "task": "self-supervised 3D OCT representation (patch tokens)",
        "description": (
            f"ViT3D encoder pretrained with octfw for {info.get('update_step', 0)} update steps. "
            "`python -m monai.bundle run --config_file configs/inference.json --bundle_root . "
            "--input_path VOLUME --output_path TOKENS.npy` embeds one [D, H, W] volume (a DICOM file or series, "
            "a NIfTI file with nibabel installed, or a .npy array; axes B-scans, depth, A-scans)"
            + (f" at spacing {spacing} mm (dz, dy, dx)" if spacing else "")
            + (" (raw intensities: the bundle prepares it)" if bundle_preprocessing(transform, config["image_size"])
               else f" already prepared by octfw's transform {transform.get('name')!r}")
            + ". `network_def` builds the encoder (scripts/vit3d.py, no octfw needed) and models/model.pt holds "
            "its weights, to fine-tune it; models/model.ts is the same network as TorchScript."
        ),
        "authors": "octfw",
        "license": str(info.get("license") or DEFAULT_LICENSE),
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


def _installed_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _write_monai_bundle(folder: Path, encoder: nn.Module, weights: Mapping[str, torch.Tensor],
                        info: Mapping[str, Any]) -> None:
    """The bundle: the network's source and weights, the TorchScript file, the model card,
    the inference config, then ``configs/metadata.json`` last."""
    import inspect

    import torch

    for sub in ("configs", "models", "docs", "scripts"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    # The encoder's module, copied as it is: it imports torch only, so the bundle
    # defines the network without octfw (tests/test_embed.py loads it so).
    write_atomically(folder / BUNDLE_NETWORK, Path(inspect.getfile(type(encoder))).read_bytes())
    write_atomically(folder / BUNDLE_WEIGHTS, lambda f: torch.save(dict(weights), f))
    _write_torchscript(folder / "models" / "model.ts", encoder, info)
    parameters = sum(p.numel() for p in encoder.parameters())
    write_atomically(folder / "docs" / "README.md", model_card(info, parameters).encode("utf-8"))
    write_atomically(folder / "configs" / "inference.json", _json(bundle_inference_config(info)))
    write_atomically(folder / BUNDLE_METADATA, _json(_bundle_metadata(info)))
