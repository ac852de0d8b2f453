"""Built-in transform components (recipe table ``[transform]``)."""

from __future__ import annotations

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.transforms.oct_standard import OCTStandardConfig


@hookimpl
def octfw_register_transforms(register: Register) -> None:
    register(
        "oct-standard",
        OCTStandardConfig,
        "octfw.plugins.transforms.oct_standard:build",
        "Resample to a spacing, normalise by percentiles, fit to image_size, "
        "augment, and draw a fixed-size patch mask.",
    )
