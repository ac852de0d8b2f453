"""The ``tuning`` phantom family: drusen under a piecewise-linear retina, Rayleigh speckle.

The retina between the inner limiting membrane and the pigment epithelium
is one reflectivity profile over the normalised depth ``t`` (0 at the inner
surface, 1 at the epithelium), linear between knots: a bright nerve fibre
layer, dark nuclear layers, the bright photoreceptor lines. The eye's bowl
curves both surfaces; the fovea is a raised-cosine pit. Amplitudes (not
log-compressed) carry Rayleigh speckle over a Rayleigh noise floor.

The finding, drusen, lifts the pigment epithelium into a few domes over a
moderately reflective deposit, leaving Bruch's membrane where it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from octfw.plugins.datasets.phantom.config import FAMILY_LAYERS
from octfw.plugins.datasets.phantom.devices import Vendor, layer_labels

__all__ = ["TASK", "VENDORS", "LAYER_NAMES", "LAYER_DEPTH", "draw_patient", "render", "render_labelled"]

TASK = "drusen"
VENDORS = (
    Vendor("optovue", "RTVue XR", (20, 96, 80), (0.30, 0.0208, 0.075), gain=9000.0, speckle=0.9),
    Vendor("nidek", "RS-3000", (24, 80, 96), (0.25, 0.025, 0.0625), gain=14000.0, speckle=0.7),
    Vendor("canon", "OCT-HS100", (16, 128, 64), (0.375, 0.0156, 0.094), gain=6000.0, speckle=1.0),
)
#: Reflectivity knots over the normalised retinal depth (NFL, GCL, IPL, INL, OPL, ONL, ELM, IS/OS, RPE).
KNOT_DEPTH = np.array([0.0, 0.03, 0.12, 0.2, 0.35, 0.45, 0.55, 0.8, 0.84, 0.88, 0.93, 1.0])
KNOT_LEVEL = np.array([0.5, 0.9, 0.6, 0.3, 0.45, 0.12, 0.4, 0.06, 0.5, 0.25, 0.7, 1.0])
#: Layer labels (value = index), top to bottom. The profile has no edges inside the retina, so
#: the boundaries between its layers are where it crosses half-way between a bright knot and the
#: next dark one (or back): the midpoints of those knots' depths (:data:`LAYER_DEPTH`). Then the
#: photoreceptors (ELM to IS/OS) down to the epithelium's surface, the RPE band, the drusen
#: deposit under a lifted epithelium (empty without drusen) and the choroid.
LAYER_NAMES = FAMILY_LAYERS["tuning"]
#: The normalised depth of the inner surface and of each boundary inside the retina (NFL/GCL ...
#: ONL/photoreceptors): 0, then between the knots at 0.03 and 0.2, 0.2 and 0.35, 0.35 and 0.45,
#: 0.45 and 0.55, 0.55 and 0.8, 0.8 and 0.84.
LAYER_DEPTH = (0.0, 0.115, 0.275, 0.40, 0.50, 0.675, 0.82)
RPE_THICKNESS = 0.03  # mm, the epithelium's band below its surface
DEPOSIT_LEVEL = 0.45  # drusen material between the lifted epithelium and Bruch's membrane
#: Drusen at finding_scale 1: radius and height ranges (mm), how many, and how far from the
#: fovea. Sized by benchmarks/learning/phantom_tasks.py (its HISTORY lists the shapes tried): a few large, soft
#: drusen in the central macula; spread over the whole macula they were either invisible on
#: the voxels or given away to random encoders.
DRUSEN_RADIUS = (0.6, 1.05)
DRUSEN_HEIGHT = (0.12, 0.24)
DRUSEN_COUNT = (3, 7)
DRUSEN_SPREAD = 0.6  # mm: drusen gather in the central macula


def draw_patient(rng: np.random.Generator) -> dict[str, Any]:
    """One patient's anatomy, shared by both eyes."""
    return {
        "top": rng.uniform(0.55, 0.75),  # mm from the scan's top to the retina at the centre
        "thickness": rng.uniform(0.26, 0.32),
        "bowl": rng.uniform(0.01, 0.03),  # mm of depth per mm^2 off centre
        "pit_depth": rng.uniform(0.55, 0.75),  # share of the thickness the pit removes
        "pit_radius": rng.uniform(0.6, 0.9),
        "fovea": rng.normal(0.0, 0.2, 2),  # (z, x) mm from the scan centre
        "levels": np.clip(KNOT_LEVEL + rng.normal(0.0, 0.04, KNOT_LEVEL.size), 0.02, 1.0),
        "choroid": rng.uniform(0.2, 0.35),
        "vessel_phase": rng.uniform(0.0, 2 * np.pi, 2),
    }


def _drusen(rng: np.random.Generator, z: np.ndarray, x: np.ndarray, fovea: np.ndarray, scale: float) -> np.ndarray:
    """Elevation [D,1,W] (mm) of the epithelium: the highest of a few domes near the fovea."""
    elevation = np.zeros((z.shape[0], 1, x.shape[2]))
    for _ in range(rng.integers(*DRUSEN_COUNT)):
        centre = fovea + rng.uniform(-DRUSEN_SPREAD, DRUSEN_SPREAD, 2)
        radius = rng.uniform(*DRUSEN_RADIUS) * scale
        height = rng.uniform(*DRUSEN_HEIGHT) * scale
        share = 1.0 - ((z - centre[0]) ** 2 + (x - centre[1]) ** 2) / radius**2
        elevation = np.maximum(elevation, height * np.sqrt(np.clip(share, 0.0, None)))
    return elevation


def render(rng: np.random.Generator, anatomy: dict[str, Any], vendor: Vendor, *, mirrored: bool,
           positive: bool, finding_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One eye and its finding mask: :func:`render_labelled` without the layer labels."""
    return render_labelled(rng, anatomy, vendor, mirrored=mirrored, positive=positive,
                           finding_scale=finding_scale)[:2]


def render_labelled(rng: np.random.Generator, anatomy: dict[str, Any], vendor: Vendor, *, mirrored: bool,
                    positive: bool, finding_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One eye, its finding mask and its layer labels (uint8 ``vendor.shape``, :data:`LAYER_NAMES`,
    from the surfaces the profile is drawn between; no random draw). One eye as uint16 ``vendor.shape`` and its finding mask (bool, the same shape: the drusen
    deposit between the lifted epithelium and Bruch's membrane; all False without the finding);
    ``mirrored`` flips the nasal side (the other eye)."""
    # The finding draws from its own stream, so an eye with it has the same noise as without.
    finding_rng, rng = rng.spawn(2)
    z, y, x = vendor.grid(rng.normal(0.0, 0.1, 2))
    fovea = anatomy["fovea"] * (1, -1 if mirrored else 1)
    nasal = -x if mirrored else x
    radius = np.sqrt((z - fovea[0]) ** 2 + (x - fovea[1]) ** 2)
    pit = np.where(radius < anatomy["pit_radius"], 0.5 * (1 + np.cos(np.pi * radius / anatomy["pit_radius"])), 0.0)
    # The nerve fibre layer thickens towards the disc, on the nasal side.
    thickness = anatomy["thickness"] * (1 + 0.1 * np.tanh(nasal))
    bowl = anatomy["top"] + rng.normal(0.0, 0.03) + anatomy["bowl"] * (z**2 + x**2)
    inner = bowl + pit * anatomy["pit_depth"] * thickness
    bruch = bowl + thickness
    epithelium = bruch - (_drusen(finding_rng, z, x, fovea, finding_scale) if positive else 0.0)

    t = (y - inner) / (epithelium - inner)
    level = np.interp(t, KNOT_DEPTH, anatomy["levels"], left=0.01, right=0.0)
    below = y - epithelium
    level = np.where((below >= 0) & (below < RPE_THICKNESS), anatomy["levels"][-1], level)
    # Empty where the epithelium is not lifted (it then lies on Bruch's membrane).
    deposit = (below >= RPE_THICKNESS) & (y < bruch + RPE_THICKNESS)
    level = np.where(deposit, DEPOSIT_LEVEL, level)
    depth = y - bruch - RPE_THICKNESS
    vessels = 1 + 0.3 * np.sin(9 * z + anatomy["vessel_phase"][0]) * np.sin(7 * x + anatomy["vessel_phase"][1])
    choroid = 0.5 * np.exp(-2.5 * depth / anatomy["choroid"]) * vessels
    level = np.where(depth >= 0, choroid, level)

    # Rayleigh speckle of mean 1 (sigma sqrt(2/pi)), part of the amplitude by vendor.
    speckle = rng.rayleigh(np.sqrt(2 / np.pi), vendor.shape)
    amplitude = np.sqrt(level) * (1 - vendor.speckle + vendor.speckle * speckle)
    amplitude += rng.rayleigh(0.04, vendor.shape)  # the detector's noise floor
    mask = np.broadcast_to(deposit, vendor.shape).copy()
    boundaries = [inner + depth * (epithelium - inner) for depth in LAYER_DEPTH]
    boundaries += [epithelium, epithelium + RPE_THICKNESS, bruch + RPE_THICKNESS]
    labels = layer_labels(boundaries, y, vendor.shape)
    return np.clip(amplitude * vendor.gain, 0, 65535).astype(np.uint16), mask, labels
