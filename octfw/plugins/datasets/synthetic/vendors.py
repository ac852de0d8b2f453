"""The device families a synthetic cohort draws, and how their volumes differ.

Vendors differ as real devices do: volume size, voxel spacing, gain and
speckle strength (:class:`VendorProfile`). Two sets of sizes (:data:`SIZES`):
"small" volumes, 16-bit, that the CPU quickstart decodes quickly
(:data:`PROFILES`), and "device" volumes at the sizes and 8-bit depth real
devices export (:data:`DEVICE_PROFILES`, up to 67 M voxels), for preparation
and streaming benchmarks that need realistic bytes.

Light (attrs only): the profiles are data, the drawing is in :mod:`.retina`
and :mod:`.rendering`.
"""

from __future__ import annotations

import attrs

from octfw.plugins.datasets.synthetic.config import DOMAINS

__all__ = ["VendorProfile", "PROFILES", "DEVICE_PROFILES", "SIZES", "DEFAULT_DOMAINS"]


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
    #: (log-scaled, as devices export B-scans); see :func:`.rendering.render_volume`.
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
