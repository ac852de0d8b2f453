"""Rendering a drawn retina into the stored voxels of one volume: reflectivity, speckle, noise.

:mod:`.retina` draws where each layer and finding lies; :func:`render_volume`
turns that into what a device stores: the layers' reflectivity with blurred
boundaries, the choroid below, a lesion's brightness, multiplicative speckle
and detector noise, scaled by the profile's gain and offset (:mod:`.vendors`).
16-bit profiles store the level linearly, exactly as generator version 2 did;
8-bit ones store it log-compressed, as devices export B-scans, and render
fast enough for device-sized volumes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from octfw.plugins.datasets.synthetic.vendors import VendorProfile

__all__ = ["render_volume"]

_FULL_SCALE = 20000.0  # stored units of reflectivity 1.0 at gain 1
# 8-bit volumes store log(level / _LOG_FLOOR) / log(65535 / _LOG_FLOOR) x 255
# of the 16-bit level, clipped: 8-bit OCT exports are log-compressed, and
# this floor (below every profile's background offset) keeps the vitreous
# dark grey and the 16-bit range's top at 255.
_LOG_FLOOR = 100.0


def render_volume(rng: np.random.Generator, shape: tuple[int, int, int], z: np.ndarray, x: np.ndarray,
                  layers: list, blob: Any, profile: VendorProfile) -> np.ndarray:
    """The stored voxels ``[D, H, W]`` of a drawn retina: uint16 for a 16-bit profile, uint8 (log-scaled)
    for an 8-bit one (:func:`_render_16bit`, :func:`_render_8bit`).

    ``z`` and ``x`` are the scan's coordinates (``[D, 1, 1]`` and ``[1, 1, W]``, over [-1, 1]),
    ``layers`` the drawn (top, bottom, reflectivity) of every layer (positions ``[D, 1, W]`` in units
    of H) and ``blob`` the lesion's (centre, 1/e radii) along (z, y, x), or None. Speckle and noise
    are drawn from ``rng``.
    """
    render = _render_16bit if profile.bits == 16 else _render_8bit
    return render(rng, shape, z, x, layers, blob, profile)


def _choroid(y: np.ndarray, epithelium: np.ndarray) -> np.ndarray:
    """The choroid under the pigment epithelium's base: bright, fading with depth."""
    below = np.clip(y - epithelium, 0.0, None)
    return 0.45 * np.exp(-below / 0.09) * (y > epithelium)


def _lesion(z: np.ndarray, y: np.ndarray, x: np.ndarray, blob: Any) -> np.ndarray:
    (centre_z, centre_y, centre_x), (radius_z, radius_y, radius_x) = blob
    return 1.2 * np.exp(
        -((z - centre_z) / radius_z) ** 2
        - ((y - centre_y) / radius_y) ** 2
        - ((x - centre_x) / radius_x) ** 2
    )


def _render_16bit(rng: np.random.Generator, shape: tuple[int, int, int], z: np.ndarray, x: np.ndarray,
                  layers: list, blob: Any, profile: VendorProfile) -> np.ndarray:
    """The volume as generator version 2 drew it, in float64: same numbers, same bytes."""
    depth, height, width = shape
    y = np.linspace(0.0, 1.0, height)[None, :, None]
    edge = 0.6 / height  # boundaries blur over about one voxel
    signal = np.zeros(shape, dtype=np.float64)
    for top, bottom, reflectivity in layers:
        inside = 1.0 / (1.0 + np.exp(-(y - top) / edge)) - 1.0 / (1.0 + np.exp(-(y - bottom) / edge))
        signal += reflectivity * inside
    signal += _choroid(y, layers[-1][1])
    if blob is not None:
        signal += _lesion(z, y, x, blob)

    # Speckle is multiplicative (gamma with `looks` degrees); then detector noise.
    speckle = rng.gamma(profile.looks, 1.0 / profile.looks, size=signal.shape)
    noisy = signal * speckle + rng.normal(0.0, profile.noise, size=signal.shape)
    stored = profile.offset + profile.gain * _FULL_SCALE * noisy
    return np.clip(np.rint(stored), 0, 65535).astype(np.uint16)


_SLAB_VOXELS = 1 << 20  # 8-bit volumes are rendered a few B-scans at a time: fits in cache
_NOISE_DRAWS = 1 << 16  # speckle and noise values each voxel picks one of


def _render_8bit(rng: np.random.Generator, shape: tuple[int, int, int], z: np.ndarray, x: np.ndarray,
                 layers: list, blob: Any, profile: VendorProfile) -> np.ndarray:
    """The same retina as :func:`_render_16bit`, mapped to log-scaled uint8, fast.

    Device-sized volumes have up to 67 M voxels; :func:`_render_16bit` took
    31 s and 3.7 GB for a Cirrus-sized one. Three things differ, none of
    which 8 bits show: float32 throughout, a few B-scans at a time (in
    cache, little memory); the layers as one tanh step per boundary, shared
    by the layers either side of it (9 or 10 instead of 16 sigmoids); and
    each voxel's speckle and noise picked from 65,536 gamma and normal draws
    of the volume (drawing 67 M gamma and normal variates alone took 2-3 s).
    The result is the 16-bit volume's log mapping to within a grey level,
    speckle and noise aside (tests/test_synthetic_device_sizes.py).
    """
    depth, height, width = shape
    # A layer of reflectivity r between positions a < b is r (s(y - a) - s(y - b))
    # with s the logistic step of width `edge`; s(t) = (1 + tanh(t / 2 edge)) / 2
    # and the constants cancel over a layer, so the signal is a sum of
    # weight / 2 x tanh((y - boundary) / 2 edge) over the boundaries.
    scale = height / 1.2  # 1 / (2 edge), edge = 0.6 / height as in _render_16bit
    steps: list[tuple[np.ndarray, float]] = []
    for top, bottom, reflectivity in layers:
        if steps and steps[-1][0] is top:
            steps[-1] = (top, steps[-1][1] + reflectivity)
        else:
            steps.append((top, reflectivity))
        steps.append((bottom, -reflectivity))
    boundaries = [(np.float32(scale) * position).astype(np.float32) for position, _w in steps]
    halves = [np.float32(weight / 2.0) for _p, weight in steps]
    epithelium = layers[-1][1].astype(np.float32)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[None, :, None]
    y_scaled = np.float32(scale) * y
    z32, x32 = z.astype(np.float32), x.astype(np.float32)

    speckle_draws = rng.gamma(profile.looks, 1.0 / profile.looks, size=_NOISE_DRAWS).astype(np.float32)
    noise_draws = rng.normal(0.0, profile.noise, size=_NOISE_DRAWS).astype(np.float32)
    to_level = np.float32(profile.gain * _FULL_SCALE)
    to_byte = np.float32(255.0 / math.log(65535.0 / _LOG_FLOOR))

    volume = np.empty(shape, dtype=np.uint8)
    slab = max(1, _SLAB_VOXELS // (height * width))
    for start in range(0, depth, slab):
        rows = slice(start, min(start + slab, depth))
        signal = np.zeros((rows.stop - start, height, width), dtype=np.float32)
        step = np.empty_like(signal)
        for boundary, half in zip(boundaries, halves):
            np.subtract(y_scaled, boundary[rows], out=step)
            np.tanh(step, out=step)
            step *= half
            signal += step
        signal += _choroid(y, epithelium[rows])
        if blob is not None:
            signal += _lesion(z32[rows], y, x32, blob)
        picks = rng.integers(0, _NOISE_DRAWS, size=(2, *signal.shape), dtype=np.uint16).astype(np.intp)
        signal *= np.take(speckle_draws, picks[0])
        signal += np.take(noise_draws, picks[1])
        # Log-compress the 16-bit level (see _LOG_FLOOR) into 0..255.
        level = signal * to_level
        level += np.float32(profile.offset)
        np.maximum(level, np.float32(_LOG_FLOOR), out=level)
        np.log(level, out=level)
        level -= np.float32(math.log(_LOG_FLOOR))
        level *= to_byte
        np.minimum(level, np.float32(255.0), out=level)
        volume[rows] = np.rint(level)
    return volume
