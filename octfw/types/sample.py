"""One volume between the dataset and the transform: :class:`Sample` (float32 ``[D, H, W]``)
and where it came from (:class:`Provenance`). Shared by both stages' contracts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = ["Provenance", "Sample"]


@attrs.frozen
class Provenance:
    """Where a sample came from. Carries no patient identifier, ever."""

    source: str  #: URL of the file (or of the series folder)
    domain: str  #: cohort domain, usually the device manufacturer
    spacing: tuple[float, float, float]  #: (dz, dy, dx) in mm
    original_shape: tuple[int, ...]  #: shape of the volume as stored
    label: int | None = None  #: optional class label for evaluation


@attrs.frozen(eq=False)
class Sample:
    """One volume as a dataset yields it: float32 ``[D, H, W]`` plus provenance."""

    volume: "np.ndarray"
    provenance: Provenance
    #: Set by a dataset of already prepared volumes (``prepared``): the
    #: ``cache_key()`` of the transform that prepared ``volume``. A transform
    #: with that key returns the volume from ``prepare`` unchanged (as
    #: float32). ``volume`` is then as stored: uint8 (``b / 255``) or float16.
    prepared_key: str | None = None
