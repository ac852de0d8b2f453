"""The batch: the keys octfw's built-in transform makes and its models read, how a transform
declares a key (:class:`BatchKey`), and how a stored view's bytes read as intensities."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = [
    "BATCH_KEYS", "STORED_VIEW_DTYPES", "mask_keys", "BatchKey", "UINT8_SCALE",
    "bytes_to_intensity", "dequantize", "DOMAIN_ID_KEY",
]


#: The batch octfw's built-in transform makes and its built-in models consume
#: (each transform declares its own in :meth:`Transform.batch_spec`, each model
#: what it reads in :attr:`Model.inputs`):
#:
#: - ``context``: float32 ``[C, D, H, W]``, the view the context encoder sees.
#: - ``target``: float32 ``[C, D, H, W]``, the view the target encoder sees.
#:
#: A view may also travel as stored (:data:`STORED_VIEW_DTYPES`): a volume
#: ``octfw prepare`` stored as uint8 (each byte ``b`` meaning ``b / 255``) or
#: float16, and not augmented, goes through the loader workers and onto the
#: device in a quarter or a half of float32's bytes, and the engine converts
#: it there (``octfw.engine.collate.float_views``, exactly what ``prepare()``
#: gives) before the model sees it: a model always receives float32.
#: - ``context_idx``: int64 ``[N_context]``, indices of visible patches.
#: - ``target_idx``: int64 ``[N_target]``, indices of masked patches.
#:
#: A mask with several configurations (V-JEPA's short- and long-range blocks)
#: makes one such pair per configuration, under the names :func:`mask_keys`
#: gives (``context_idx_short``, ``target_idx_short``, ...); the pairs are named
#: in :attr:`BuildContext.mask_pairs`. Patch indices count patches in row-major order over the patch grid
#: ``(D / pd, H / ph, W / pw)``. The counts are the same for every sample so
#: that an XLA graph compiles once; a ``[D, H, W]`` voxel mask is refused.
BATCH_KEYS = ("context", "target", "context_idx", "target_idx")


#: The dtypes a view may travel in besides float32: how ``octfw prepare`` stores voxels.
STORED_VIEW_DTYPES = ("uint8", "float16")


def mask_keys(pair: str) -> tuple[str, str]:
    """The batch keys ``(context_idx, target_idx)`` of the mask configuration ``pair``
    (``""``: the single pair of a one-configuration mask)."""
    suffix = f"_{pair}" if pair else ""
    return f"context_idx{suffix}", f"target_idx{suffix}"


@attrs.frozen
class BatchKey:
    """One array a transform returns per sample, as the batch carries it (declared in
    :meth:`Transform.batch_spec`): collate, the transfer to the device, SPMD sharding and
    ``octfw check`` read the declaration, so a new key needs no engine change.

    ``view``: an image the model reads as float32. It may travel as stored (uint8, each
    byte ``b`` meaning ``b * UINT8_SCALE``, or float16), converted on the device; a view that is the
    same array as an earlier view of the sample (nothing augmented it) travels once.
    Every key is split along the batch dimension over the devices (SPMD)."""

    shape: tuple[int, ...]  #: per sample, without the batch dimension (fixed: one XLA graph)
    dtype: str  #: numpy dtype name as returned ("float32", "int64"); a view may also come as stored
    view: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)


#: A uint8 view's (and a uint8 stored volume's) byte ``b`` is the intensity ``b * UINT8_SCALE``.
UINT8_SCALE = 1.0 / 255.0


def bytes_to_intensity(stored: "np.ndarray") -> "np.ndarray":
    """uint8 voxels (``b``) as float32 intensities ``b * UINT8_SCALE``, in one float32 array:
    what ``octfw prepare`` stored and what the engine's uint8 views mean."""
    import numpy as np  # here, not at import: octfw list and recipe validation import this module

    volume = stored.astype(np.float32)
    volume *= np.float32(UINT8_SCALE)  # in place: one float32 volume, not two
    return volume


def dequantize(stored: "np.ndarray") -> "np.ndarray":
    """Voxels as ``octfw prepare`` stored them (uint8 or float16) as float32 in [0, 1]
    (a float32 array as it is, without a copy): the prepared dataset's and every
    transform's one reading of a stored volume."""
    import numpy as np

    if stored.dtype == np.uint8:
        return bytes_to_intensity(stored)
    return np.asarray(stored, dtype=np.float32)


#: Added by the engine beside :data:`BATCH_KEYS`: each sample's domain as an
#: int64 index into the run's sorted domain names. It rides to the device with
#: the batch, so per-domain losses cost no host-to-device copy per step.
DOMAIN_ID_KEY = "domain_id"
