"""Registers one dataset, ``npy-folder``: volumes saved with ``numpy.save``, one per file.

Each ``<name>.npy`` holds a ``[D, H, W]`` volume of raw intensities; a
``spacing.json`` beside them gives the voxel spacing in mm (``[dz, dy, dx]``),
and an optional ``labels.json`` maps file names to class labels. The module
imports only attrs and octfw's light modules (``octfw list`` imports it); numpy
is imported when the dataset is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from octfw.display.errors import CorruptFile, UserError
from octfw.recipe.fields import doc
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Provenance, Sample


@attrs.frozen
class NpyFolderConfig:
    path: str = doc("Folder of .npy volumes with a spacing.json beside them.")
    domain: str = doc("Domain (device) of every volume, for per-domain losses.", default="npy")


class NpyFolder:
    """A map-style dataset: ``len``, ``load(i)`` and ``domain(i)`` are all octfw needs."""

    def __init__(self, config: NpyFolderConfig, folder: Path):
        self.config = config
        self.files = sorted(folder.glob("*.npy"))
        if not self.files:
            # A user mistake: one line, exit code 2, naming the option and the value.
            raise UserError(f"dataset.path: no .npy files in {folder}")
        try:
            self.spacing = tuple(float(s) for s in json.loads((folder / "spacing.json").read_text()))
        except (OSError, ValueError) as exc:
            raise UserError(f"dataset.path: {folder / 'spacing.json'} is missing or unreadable ({exc})") from None
        labels = folder / "labels.json"
        self.labels = json.loads(labels.read_text()) if labels.exists() else {}

    def __len__(self) -> int:
        return len(self.files)

    def domain(self, index: int) -> str:
        return self.config.domain

    def load(self, index: int) -> Sample:
        import numpy as np

        path = self.files[index]
        try:
            volume = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            # A file that cannot be used: octfw quarantines it and goes on with the next one.
            raise CorruptFile(str(path), f"not a numpy volume ({exc})") from None
        if volume.ndim != 3:
            raise CorruptFile(str(path), f"expected [D, H, W], got shape {list(volume.shape)}")
        provenance = Provenance(source=str(path), domain=self.config.domain, spacing=self.spacing,
                                original_shape=tuple(volume.shape), label=self.labels.get(path.name))
        return Sample(volume.astype(np.float32), provenance)


def build(config: NpyFolderConfig, ctx: BuildContext) -> NpyFolder:
    folder = Path(config.path)
    if not folder.is_absolute():
        folder = ctx.recipe_dir / folder  # relative to the recipe that names it
    if not folder.is_dir():
        raise UserError(f"dataset.path: {folder} is not a folder")
    return NpyFolder(config, folder)


@hookimpl
def octfw_register_datasets(register: Register) -> None:
    register("npy-folder", NpyFolderConfig, build, "Volumes saved with numpy.save, one per file.")
