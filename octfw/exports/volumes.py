"""Volumes as users have them, for an exported encoder to embed: a location opened as a
dataset through the registry (DICOM, a raw vendor file, a prepared store...), or an array
with its spacing."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from octfw.display.errors import UserError
from octfw.recipe import build_component
from octfw.registry import DISABLE_ENV, Registry
from octfw.types import BuildContext, Provenance, RecognisingDatasetConfig, Sample

__all__ = ["DEFAULT_DATASET", "open_volumes", "array_sample"]

#: What :func:`open_volumes` builds when no dataset recognises the location.
DEFAULT_DATASET = "dicom"


def open_volumes(location: str | Path, registry: Registry) -> Any:
    """The volumes at ``location`` as a dataset, built through the registry like a recipe's:
    the dataset whose config recognises the location (:class:`~octfw.types.RecognisingDatasetConfig`:
    a store written by ``octfw prepare``, a raw vendor file...), else DICOM files, a folder, glob or
    manifest of them (:data:`DEFAULT_DATASET`)."""
    from octfw.storage.files import open_filesystem

    text = str(location)
    fs, root = open_filesystem(text, setting="embed")
    names = [component.name for component in registry.by_stage("dataset")
             if isinstance(component.config, RecognisingDatasetConfig) and component.config.recognises(fs, root)]
    if len(names) > 1:
        raise UserError(f"{location}: several datasets recognise it ({', '.join(names)}); "
                        f"block the plugins you do not want with {DISABLE_ENV}")
    local = text if "://" in text else str(Path(text).absolute())
    ctx = BuildContext(recipe_dir=Path.cwd(), cache_dir=Path.cwd(), run_dir=None, seed=0, registry=registry)
    return build_component(registry, "dataset", {"name": names[0] if names else DEFAULT_DATASET, "path": local},
                           ctx, str(location))


def array_sample(volume: Any, spacing: Sequence[float] | None) -> Sample:
    """A raw ``[D, H, W]`` array or tensor as a Sample; its spacing in mm is required."""
    array = volume.detach().cpu().numpy() if isinstance(volume, torch.Tensor) else np.asarray(volume)
    if array.ndim != 3:
        raise UserError(f"embed: expected a volume [D, H, W], got an array of shape {list(array.shape)} "
                        "(a prepared [B, C, D, H, W] tensor is taken as it is)")
    if spacing is None or len(spacing) != 3 or not all(float(s) > 0 for s in spacing):
        raise UserError(f"embed: an array needs spacing=(dz, dy, dx) in mm (> 0), got {spacing!r}")
    provenance = Provenance("array", "unknown", tuple(float(s) for s in spacing), tuple(array.shape))
    return Sample(array.astype(np.float32, copy=False), provenance)
