"""What every phantom family shares: a device (:class:`Vendor`), what its files look like.

Its own module, importing none of the families nor the cohort writer, so the families
(:mod:`.tuning`, :mod:`.held_out`, :mod:`.context`) and :mod:`.cohort`, which imports
them by name, form no import circle.
"""

from __future__ import annotations

import attrs
import numpy as np

__all__ = ["Vendor", "layer_labels"]


@attrs.frozen
class Vendor:
    """One device of a family: what its files look like."""

    name: str  #: the DICOM Manufacturer, and so the domain
    model_name: str
    shape: tuple[int, int, int]  #: [D, H, W] voxels
    spacing: tuple[float, float, float]  #: (dz, dy, dx) mm; about 6 x 2 x 6 mm in all
    gain: float  #: 16-bit level of a reflectivity of 1
    speckle: float  #: the family's speckle parameter (its meaning is the family's)

    def grid(self, shift: "np.ndarray") -> tuple["np.ndarray", "np.ndarray", "np.ndarray"]:
        """Physical coordinates of the voxels in mm, broadcastable: z ``[D, 1, 1]`` and x ``[1, 1, W]``
        centred on the scan and moved by ``shift`` (z, x), y ``[1, H, 1]`` from the top."""
        (d, h, w), (dz, dy, dx) = self.shape, self.spacing
        z = (np.arange(d) - (d - 1) / 2) * dz + shift[0]
        x = (np.arange(w) - (w - 1) / 2) * dx + shift[1]
        return z[:, None, None], (np.arange(h) * dy)[None, :, None], x[None, None, :]


def layer_labels(boundaries: "list[np.ndarray] | np.ndarray", y: "np.ndarray",
                 shape: tuple[int, int, int]) -> "np.ndarray":
    """uint8 ``shape``: the number of ``boundaries`` (each ``[D, 1, W]`` mm, top to bottom) at or
    above each voxel's ``y`` (``[1, H, 1]`` mm): 0 in the vitreous, ``k`` between boundaries
    ``k - 1`` and ``k``. A boundary drawn above the one before it (a layer squeezed to nothing)
    is taken at that one, so labels never fall down an A-scan."""
    stacked = np.maximum.accumulate(np.stack([np.broadcast_to(b, (shape[0], 1, shape[2])) for b in boundaries]),
                                    axis=0)
    labels = np.zeros(shape, dtype=np.uint8)
    for boundary in stacked:
        labels += y >= boundary
    return labels
