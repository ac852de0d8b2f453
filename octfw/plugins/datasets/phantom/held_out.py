"""The ``held-out`` phantom family: cysts in a smooth layered retina, gamma speckle, log scale.

Eight layers, each a constant reflectivity between two sigmoid edges, are
summed along depth; their thicknesses are shares of the retina drawn per
patient. The fovea is a Gaussian pit in which the inner layers thin away
while the outer nuclear layer thickens. The retina is tilted (the scan is
not square to the eye), the image darkens towards its corners (vignetting),
the intensity carries gamma speckle of a vendor's number of looks, and the
files hold it log-compressed as devices export.

The finding, cystoid macular oedema, swells the inner nuclear layer around
the fovea and puts a few dozen small, optically empty (dark) ellipsoidal
pockets in it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from octfw.plugins.datasets.phantom.config import FAMILY_LAYERS
from octfw.plugins.datasets.phantom.devices import Vendor, layer_labels

__all__ = ["TASK", "VENDORS", "LAYER_NAMES", "draw_patient", "render", "render_labelled"]

TASK = "cysts"
VENDORS = (
    Vendor("optopol", "REVO NX", (28, 72, 112), (0.214, 0.0278, 0.0536), gain=5000.0, speckle=1.5),
    Vendor("bioptigen", "Envisu R2200", (18, 112, 72), (0.333, 0.0179, 0.0833), gain=6500.0, speckle=3.0),
    Vendor("moptim", "MOCT-1000", (24, 96, 96), (0.25, 0.0208, 0.0625), gain=4000.0, speckle=2.0),
)
#: Layers from the vitreous down: NFL, GCL, IPL, INL, OPL, ONL, IS/OS, RPE.
LAYER_SHARE = np.array([0.12, 0.14, 0.12, 0.11, 0.10, 0.26, 0.07, 0.08])
LAYER_LEVEL = np.array([0.8, 0.35, 0.55, 0.12, 0.5, 0.08, 0.75, 1.0])
#: Layer labels (value = index): the vitreous, the eight layers, the choroid (all below the RPE);
#: each voxel the layer between whose sigmoid edges its centre lies. The cysts stay INL (the finding mask).
LAYER_NAMES = FAMILY_LAYERS["held-out"]
INNER_LAYERS = 5  # NFL to OPL: they thin away in the fovea
INL = 3  # the inner nuclear layer, where the cysts form
LOG_RANGE = 200.0  # the log compression's dynamic range (intensity 1 -> full scale)
#: Cysts at finding_scale 1: lateral and axial radius ranges (mm), how many, and how far from
#: the fovea. Sized by benchmarks/learning/phantom_tasks.py (its HISTORY lists the shapes tried): cysts
#: alone were read by an attentive probe on a random encoder before the voxels saw them; with
#: the swelling of the layer they sit in, the voxels see the finding first.
CYST_RADIUS = (0.15, 0.30)
CYST_HEIGHT = (0.045, 0.09)
CYST_COUNT = (20, 40)
CYST_SPREAD = 1.2  # mm: cysts gather around the fovea, within this of it
#: The inner nuclear layer swells around the fovea with the fluid: peak (mm) and width (sigma, mm).
SWELLING = (0.09, 0.18)
SWELLING_WIDTH = 0.6


def draw_patient(rng: np.random.Generator) -> dict[str, Any]:
    """One patient's anatomy, shared by both eyes."""
    shares = LAYER_SHARE * rng.lognormal(0.0, 0.1, LAYER_SHARE.size)
    return {
        "top": rng.uniform(0.6, 0.7),  # mm; devices track the retina into the window
        "thickness": rng.uniform(0.24, 0.30),
        "shares": shares / shares.sum(),
        "levels": LAYER_LEVEL * rng.lognormal(0.0, 0.1, LAYER_LEVEL.size),
        "pit_sigma": rng.uniform(0.35, 0.55),
        "pit_depth": rng.uniform(0.5, 0.7),
        "fovea": rng.normal(0.0, 0.15, 2),  # mm; fixation centres the scan on it
        "tilt": rng.uniform(-0.04, 0.04, 2),  # mm of depth per mm along z and x
        "edge": rng.uniform(0.006, 0.01),  # mm, softness of the layer boundaries
        "choroid": rng.uniform(0.1, 0.2),
    }


def _cysts(rng: np.random.Generator, z: np.ndarray, y: np.ndarray, x: np.ndarray, fovea: np.ndarray,
           middle: np.ndarray, scale: float) -> np.ndarray:
    """Share of each voxel [D,H,W] left after the cysts empty it (0 inside a cyst)."""
    left = np.ones((z.shape[0], y.shape[1], x.shape[2]))
    zs, xs = z[:, 0, 0], x[0, 0, :]
    for _ in range(rng.integers(*CYST_COUNT)):
        angle, distance = rng.uniform(0, 2 * np.pi), rng.uniform(0.0, CYST_SPREAD)
        cz, cx = fovea + distance * np.array([np.sin(angle), np.cos(angle)])
        radius, height = rng.uniform(*CYST_RADIUS) * scale, rng.uniform(*CYST_HEIGHT) * scale
        # Only the columns within its radius: dozens of cysts over the whole volume would be slow.
        near_z = np.flatnonzero(np.abs(zs - cz) < radius)
        near_x = np.flatnonzero(np.abs(xs - cx) < radius)
        if not (near_z.size and near_x.size):
            continue
        box = np.s_[near_z[0]:near_z[-1] + 1, :, near_x[0]:near_x[-1] + 1]
        # The cyst sits in the middle of the inner nuclear layer above its centre column.
        centre = middle[int(np.abs(zs - cz).argmin()), 0, int(np.abs(xs - cx).argmin())]
        distance2 = ((z[box[0]] - cz) ** 2 + (x[..., box[2]] - cx) ** 2) / radius**2 + (y - centre) ** 2 / height**2
        left[box] = np.minimum(left[box], np.clip(4.0 * (distance2 - 0.75), 0.0, 1.0))  # a soft wall
    return left


def render(rng: np.random.Generator, anatomy: dict[str, Any], vendor: Vendor, *, mirrored: bool,
           positive: bool, finding_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One eye and its finding mask: :func:`render_labelled` without the layer labels."""
    return render_labelled(rng, anatomy, vendor, mirrored=mirrored, positive=positive,
                           finding_scale=finding_scale)[:2]


def render_labelled(rng: np.random.Generator, anatomy: dict[str, Any], vendor: Vendor, *, mirrored: bool,
                    positive: bool, finding_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One eye, its finding mask and its layer labels (uint8 ``vendor.shape``, :data:`LAYER_NAMES`,
    from the edges the layers are drawn between; no random draw). One eye as uint16 ``vendor.shape`` and its finding mask (bool, the same shape: the voxels
    the cysts empty, past the middle of their soft wall; all False without the finding);
    ``mirrored`` is the other eye (its fovea and tilt mirrored)."""
    (d, h, w), (dz, _, dx) = vendor.shape, vendor.spacing
    # The finding draws from its own stream, so an eye with it has the same noise as without.
    finding_rng, rng = rng.spawn(2)
    shift = rng.normal(0.0, 0.08, 3)
    z, y, x = vendor.grid(shift)
    side = -1 if mirrored else 1
    fovea = anatomy["fovea"] * (1, side)
    pit = np.exp(-((z - fovea[0]) ** 2 + (x - fovea[1]) ** 2) / (2 * anatomy["pit_sigma"] ** 2))

    thickness = anatomy["thickness"] * anatomy["shares"][:, None, None, None] * np.ones((1, d, 1, w))
    thickness[:INNER_LAYERS] *= 1 - anatomy["pit_depth"] * pit
    thickness[INNER_LAYERS] *= 1 + 0.3 * pit  # the outer nuclear layer fills the pit's floor
    if positive:
        # The retina hangs from its inner surface here (edges add up downwards), so the
        # swelling pushes the layers below it down; the voxels read that shift.
        swelling = finding_rng.uniform(*SWELLING) * finding_scale
        thickness[INL] += swelling * np.exp(-((z - fovea[0]) ** 2 + (x - fovea[1]) ** 2) / (2 * SWELLING_WIDTH**2))
    top = anatomy["top"] + shift[2] + anatomy["tilt"][0] * z + side * anatomy["tilt"][1] * x
    edges = top + np.concatenate([np.zeros_like(thickness[:1]), np.cumsum(thickness, axis=0)])  # [9, D, 1, W]

    def inside(upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
        return 1 / (1 + np.exp(-(y - upper) / anatomy["edge"])) - 1 / (1 + np.exp(-(y - lower) / anatomy["edge"]))

    intensity = sum(level * inside(edges[k], edges[k + 1]) for k, level in enumerate(anatomy["levels"]))
    below = np.clip(y - edges[-1], 0.0, None)
    intensity = intensity + 0.3 * np.exp(-below / anatomy["choroid"]) * inside(edges[-1], edges[-1] + 1.0)
    mask = np.zeros(vendor.shape, dtype=bool)
    if positive:
        middle = (edges[INL] + edges[INL + 1]) / 2
        left = _cysts(finding_rng, z, y, x, fovea, middle, finding_scale)
        intensity = intensity * left
        mask = left < 0.5

    corner = (z / (d * dz / 2)) ** 2 + (x / (w * dx / 2)) ** 2
    intensity = intensity * (1 - 0.2 * corner) + 0.005  # vignetting, over a faint noise floor
    intensity = intensity * rng.gamma(vendor.speckle, 1 / vendor.speckle, vendor.shape)
    level = np.log1p(LOG_RANGE * intensity) / np.log1p(LOG_RANGE)
    return np.clip(level * vendor.gain, 0, 65535).astype(np.uint16), mask, layer_labels(list(edges), y, vendor.shape)
