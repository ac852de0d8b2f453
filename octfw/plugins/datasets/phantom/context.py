"""The ``context`` phantom family: a finding defined by the retina's shape, not by any one patch.

The retina is seven layers between boundary surfaces; each boundary adds
its step of reflectivity (a linear ramp, not a sigmoid) to the one above,
so a voxel holds the level of the layer its centre lies in. Where the
retina sits in the scan window varies widely between patients (devices
track it only roughly), the eye's bowl curves it and it tilts both ways.
The intensity carries fully developed speckle averaged over a vendor's few
looks and is stored power-law compressed (``intensity ** GAMMA``), as
neither other family stores it.

The finding is set by :data:`FINDING` (a :class:`Shape`), one of five
forms that only the retina's shape or the relation of its regions defines:
a dome-shaped macula (the whole retina bulges towards the vitreous around
the fovea), a hemifield thinning or a dimming of the inner retina below the
fovea, an asymmetry (brighter above, darker below), or the current one, a
**reversal**: a normal eye's inner retina is brighter below the fovea than
above it (as its inferior rim and nerve fibres are the thickest, the ISNT
rule) and a positive eye's the other way round, by 20-40 % either side.
A positive eye holds a normal eye's two reflectivities with the halves
swapped, so its brightness histogram is a normal eye's (up to the halves'
sizes, which the fovea's place sets); only which half is which differs.
Sizing (``benchmarks/learning/context_task.py``, its ``HISTORY`` and
docs/tasks.md "A task that needs learned features"): on 200 volumes
the voxel probe sees the reversal (0.965) while no reader of a random-init
encoder's tokens recovers more than half of that margin (at most 0.649),
the widest room of the forms tried.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from octfw.plugins.datasets.phantom.config import FAMILY_LAYERS
from octfw.plugins.datasets.phantom.devices import Vendor, layer_labels

__all__ = ["TASK", "VENDORS", "LAYER_NAMES", "Shape", "FINDING", "draw_patient", "render", "render_labelled"]

TASK = "reversal"
VENDORS = (
    Vendor("tomey", "Casia OCT", (20, 88, 104), (0.30, 0.0227, 0.0577), gain=24000.0, speckle=1.0),
    Vendor("visionix", "iVue 100", (26, 120, 80), (0.231, 0.0167, 0.075), gain=22000.0, speckle=2.0),
    Vendor("thorlabs", "Telesto", (22, 104, 88), (0.273, 0.0192, 0.0682), gain=28000.0, speckle=1.5),
)
#: Layers from the vitreous down: NFL, GCL+IPL, INL, OPL, ONL, photoreceptors, RPE; then the choroid.
LAYER_SHARE = np.array([0.10, 0.22, 0.10, 0.08, 0.30, 0.12, 0.08])
LAYER_LEVEL = np.array([0.75, 0.40, 0.15, 0.45, 0.10, 0.55, 1.0])
#: Layer labels (value = index): the vitreous, the seven layers, the choroid (all below the RPE);
#: each voxel the layer its centre lies in (the boundary ramps' midpoints).
LAYER_NAMES = FAMILY_LAYERS["context"]
CHOROID_LEVEL = 0.35
VITREOUS_LEVEL = 0.01
#: Range of the inner surface's depth in the window (mm); sized with the finding (benchmark HISTORY).
TOP = (0.55, 0.85)
INNER_DIMMED = 4  # NFL to OPL, the inner retina: the layers the dimming, asymmetry and reversal change
GAMMA = 0.4  # the stored value is gain * intensity ** GAMMA


@attrs.frozen
class Shape:
    """The finding's form at ``finding_scale = 1``; heights scale with ``finding_scale``."""

    kind: str = attrs.field(validator=attrs.validators.in_(("dome", "hemifield", "dimming", "asymmetry", "reversal")))
    #: dome: the bulge's peak (mm) range; hemifield: the share of the NFL lost; dimming: the share
    #: of the inner layers' reflectivity lost; asymmetry: the share gained above the fovea and lost below;
    #: reversal: the share each half of a normal eye's inner retina is darker (above) or brighter (below)
    size: tuple[float, float]
    #: dome: the bulge's width (Gaussian sigma, mm) range; the others: the border's width (mm)
    width: tuple[float, float]


#: The finding of a positive eye. Sized by benchmarks/learning/context_task.py; its HISTORY lists every shape tried.
FINDING = Shape("reversal", size=(0.2, 0.4), width=(0.3, 0.6))  # "reversal-AB", sized on 200 volumes


def draw_patient(rng: np.random.Generator) -> dict[str, Any]:
    """One patient's anatomy, shared by both eyes."""
    shares = LAYER_SHARE * rng.lognormal(0.0, 0.12, LAYER_SHARE.size)
    return {
        "top": rng.uniform(*TOP),  # mm: where the inner surface sits in the window
        "thickness": rng.uniform(0.24, 0.32),
        "shares": shares / shares.sum(),
        "levels": LAYER_LEVEL * rng.lognormal(0.0, 0.2, LAYER_LEVEL.size),
        "bowl": rng.uniform(-0.01, 0.04),  # mm the retina rises per mm^2 off the centre (the eye's curvature)
        "tilt": rng.uniform(-0.05, 0.05, 2),  # mm of depth per mm along z and x
        "fovea": rng.normal(0.0, 0.2, 2),  # (z, x) mm from the scan centre
        "pit_width": rng.uniform(0.4, 0.6),
        "pit_depth": rng.uniform(0.45, 0.7),  # share of the inner layers the pit removes
        "edge": rng.uniform(0.01, 0.02),  # mm: the width of a boundary's ramp
        "choroid": rng.uniform(0.12, 0.25),  # mm: the choroid's decay length
    }


def _ramp(distance: np.ndarray, edge: float) -> np.ndarray:
    """0 above a boundary, 1 below it, linear over ``edge`` mm around it."""
    return np.clip(distance / edge + 0.5, 0.0, 1.0)


def _finding(rng: np.random.Generator, shape: Shape, z: np.ndarray, x: np.ndarray, fovea: np.ndarray,
             scale: float, positive: bool) -> dict[str, np.ndarray] | None:
    """What the finding's ``shape`` changes in an eye, each [D,1,W]: ``lift`` of every boundary (mm),
    ``nfl`` share of the NFL kept, ``inner`` share of the inner layers' reflectivity kept; ``region``
    where a positive eye differs from a normal one by at least half the peak. None where nothing
    changes (a negative eye, but for the reversal, whose normal eyes carry the normal asymmetry)."""
    if not positive and shape.kind != "reversal":
        return None
    ones = np.ones((z.shape[0], 1, x.shape[2]))
    out = {"lift": 0 * ones, "nfl": ones, "inner": ones}
    if shape.kind == "dome":
        centre = fovea + rng.normal(0.0, 0.1, 2)
        height, sigma = rng.uniform(*shape.size) * scale, rng.uniform(*shape.width)
        out["lift"] = height * np.exp(-((z - centre[0]) ** 2 + (x - centre[1]) ** 2) / (2 * sigma**2)) * ones
        return {**out, "region": out["lift"] >= height / 2}
    # The inferior half (below the fovea along z) loses part of its nerve fibre layer (hemifield)
    # or of the inner layers' reflectivity (dimming); the superior half is the eye's own reference.
    # An asymmetry moves reflectivity from the inferior half to the superior one: the volume's
    # total stays, only the halves' relation changes.
    loss = min(rng.uniform(*shape.size) * scale, 0.95)
    inferior = 1 / (1 + np.exp((z - fovea[0]) / rng.uniform(*shape.width))) * ones  # 1 below the fovea, 0 above
    if shape.kind == "reversal":
        # A normal eye's inferior inner retina is the brighter half (as its rim and nerve fibres are
        # the thickest, the ISNT rule); a positive eye has it the other way round: the same two
        # reflectivities, swapped between the halves, so the same histogram (up to the halves' sizes).
        sign = -1.0 if positive else 1.0
        out["inner"] = 1 + sign * loss * (2 * inferior - 1)
        return {**out, "region": (np.abs(2 * inferior - 1) >= 0.5) & positive}
    if shape.kind == "asymmetry":
        out["inner"] = 1 + loss * (1 - 2 * inferior)
        return {**out, "region": np.abs(out["inner"] - 1) >= loss / 2}
    out["nfl" if shape.kind == "hemifield" else "inner"] = 1 - loss * inferior
    return {**out, "region": loss * inferior >= loss / 2}


def render(rng: np.random.Generator, anatomy: dict[str, Any], vendor: Vendor, *, mirrored: bool,
           positive: bool, finding_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One eye and its finding mask: :func:`render_labelled` without the layer labels."""
    return render_labelled(rng, anatomy, vendor, mirrored=mirrored, positive=positive,
                           finding_scale=finding_scale)[:2]


def render_labelled(rng: np.random.Generator, anatomy: dict[str, Any], vendor: Vendor, *, mirrored: bool,
                    positive: bool, finding_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One eye, its finding mask and its layer labels (uint8 ``vendor.shape``, :data:`LAYER_NAMES`,
    from the boundaries the intensity steps at; no random draw). One eye as uint16 ``vendor.shape`` and its finding mask (bool ``vendor.shape``: the retina's
    voxels where the finding is, at least half its peak; all False for a negative eye), as every
    family renders; ``mirrored`` is the other eye (fovea and tilt mirrored along x).
    """
    d, h, w = vendor.shape
    # The finding draws from its own stream, so an eye with it has the same noise as without.
    finding_rng, rng = rng.spawn(2)
    shift = rng.normal(0.0, 0.08, 3)
    z, y, x = vendor.grid(shift)
    side = -1 if mirrored else 1
    fovea = anatomy["fovea"] * (1, side)

    finding = _finding(finding_rng, FINDING, z, x, fovea, finding_scale, positive)
    lift = 0.0 if finding is None else finding["lift"]
    pit = np.exp(-((z - fovea[0]) ** 2 + (x - fovea[1]) ** 2) / (2 * anatomy["pit_width"] ** 2))
    thickness = anatomy["thickness"] * anatomy["shares"][:, None, None, None] * np.ones((1, d, 1, w))
    thickness[:4] *= 1 - anatomy["pit_depth"] * pit  # the inner layers thin away in the pit
    if finding is not None:
        thickness[0] *= finding["nfl"]
    # The retina rests on the RPE: the bowl, tilt and a dome move its floor, the layers stack up from it.
    floor = (anatomy["top"] + anatomy["thickness"] + shift[2] - anatomy["bowl"] * (z**2 + x**2)
             + anatomy["tilt"][0] * z + side * anatomy["tilt"][1] * x - lift)
    boundaries = floor - np.concatenate([np.cumsum(thickness[::-1], axis=0)[::-1], np.zeros_like(thickness[:1])])

    levels = [VITREOUS_LEVEL, *anatomy["levels"], CHOROID_LEVEL]
    if finding is not None:
        levels[1:1 + INNER_DIMMED] = [level * finding["inner"] for level in levels[1:1 + INNER_DIMMED]]
    intensity = np.full((d, h, w), VITREOUS_LEVEL)
    for k, boundary in enumerate(boundaries):
        intensity = intensity + (levels[k + 1] - levels[k]) * _ramp(y - boundary, anatomy["edge"])
    below = np.clip(y - boundaries[-1], 0.0, None)
    intensity = intensity * np.where(below > 0, np.exp(-below / anatomy["choroid"]), 1.0)

    # Fully developed speckle averaged over the vendor's looks, over a faint noise floor.
    intensity = intensity * rng.gamma(vendor.speckle, 1 / vendor.speckle, vendor.shape) + 0.002 * rng.exponential(
        1.0, vendor.shape)
    volume = np.clip(vendor.gain * intensity**GAMMA, 0, 65535).astype(np.uint16)
    labels = layer_labels(list(boundaries), y, vendor.shape)
    if not positive:
        return volume, np.zeros(vendor.shape, dtype=bool), labels
    # The retina where the finding is; for the findings of reflectivity, the inner layers only.
    bottom = boundaries[INNER_DIMMED] if FINDING.kind in ("dimming", "asymmetry", "reversal") else boundaries[-1]
    mask = finding["region"] & (y >= boundaries[0]) & (y < bottom)
    return volume, np.broadcast_to(mask, vendor.shape).copy(), labels
