"""Synthetic multi-vendor OCT cohorts, written as real DICOM files.

Each volume looks like a retina in cross-section: a stack of smooth,
undulating bright and dark layers along the axial (H) axis with a foveal
pit, a choroid below, and speckle noise. Vendors differ as real devices do:
volume size, voxel spacing, gain and speckle strength. A cohort is a
function of its options and seed, so the quickstart, the tests and every
rank of a run see the same bytes.

Two sets of sizes (:data:`SIZES`): "small" volumes, 16-bit, that the CPU
quickstart decodes quickly, and "device" volumes at the sizes and 8-bit
depth real devices export (up to 67 M voxels), for preparation and
streaming benchmarks that need realistic bytes.

Layout of a cohort folder::

    <folder>/<domain>/<index>.dcm   one Ophthalmic Tomography file per volume
    <folder>/<domain>/<index>.layers.npy  its layer labels, uint8 [D, H, W] ("small" sizes only)
    <folder>/manifest.jsonl         path, domain, label (and layers, layer_names) of every file
    <folder>/cohort.json            options, files, sizes; written last

``cohort.json`` is written last, so a folder without it (or with one for
other options, or with a file missing or of the wrong size) is rewritten.

Every "small" cohort writes, beside each volume, the label of its retinal layers
(:data:`LAYER_NAMES`, :func:`layer_labels`), named by the manifest's ``layers`` and
``layer_names`` columns; a consumer reads them through the dataset
(:class:`octfw.types.LayeredDataset`: ``dataset.layers(i)``, uint8 ``[D, H, W]``, and
``dataset.layer_names(i)``) and brings them to the prepared geometry with
``transform.prepare_labels(labels, dataset.load(i))``
(:class:`octfw.types.LabelPreparingTransform`). "device" cohorts, written for byte
benchmarks, carry none (67 MB of labels a volume).

Labelled cohorts carry one of three retinal findings (or none), as a
classification task (see :data:`TASKS`): a bright lesion, sub-retinal fluid
(a dark dome that lifts the retina off the pigment epithelium) or thinning
of the outer nuclear layer over a region. Their sizes were fixed by
measurement before any pretrained encoder was probed on them; see
docs/tasks.md and benchmarks/learning/synthetic_tasks.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

from octfw.dicom.manifest import ManifestRow, write_manifest
from octfw.dicom.reader import encode_oct_dicom, open_file, write_bytes
from octfw.plugins.datasets.synthetic.config import DOMAINS
from octfw.display.progress import progress_bar
from octfw.storage.files import open_filesystem
from octfw.display.tables import counted

__all__ = [
    "GENERATOR_VERSION",
    "FINDINGS_VERSION",
    "COHORT_FILE",
    "MANIFEST_FILE",
    "VendorProfile",
    "PROFILES",
    "DEVICE_PROFILES",
    "SIZES",
    "DEFAULT_DOMAINS",
    "CORRUPTION_KINDS",
    "TASKS",
    "FINDINGS",
    "task_labels",
    "corrupt_count",
    "cohort_options",
    "cohort_key",
    "synthetic_volume",
    "synthetic_volume_and_layers",
    "layer_labels",
    "LAYER_NAMES",
    "LAYERS_VERSION",
    "write_synthetic_cohort",
    "read_cohort",
]

#: Bumped whenever the generator's output changes, so cached cohorts are rewritten.
GENERATOR_VERSION = 2  # 2: a larger, brighter lesion (visible after resizing to 16 x 64 x 64)
#: Bumped whenever fluid, thinning or a finding_scale change; recorded in the
#: options of every cohort but the default lesion one, whose options (and so
#: cache folder and bytes) stay those of generator version 2.
FINDINGS_VERSION = 1
#: Bumped whenever the layer label files change. Recorded in ``cohort.json`` (not in the
#: options: cache folders and DICOM bytes stay), so a cohort written without labels, or
#: with older ones, is not complete and is written again (the same volumes, plus labels).
LAYERS_VERSION = 1

COHORT_FILE = "cohort.json"
MANIFEST_FILE = "manifest.jsonl"


@attrs.frozen
class VendorProfile:
    """How one device family's volumes differ from another's."""

    manufacturer: str  #: the DICOM Manufacturer, as the device writes it
    model_name: str
    shape: tuple[int, int, int]  #: [D, H, W]
    spacing: tuple[float, float, float]  #: (dz, dy, dx) mm; ~6 x 2 x 6 mm scans
    gain: float  #: scales the signal
    offset: float  #: background level in stored units
    looks: float  #: speckle averaging; fewer looks, stronger speckle
    noise: float  #: additive Gaussian noise, as a fraction of full signal
    #: Stored bits per voxel: 16 (linear, as generator version 2 wrote) or 8
    #: (log-scaled, as devices export B-scans); see :func:`synthetic_volume`.
    bits: int = attrs.field(default=16, validator=attrs.validators.in_((8, 16)))


#: Small volumes (the CPU quickstart decodes them quickly) with realistic
#: physical extents, so resampling to a target spacing behaves as on real data.
PROFILES: dict[str, VendorProfile] = {
    # Spectralis averages repeated B-scans: low speckle.
    "heidelberg": VendorProfile("Heidelberg Engineering", "Spectralis", (24, 96, 64),
                                (0.25, 0.02, 0.094), gain=1.0, offset=600.0, looks=8.0, noise=0.02),
    "topcon": VendorProfile("TOPCON Corporation", "3D OCT-2000", (16, 80, 80),
                            (0.375, 0.029, 0.075), gain=0.7, offset=1500.0, looks=2.0, noise=0.05),
    "zeiss": VendorProfile("Carl Zeiss Meditec", "Cirrus HD-OCT 5000", (20, 64, 96),
                           (0.3, 0.031, 0.0625), gain=1.3, offset=300.0, looks=3.0, noise=0.04),
}
DEFAULT_DOMAINS: tuple[str, ...] = DOMAINS

#: The same devices at the sizes of their macular volume scans, 8-bit: the
#: bytes a preparation or streaming benchmark must move. Gain, offset,
#: speckle and noise are those above (in 16-bit units, before the 8-bit mapping).
#: Sources: Cirrus macular cubes are 512 A-scans x 128 B-scans, and Topcon
#: 3D OCT-1000 cubes 512 x 128 (iovs.arvojournals.org, articleid=2188540);
#: Cirrus samples each A-scan 1024 times over 6 x 6 x 2 mm (articleid=2187193).
#: Assumed, from issue #15 and not checked against a public source here:
#: Spectralis' 49 B-scans of 496 x 512 over 5.8 x 1.9 x 5.8 mm, and Topcon's
#: (Maestro/Triton) 885 samples over 2.3 mm. The spacings follow from the
#: extents; the small profiles' model names are kept (they do not set the domain).
DEVICE_PROFILES: dict[str, VendorProfile] = {
    "heidelberg": attrs.evolve(PROFILES["heidelberg"], shape=(49, 496, 512),
                               spacing=(0.12, 0.0039, 0.0113), bits=8),
    "topcon": attrs.evolve(PROFILES["topcon"], shape=(128, 885, 512),
                           spacing=(0.047, 0.0026, 0.0117), bits=8),
    "zeiss": attrs.evolve(PROFILES["zeiss"], shape=(128, 1024, 512),
                          spacing=(0.047, 0.00195, 0.0117), bits=8),
}
#: Cohort ``sizes`` -> the profiles of its domains.
SIZES: dict[str, dict[str, VendorProfile]] = {"small": PROFILES, "device": DEVICE_PROFILES}

#: Labelled tasks: task -> the finding of each label (None: a healthy retina).
#: "lesion", "fluid" and "thinning" are binary (label 1: the finding is there,
#: in about half the volumes); "finding" is multi-class, one of the four in
#: about a quarter of the volumes each.
TASKS: dict[str, tuple[str | None, ...]] = {
    "lesion": (None, "lesion"),
    "fluid": (None, "fluid"),
    "thinning": (None, "thinning"),
    "finding": (None, "lesion", "fluid", "thinning"),
}
#: The findings a volume can carry.
FINDINGS: tuple[str, ...] = ("lesion", "fluid", "thinning")

#: Ways a synthetic file is broken, matching what the reader must catch.
CORRUPTION_KINDS: tuple[str, ...] = ("truncated", "not-dicom", "no-pixel-data", "constant")

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
#: The labels of :func:`layer_labels` (index = label value), top to bottom: the
#: vitreous above the inner limiting membrane, the eight drawn layers (the
#: photoreceptors as their ellipsoid and interdigitation zones), sub-retinal fluid
#: (empty but over a fluid dome) and the choroid (everything below the pigment
#: epithelium). Stable: new labels are only ever appended.
LAYER_NAMES: tuple[str, ...] = ("vitreous", "NFL", "GCL+IPL", "INL", "OPL", "ONL", "EZ", "IZ", "SRF", "RPE",
                                "choroid")
_INNER_LAYERS = 5  # the first five thin at the fovea; photoreceptors do not
_FOVEAL_THINNING = 0.5  # inner layers lose half their thickness at the foveal centre
_FULL_SCALE = 20000.0  # stored units of reflectivity 1.0 at gain 1
# 8-bit volumes store log(level / _LOG_FLOOR) / log(65535 / _LOG_FLOOR) x 255
# of the 16-bit level, clipped: 8-bit OCT exports are log-compressed, and
# this floor (below every profile's background offset) keeps the vitreous
# dark grey and the 16-bit range's top at 255.
_LOG_FLOOR = 100.0

# Finding geometry at finding_scale 1, in the generator's units: z and x run
# over [-1, 1] across the scan (6 mm), y over [0, 1] down the B-scan (about
# 2 mm). Sized by benchmarks/learning/synthetic_tasks.py (docs/tasks.md).
_FLUID_RADII = (0.45, 0.3)  # (z, x) half-widths of the fluid dome's footprint
_FLUID_HEIGHT = 0.21  # the dome's peak height, as a fraction of H (~0.4 mm)
_THINNED_LAYER = 4  # the outer nuclear layer: photoreceptor nuclei, lost in atrophy
_THINNING_RADII = (0.6, 0.42)  # (z, x) half-widths of the thinned region
_THINNING_DEPTH = 0.7  # the share of the layer lost at the region's centre


def corrupt_count(n_volumes: int, corrupt_fraction: float) -> int:
    """How many of ``n_volumes`` a cohort corrupts (rounded half up)."""
    return min(n_volumes, math.floor(corrupt_fraction * n_volumes + 0.5))


def _profiles(sizes: str) -> dict[str, VendorProfile]:
    try:
        return SIZES[sizes]
    except KeyError:
        raise ValueError(f"unknown synthetic sizes {sizes!r}; known: {sorted(SIZES)}") from None


def _resolve_shapes(domains: Sequence[str], shapes: Mapping[str, Sequence[int]] | None,
                    profiles: Mapping[str, VendorProfile]) -> dict[str, list[int]]:
    unknown = [d for d in domains if d not in profiles]
    if unknown:
        raise ValueError(f"unknown synthetic domains {unknown}; known: {sorted(profiles)}")
    shapes = dict(shapes or {})
    resolved = {}
    for domain in domains:
        shape = [int(n) for n in shapes.pop(domain, profiles[domain].shape)]
        if len(shape) != 3 or min(shape) < 2:
            raise ValueError(f"shape for {domain!r} must be three sizes >= 2 [D, H, W], got {shape}")
        resolved[domain] = shape
    if shapes:
        raise ValueError(f"shapes given for domains not in the cohort: {sorted(shapes)}")
    return resolved


def task_labels(task: str) -> tuple[str | None, ...]:
    """The finding of each label of ``task`` (index = label; None: no finding)."""
    try:
        return TASKS[task]
    except KeyError:
        raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(TASKS)}") from None


def cohort_options(
    n_volumes: int,
    domains: Sequence[str] = DEFAULT_DOMAINS,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    corrupt_fraction: float = 0.0,
    with_labels: bool = False,
    task: str = "lesion",
    finding_scale: float = 1.0,
    sizes: str = "small",
) -> dict[str, Any]:
    """The options that determine a cohort's bytes, as plain JSON data.

    ``task``, ``finding_scale`` and :data:`FINDINGS_VERSION` appear only
    when a task or scale differs from the defaults ("lesion", 1.0), and
    ``sizes`` only when it is not "small": the cohorts written before they
    existed keep their options, so their cache folders (named by
    :func:`cohort_key`) and bytes stay as they were, while every other task,
    scale or size gets its own.
    """
    if n_volumes < 1:
        raise ValueError(f"n_volumes must be >= 1, got {n_volumes}")
    if not domains or len(set(domains)) != len(domains):
        raise ValueError(f"domains must be distinct and non-empty, got {list(domains)}")
    if not 0.0 <= corrupt_fraction <= 1.0:
        raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    profiles = _profiles(sizes)
    task_labels(task)
    if not finding_scale > 0:
        raise ValueError(f"finding_scale must be > 0, got {finding_scale}")
    if (task != "lesion" or finding_scale != 1.0) and not with_labels:
        # Findings are drawn only in labelled cohorts; refusing beats ignoring.
        raise ValueError(f"task {task!r} and finding_scale {finding_scale} need with_labels")
    options = {
        "version": GENERATOR_VERSION,
        "n_volumes": int(n_volumes),
        "domains": list(domains),
        "shapes": _resolve_shapes(domains, shapes, profiles),
        "seed": int(seed),
        "corrupt_fraction": float(corrupt_fraction),
        "with_labels": bool(with_labels),
    }
    if task != "lesion" or finding_scale != 1.0:
        options["task"] = task
        options["finding_scale"] = float(finding_scale)
        options["findings_version"] = FINDINGS_VERSION
    if sizes != "small":
        options["sizes"] = sizes
    return options


def cohort_key(options: Mapping[str, Any]) -> str:
    """A short stable name for a cohort's options (a cache folder name)."""
    text = json.dumps(options, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


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

    The labels (uint8 ``[D, H, W]``, :data:`LAYER_NAMES`; None without ``layers``) come
    from the very boundaries the intensities are drawn at (:func:`layer_labels`): the
    foveal pit, the ripples, a thinning and a fluid dome included. They draw no random
    numbers, so the volume is the same with or without them.

    uint16 for a 16-bit profile, uint8 (log-scaled) for an 8-bit one; see
    :func:`_render_16bit` and :func:`_render_8bit`.

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

    render = _render_16bit if profile.bits == 16 else _render_8bit
    volume = render(rng, (depth, height, width), z, x, layers_drawn, blob, profile)
    return volume, (layer_labels(layers_drawn, (depth, height, width)) if layers else None)


def layer_labels(layers: Sequence[tuple[np.ndarray, np.ndarray, float]], shape: Sequence[int]) -> np.ndarray:
    """The label of :data:`LAYER_NAMES` of every voxel, uint8 ``shape`` ``[D, H, W]``.

    ``layers`` are the drawn (top, bottom, reflectivity) of :data:`_LAYERS`, positions
    ``[D, 1, W]`` in units of H (voxel ``j`` of an A-scan at ``j / (H - 1)``, as the
    renderers place it). A voxel's label is the number of boundaries at or above it:
    the inner surface, each layer's bottom, the pigment epithelium's top (below the
    photoreceptors' bottom only over sub-retinal fluid: label SRF in between) and its
    bottom. The boundaries never cross, so labels rise monotonically down every A-scan.
    """
    depth, height, width = (int(n) for n in shape)
    y = np.linspace(0.0, 1.0, height)[None, :, None]
    boundaries = [layers[0][0]] + [bottom for _top, bottom, _r in layers[:-1]] + [layers[-1][0], layers[-1][1]]
    labels = np.zeros((depth, height, width), dtype=np.uint8)
    for boundary in boundaries:
        labels += np.broadcast_to(y >= boundary, labels.shape)
    return labels


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


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _corrupt_bytes(kind: str, good: bytes, volume: np.ndarray, encode: Any, rng: np.random.Generator) -> bytes:
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


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}"


def _size(url: str) -> int | None:
    fs, path = open_filesystem(url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    return int(info["size"]) if info.get("type") == "file" else None


def _remove(url: str) -> None:
    fs, path = open_filesystem(url)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass  # absent already, or removed by another rank writing the same cohort


def read_cohort(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parsed ``cohort.json`` of ``folder``, or None when there is none."""
    url = _join(os.fspath(folder), COHORT_FILE)
    try:
        with open_file(url) as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return None  # a damaged record means a damaged cohort: rewrite it


def _writes_layers(sizes: str) -> bool:
    return sizes == "small"


def _is_complete(folder: str, record: dict[str, Any] | None, options: dict[str, Any]) -> bool:
    if not record or record.get("options") != options:
        return False
    if _writes_layers(options.get("sizes", "small")) and record.get("layers_version") != LAYERS_VERSION:
        return False  # written before layer labels (or with older ones)
    return all(_size(_join(folder, item["path"])) == item["size"]
               for item in [*record["files"], *record.get("layer_files", [])])


def write_synthetic_cohort(
    folder: str | os.PathLike[str],
    n_volumes: int,
    domains: Sequence[str] = DEFAULT_DOMAINS,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    corrupt_fraction: float = 0.0,
    with_labels: bool = False,
    task: str = "lesion",
    finding_scale: float = 1.0,
    sizes: str = "small",
) -> list[str]:
    """Write (or reuse) a synthetic cohort in ``folder``; return its file paths.

    Volume ``i`` belongs to ``domains[i % len(domains)]`` and is drawn from
    its own generator seeded with ``(seed, i)``, so the same options give
    byte-identical files. ``shapes`` overrides a domain's ``[D, H, W]``.
    ``corrupt_fraction`` of the files (rounded half up) are broken in turn
    as truncated, not DICOM, without pixel data, and constant. With
    ``with_labels``, each volume gets a label of ``task`` (:data:`TASKS`)
    and the finding that label names, recorded in the manifest; the default
    task, "lesion", is a bright lesion (label 1) or none (0).
    ``finding_scale`` multiplies the findings' size. ``sizes`` picks the
    profiles (:data:`SIZES`): "small" 16-bit volumes or "device" ones, at
    the sizes and 8-bit depth devices export. ``folder`` may be a local path
    or fsspec URL.
    """
    folder = os.fspath(folder).rstrip("/")
    options = cohort_options(n_volumes, domains, shapes=shapes, seed=seed,
                             corrupt_fraction=corrupt_fraction, with_labels=with_labels,
                             task=task, finding_scale=finding_scale, sizes=sizes)
    findings = task_labels(task)
    profiles = SIZES[sizes]
    # Other tasks' and sizes' files must not share the small lesion cohorts'
    # UIDs; those cohorts' entropy is left as it was, so their files keep their bytes.
    entropy = [task, repr(finding_scale), str(FINDINGS_VERSION)] if "task" in options else []
    entropy += [sizes] if "sizes" in options else []
    previous = read_cohort(folder)
    if _is_complete(folder, previous, options):
        return [_join(folder, item["path"]) for item in previous["files"]]

    # Rewriting: drop the record first, so an interrupted rewrite is seen as
    # incomplete, and remove files of an older cohort that this one lacks.
    _remove(_join(folder, COHORT_FILE))
    selection = np.random.default_rng([seed, n_volumes, 1])
    corrupt_indices = sorted(
        int(i) for i in selection.choice(n_volumes, corrupt_count(n_volumes, corrupt_fraction), replace=False)
    )
    corruption = {index: CORRUPTION_KINDS[k % len(CORRUPTION_KINDS)] for k, index in enumerate(corrupt_indices)}

    # The first command on a fresh cache writes the cohort, minutes at larger sizes: say so
    # rather than look stuck (and draw a bar where a person watches).
    logging.getLogger(__name__).info("writing the synthetic cohort (%s, %s sizes) once, to %s; later commands "
                                     "reuse it", counted(n_volumes, "volume"), sizes, folder)
    files, rows, layer_files = [], [], []
    with progress_bar("synthetic cohort", unit="volumes") as shown:
        for index in range(n_volumes):
            domain = domains[index % len(domains)]
            profile = profiles[domain]
            rng = np.random.default_rng([seed, index])
            label = None
            if with_labels:
                # A binary task draws as generator version 2 did (label 1 below 0.5).
                draw = rng.random()
                label = int(draw < 0.5) if len(findings) == 2 else int(draw * len(findings))
            volume, layers = synthetic_volume_and_layers(rng, options["shapes"][domain], profile,
                                                         finding=None if label is None else findings[label],
                                                         finding_scale=finding_scale,
                                                         layers=_writes_layers(sizes))
            name = f"{domain}/{index:05d}.dcm"

            def encode(array: np.ndarray, _name: str = name) -> bytes:
                # UIDs derive from the seed and file name: rewriting gives the same bytes.
                return encode_oct_dicom(array, profile.spacing, profile.manufacturer, profile.model_name,
                                        uid_entropy=[str(seed), _name, str(GENERATOR_VERSION), *entropy])

            data = encode(volume)
            kind = corruption.get(index)
            if kind is not None:
                data = _corrupt_bytes(kind, data, volume, encode, rng)
            url = _join(folder, name)
            write_bytes(url, data)
            files.append({"path": name, "domain": domain, "label": label, "corrupt": kind, "size": len(data)})
            layers_url = None
            if layers is not None:
                layers_name = f"{domain}/{index:05d}.layers.npy"
                layers_data = _npy_bytes(layers)
                layers_url = _join(folder, layers_name)
                write_bytes(layers_url, layers_data)
                layer_files.append({"path": layers_name, "size": len(layers_data)})
            rows.append(ManifestRow(path=url, domain=domain, label=label, layers=layers_url,
                                    layer_names=None if layers is None else LAYER_NAMES))
            if shown is not None:
                shown(index + 1, n_volumes)

    if previous and isinstance(previous.get("files"), list):
        keep = {item["path"] for item in [*files, *layer_files]}
        for item in [*previous["files"], *(previous.get("layer_files") or [])]:
            if isinstance(item, dict) and item.get("path") not in keep:
                _remove(_join(folder, str(item["path"])))

    write_manifest(_join(folder, MANIFEST_FILE), rows)
    record = {
        "options": options,
        "domains": list(domains),
        "labels": [item["label"] for item in files],
        "files": files,
    }
    if _writes_layers(sizes):
        record["layers_version"] = LAYERS_VERSION
        record["layer_names"] = list(LAYER_NAMES)
        record["layer_files"] = layer_files
    write_bytes(_join(folder, COHORT_FILE), json.dumps(record, indent=1).encode("utf-8"))
    return [_join(folder, item["path"]) for item in files]
