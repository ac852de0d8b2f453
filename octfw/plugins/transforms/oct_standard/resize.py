"""Anti-aliased trilinear resizing as one small matrix per axis.

MONAI's ``Resize(size, mode="trilinear", anti_aliasing=True)`` smooths the
whole volume with a Gaussian (``GaussianSmooth``: zero-padded separable
convolutions with MONAI's ``erf`` kernel, sigma ``(in / out - 1) / 2`` on
the axes that shrink) and then interpolates it (``F.interpolate``,
``align_corners=False``). Both steps are linear and act on each axis
separately, so their product along one axis is one ``[out, in]`` matrix, and
the whole resize is three matrix products, each on a volume already reduced
along the axes before it. That computes the same numbers (within float32
rounding: ``tests/test_resize.py`` compares it with MONAI on every vendor
geometry) at a fraction of the cost: the convolution runs over the full
input and writes a full-size smoothed copy, where the matrices go straight
to the output size, the most-shrinking axis first.

This is why ``oct-standard`` does not call MONAI's ``Resize`` for its
deterministic half; MONAI stays where its generality is worth it (the
random affine of the views, crop and pad).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np
import torch

__all__ = ["resize", "axis_matrix", "nearest_indices"]

#: MONAI's GaussianSmooth default: the kernel reaches 4 sigma either side.
TRUNCATED = 4.0


def _gaussian_kernel(sigma: float) -> np.ndarray:
    """MONAI's ``gaussian_1d(sigma, truncated=4.0, approx="erf")``: each tap the Gaussian's
    mass over its unit interval, not normalised (``[0, 1, 0]`` at sigma 0)."""
    tail = int(max(sigma * TRUNCATED, 0.5) + 0.5)
    x = np.arange(-tail, tail + 1, dtype=np.float64)
    if sigma <= 0:
        return (x == 0).astype(np.float64)
    t = 1.0 / (math.sqrt(2.0) * sigma)
    erf = np.vectorize(math.erf)
    return np.clip(0.5 * (erf(t * (x + 0.5)) - erf(t * (x - 0.5))), 0.0, None)


@functools.lru_cache(maxsize=64)
def axis_matrix(size_in: int, size_out: int, anti_aliasing: bool) -> np.ndarray:
    """``[size_out, size_in]``: linear interpolation (``align_corners=False``) after, when
    shrinking with ``anti_aliasing``, zero-padded Gaussian smoothing; float64."""
    # float32 where MONAI and torch compute in float32 (the sigma, the source index), so the
    # weights match theirs to the last bits, not only to float64 precision.
    scale = np.float32(size_in) / np.float32(size_out)
    smooth = np.eye(size_in)
    if anti_aliasing and size_out < size_in:
        kernel = _gaussian_kernel(float(max(np.float32(0.0), (scale - np.float32(1.0)) / np.float32(2.0))))
        tail = len(kernel) // 2
        smooth = np.zeros((size_in, size_in))
        for offset, weight in zip(range(-tail, tail + 1), kernel):  # zero padding: taps past an edge are dropped
            smooth += weight * np.eye(size_in, k=offset)
    # F.interpolate, linear, align_corners=False: source = (i + 0.5) * scale - 0.5, clamped at 0.
    source = np.maximum((np.arange(size_out, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5),
                        np.float32(0.0))
    low = np.minimum(source.astype(np.int64), size_in - 1)
    high = np.minimum(low + 1, size_in - 1)
    frac = np.clip(source - low.astype(np.float32), 0.0, 1.0).astype(np.float64)
    interpolate = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    np.add.at(interpolate, (rows, low), 1.0 - frac)
    np.add.at(interpolate, (rows, high), frac)
    return interpolate @ smooth


def resize(volume: torch.Tensor, size: Sequence[int], anti_aliasing: bool) -> torch.Tensor:
    """``volume [D, H, W]`` (float32) resized to ``size`` as MONAI's anti-aliased trilinear
    ``Resize`` does; the volume itself when the size is unchanged."""
    size = tuple(int(s) for s in size)
    if tuple(volume.shape) == size:
        return volume
    # The axis that shrinks most first: every later product runs on fewer voxels.
    order = sorted(range(3), key=lambda axis: size[axis] / volume.shape[axis])
    out = volume
    for axis in order:
        if out.shape[axis] == size[axis]:
            continue
        matrix = torch.from_numpy(axis_matrix(out.shape[axis], size[axis], anti_aliasing).astype(np.float32))
        out = torch.movedim(torch.tensordot(matrix, out, dims=([1], [axis])), 0, axis)
    return out.contiguous()


@functools.lru_cache(maxsize=64)
def nearest_indices(size_in: int, size_out: int) -> np.ndarray:
    """``[size_out]``: for each output position, the input index that :func:`resize`'s linear
    interpolation (without anti-aliasing) weighs most, the lower one on a tie: resizing labels
    along the same coordinates as the volume without mixing their values."""
    return np.argmax(axis_matrix(size_in, size_out, False), axis=1)
