"""Which files of a synthetic cohort are broken, and how: the failures the DICOM reader must catch.

A cohort with ``corrupt_fraction`` breaks that share of its files (rounded
half up, :func:`corrupt_count`), chosen from the seed and the cohort's size
alone (:func:`corrupted_files`), in turn as each of :data:`CORRUPTION_KINDS`
(:func:`corrupt_bytes`), so the same options break the same files the same way.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["CORRUPTION_KINDS", "corrupt_count", "corrupted_files", "corrupt_bytes"]

#: Ways a synthetic file is broken, matching what the reader must catch.
CORRUPTION_KINDS: tuple[str, ...] = ("truncated", "not-dicom", "no-pixel-data", "constant")


def corrupt_count(n_volumes: int, corrupt_fraction: float) -> int:
    """How many of ``n_volumes`` a cohort corrupts (rounded half up)."""
    return min(n_volumes, math.floor(corrupt_fraction * n_volumes + 0.5))


def corrupted_files(seed: int, n_volumes: int, corrupt_fraction: float) -> dict[int, str]:
    """The index of every file a cohort breaks -> the kind of :data:`CORRUPTION_KINDS` it is broken as."""
    selection = np.random.default_rng([seed, n_volumes, 1])
    corrupt_indices = sorted(
        int(i) for i in selection.choice(n_volumes, corrupt_count(n_volumes, corrupt_fraction), replace=False)
    )
    return {index: CORRUPTION_KINDS[k % len(CORRUPTION_KINDS)] for k, index in enumerate(corrupt_indices)}


def corrupt_bytes(kind: str, good: bytes, volume: np.ndarray, encode: Any, rng: np.random.Generator) -> bytes:
    """The bytes of a file broken in the way ``kind`` names."""
    if kind == "truncated":
        # Cut the file inside its pixel data, mid-frame; the header stays readable.
        return good[: len(good) - volume.nbytes // 2 - volume[0].nbytes // 3]
    if kind == "not-dicom":
        return b"not a DICOM file\n" + rng.bytes(512)
    if kind == "no-pixel-data":
        # Pixel Data is the last element: end the file just before its tag
        # (searched for before the pixels, which may hold its bytes).
        return good[: good.rindex(b"\xe0\x7f\x10\x00", 0, len(good) - volume.nbytes)]
    if kind == "constant":
        return encode(np.full_like(volume, int(volume.mean())))
    raise ValueError(f"unknown corruption {kind!r}; known: {list(CORRUPTION_KINDS)}")
