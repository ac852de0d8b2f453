"""The geometry of a synthetic retina: its layers, the fovea and at most one finding.

Each volume looks like a retina in cross-section: a stack of smooth,
undulating bright and dark layers along the axial (H) axis with a foveal
pit, a choroid below, and speckle noise. :func:`synthetic_volume_and_layers`
draws where every layer and finding lies, renders the intensities through
:mod:`.rendering` and labels every voxel's layer through :mod:`.labels`; a
volume is a function of its generator, shape, profile and finding.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from octfw.plugins.datasets.synthetic.labels import layer_labels
from octfw.plugins.datasets.synthetic.rendering import render_volume
from octfw.plugins.datasets.synthetic.vendors import VendorProfile

__all__ = ["FINDINGS", "synthetic_volume", "synthetic_volume_and_layers"]

#: The findings a volume can carry.
FINDINGS: tuple[str, ...] = ("lesion", "fluid", "thinning")

# Retinal layers from the vitreous down: (name, thickness as a fraction of
# H, reflectivity). Inner layers thin out towards the fovea.
_LAYERS: tuple[tuple[str, float, float], ...] = (
    ("nerve fibre", 0.045, 0.85),
    ("ganglion + inner plexiform", 0.08, 0.45),
    ("inner nuclear", 0.045, 0.18),
    ("outer plexiform", 0.03, 0.5),
    ("outer nuclear", 0.09, 0.12),
    ("ellipsoid zone", 0.02, 0.9),
    ("interdigitation", 0.015, 0.35),
    ("pigment epithelium", 0.03, 1.0),
)
_INNER_LAYERS = 5  # the first five thin at the fovea; photoreceptors do not
_FOVEAL_THINNING = 0.5  # inner layers lose half their thickness at the foveal centre

# Finding geometry at finding_scale 1, in the generator's units: z and x run
# over [-1, 1] across the scan (6 mm), y over [0, 1] down the B-scan (about
# 2 mm). Sized by benchmarks/learning/synthetic_tasks.py (docs/tasks.md).
_FLUID_RADII = (0.45, 0.3)  # (z, x) half-widths of the fluid dome's footprint
_FLUID_HEIGHT = 0.21  # the dome's peak height, as a fraction of H (~0.4 mm)
_THINNED_LAYER = 4  # the outer nuclear layer: photoreceptor nuclei, lost in atrophy
_THINNING_RADII = (0.6, 0.42)  # (z, x) half-widths of the thinned region
_THINNING_DEPTH = 0.7  # the share of the layer lost at the region's centre


def _footprint(rng: np.random.Generator, z: np.ndarray, x: np.ndarray, radii: tuple[float, float],
               scale: float) -> np.ndarray:
    """Squared normalised distance from a random centre, for an elliptic (z, x) region.

    Centres stay away from the scan's edges so that most of the region is
    inside the volume.
    """
    centre_z = rng.uniform(-0.5, 0.5)
    centre_x = rng.uniform(-0.6, 0.6)
    return ((z - centre_z) / (radii[0] * scale)) ** 2 + ((x - centre_x) / (radii[1] * scale)) ** 2


def _layer_ripple(index: int, z: np.ndarray, x: np.ndarray, phases: np.ndarray, pit: np.ndarray) -> np.ndarray:
    """How much layer ``index`` is thicker or thinner than its nominal thickness, per (z, x)."""
    ripple = 1.0 + 0.12 * np.sin(2.0 * np.pi * 0.8 * x + phases[2] + index) * np.cos(np.pi * 0.5 * z + phases[3])
    if index < _INNER_LAYERS:
        ripple = ripple * (1.0 - _FOVEAL_THINNING * pit)
    return ripple


def synthetic_volume(
    rng: np.random.Generator,
    shape: Sequence[int],
    profile: VendorProfile,
    lesion: bool = False,
    *,
    finding: str | None = None,
    finding_scale: float = 1.0,
) -> np.ndarray:
    """One layered-retina volume ``[D, H, W]``, with at most one finding
    (:func:`synthetic_volume_and_layers` without the layer labels; the same numbers)."""
    return synthetic_volume_and_layers(rng, shape, profile, lesion, finding=finding,
                                       finding_scale=finding_scale, layers=False)[0]


def synthetic_volume_and_layers(
    rng: np.random.Generator,
    shape: Sequence[int],
    profile: VendorProfile,
    lesion: bool = False,
    *,
    finding: str | None = None,
    finding_scale: float = 1.0,
    layers: bool = True,
) -> tuple[np.ndarray, np.ndarray | None]:
    """One layered-retina volume ``[D, H, W]``, with at most one finding, and its layer labels.

    The labels (uint8 ``[D, H, W]``, :data:`.labels.LAYER_NAMES`; None without ``layers``) come
    from the very boundaries the intensities are drawn at (:func:`layer_labels`): the
    foveal pit, the ripples, a thinning and a fluid dome included. They draw no random
    numbers, so the volume is the same with or without them.

    uint16 for a 16-bit profile, uint8 (log-scaled) for an 8-bit one; see
    :func:`.rendering.render_volume`.

    ``finding`` (``lesion=True`` is ``finding="lesion"``), as on clinical OCT:

    - ``"lesion"``: a bright Gaussian ellipsoid (a hyper-reflective lesion,
      1/e radii of about 1.2, 0.12 and 0.75 mm along D, H, W on a 6 mm scan)
      inside the retina;
    - ``"fluid"``: sub-retinal fluid, a dark (optically empty) dome between
      the photoreceptors and the pigment epithelium that lifts the
      neurosensory retina above it, the pigment epithelium staying flat;
    - ``"thinning"``: the outer nuclear layer loses part of its thickness
      over an elliptic region (as over photoreceptor atrophy); the inner
      surface sinks by as much, the layers beneath stay where they were.

    Their sizes were chosen so that a linear probe on the voxels at the
    quickstart's 16 x 64 x 64 input sees them while a randomly initialised
    encoder's mean-pooled features mostly do not (docs/tasks.md).
    Geometry is in units of the scan, so they are the same at any volume size.
    ``finding_scale`` multiplies the finding's size: the lesion's radii,
    the fluid's height (its footprint stays) and the thinned region's
    footprint (the share of the layer lost stays). A volume without a finding draws the same numbers whatever the
    task, and the lesion draws them in the order generator version 2 did.
    """
    if lesion:
        finding = "lesion"
    if finding is not None and finding not in FINDINGS:
        raise ValueError(f"unknown finding {finding!r}; known: {list(FINDINGS)}")
    depth, height, width = (int(n) for n in shape)
    z = np.linspace(-1.0, 1.0, depth)[:, None, None]
    x = np.linspace(-1.0, 1.0, width)[None, None, :]

    # Retina surface: a gentle tilt and undulation, pushed down by the foveal
    # pit exactly as much as the inner layers thin, so the outer layers and
    # the pigment epithelium run on undisturbed beneath it.
    phases = rng.uniform(0.0, 2.0 * np.pi, size=4)
    fovea_z, fovea_x = rng.uniform(-0.3, 0.3, size=2)
    pit = np.exp(-((z - fovea_z) ** 2 + (x - fovea_x) ** 2) / 0.06)
    inner_thickness = sum(thickness for _n, thickness, _r in _LAYERS[:_INNER_LAYERS])
    surface = (
        0.22
        + rng.uniform(-0.04, 0.04) * x
        + 0.025 * np.sin(2.0 * np.pi * 0.6 * x + phases[0])
        + 0.015 * np.sin(2.0 * np.pi * 0.4 * z + phases[1])
        + _FOVEAL_THINNING * inner_thickness * pit
    )

    # Fluid: a dome of empty space on the pigment epithelium, rounded at its
    # peak and tapering to the epithelium at its rim, as a serous detachment
    # does; the retina over it is lifted.
    dome = np.zeros_like(surface)
    if finding == "fluid":
        distance = _footprint(rng, z, x, _FLUID_RADII, 1.0)
        dome = _FLUID_HEIGHT * finding_scale * np.clip(1.0 - distance, 0.0, None) ** 1.5
        # A large dome under a high surface would lift the retina out of the
        # scan; an operator centres the retina, so it stops short of the top.
        dome = np.minimum(dome, np.clip(surface - 0.02, 0.0, None))
        surface = surface - dome
    # Thinning: the share of the layer lost, flat over most of the region and
    # falling off smoothly at its edge, as the foveal pit does for the inner layers.
    lost = np.zeros_like(surface)
    if finding == "thinning":
        distance = _footprint(rng, z, x, _THINNING_RADII, finding_scale)
        lost = _THINNING_DEPTH * np.exp(-(distance**2))
        # The inner surface sinks by exactly what the layer loses, ripple included.
        layer_thickness = _LAYERS[_THINNED_LAYER][1] * _layer_ripple(_THINNED_LAYER, z, x, phases, pit)
        surface = surface + lost * layer_thickness

    layers_drawn = []  # (top, bottom, reflectivity), [D, 1, W] positions down the B-scan
    top = surface
    for index, (_name, thickness, reflectivity) in enumerate(_LAYERS):
        ripple = _layer_ripple(index, z, x, phases, pit)
        if index == _THINNED_LAYER and finding == "thinning":
            ripple = ripple * (1.0 - lost)
        if index == len(_LAYERS) - 1 and finding == "fluid":
            top = top + dome  # the fluid pocket: nothing reflects between the photoreceptors and the RPE
        bottom = top + thickness * ripple
        layers_drawn.append((top, bottom, reflectivity))
        top = bottom

    blob = None  # the lesion's (centre, 1/e radii) along (z, y, x)
    if finding == "lesion":
        centre_z = rng.uniform(-0.5, 0.5)
        centre_x = rng.uniform(-0.6, 0.6)
        centre_y = float(surface.mean()) + rng.uniform(0.06, 0.18)
        blob = ((centre_z, centre_y, centre_x), (0.4 * finding_scale, 0.06 * finding_scale, 0.25 * finding_scale))

    volume = render_volume(rng, (depth, height, width), z, x, layers_drawn, blob, profile)
    return volume, (layer_labels(layers_drawn, (depth, height, width)) if layers else None)
