"""What the configs of a MONAI bundle export say (``octfw export --format monai-bundle``).

``configs/inference.json`` builds the network from the bundle's copy of its class, loads its
weights, reads a volume with MONAI's ``LoadImage`` and prepares it with MONAI transforms equal
to octfw's ``oct-standard``; ``configs/metadata.json`` describes the bundle and keeps the
export's ``info``. :mod:`octfw.exports.writing` writes the bundle's files.
"""

from __future__ import annotations

from typing import Any, Mapping

from octfw.exports.formats import BUNDLE_NETWORK, BUNDLE_WEIGHTS, DEFAULT_LICENSE

__all__ = ["bundle_preprocessing", "bundle_inference_config", "bundle_metadata"]


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


def bundle_metadata(info: Mapping[str, Any]) -> dict[str, Any]:
    """``configs/metadata.json``: the bundle's versions, description and data formats, and
    the export's ``info`` (its ``octfw`` entry, which :mod:`octfw.exports.reading` reads)."""
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
