"""Config classes of the ``oct-standard`` transform (light: attrs only).

They live below :mod:`octfw.plugins.transforms.oct_standard.transform`, which reads them
(the mask table's config is :mod:`octfw.models.mask_config`), and :mod:`octfw.plugins.transforms.oct_standard` registers them; nothing here imports
numpy or torch, so recipe validation stays fast.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import byte_size, choices, doc, in_range, length, non_negative, positive
from octfw.models.mask_config import MaskConfig

__all__ = ["MaskConfig", "OCTStandardConfig"]


_each_positive = attrs.validators.deep_iterable(member_validator=positive)


def _percentile_pair(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    low, high = value
    if not 0.0 <= low < high <= 100.0:
        raise ValueError(f"must be [low, high] with 0 <= low < high <= 100, got {list(value)!r}")


@attrs.frozen
class OCTStandardConfig:
    """Options of the ``oct-standard`` transform (recipe table ``[transform]``)."""

    image_size: tuple[int, int, int] = doc(
        "model input size [D, H, W] in voxels; must be divisible by the model's patch_size",
        default=(16, 64, 64),
        validator=[length(3), _each_positive],
    )
    target_spacing: tuple[float, float, float] | None = doc(
        "resample to this voxel spacing [dz, dy, dx] in mm before fitting to image_size; "
        "leave out to skip resampling",
        default=None,
        validator=attrs.validators.optional([length(3), _each_positive]),
    )
    anti_aliasing: bool = doc(
        "smooth before downsampling so speckle does not alias (slower; done once per "
        "volume when prepared volumes are cached)",
        default=True,
    )
    percentiles: tuple[float, float] = doc(
        "per-volume intensity percentiles [low, high] mapped to [0, 1], then clipped",
        default=(1.0, 99.0),
        validator=[length(2), _percentile_pair],
    )
    fit: str = doc(
        "how the volume reaches image_size: 'resize' (interpolate) or 'crop_pad' "
        "(centre crop or zero pad, keeps the spacing)",
        default="resize",
        validator=choices("resize", "crop_pad"),
    )
    flip_prob: float = doc(
        "probability of flipping a view along W (left-right)",
        default=0.0,
        validator=in_range(0.0, 1.0),
    )
    affine_prob: float = doc(
        "probability of a small in-plane (H x W) rotation and scaling of a view",
        default=0.0,
        validator=in_range(0.0, 1.0),
    )
    rotate_degrees: float = doc(
        "largest in-plane rotation, in degrees, when the affine augmentation fires",
        default=10.0,
        validator=in_range(0.0, 180.0),
    )
    scale_range: float = doc(
        "in-plane scaling factor drawn from [1 - scale_range, 1 + scale_range]",
        default=0.1,
        validator=in_range(0.0, 1.0, high_open=True),
    )
    intensity_jitter: float = doc(
        "largest random contrast change and brightness shift of a view (0 disables)",
        default=0.0,
        validator=in_range(0.0, 1.0),
    )
    augment_target: bool = doc(
        "augment the target view too (independently of the context view); by "
        "default the target view is the prepared volume unchanged",
        default=False,
    )
    mask: MaskConfig = doc(
        "patch masking, table [transform.mask]", factory=MaskConfig
    )
    cache: bool = doc(
        "keep prepared volumes (decoded, resampled, normalised, fitted) on disk under "
        "<run.cache_dir>/prepared, so each volume is decoded once across epochs and runs, "
        "at most cache_max_bytes of them",
        default=True,
    )
    cache_max_bytes: int | str = doc(
        "the most disk the prepared-volume cache takes on this host, shared by every "
        "transform option set: bytes, or a size such as \"20GiB\" or \"500MB\"; the least "
        "recently used volumes are evicted beyond it (a float32 volume of image_size "
        "[64, 384, 384] takes 37.7 MB); 0 turns the cache off",
        default="20GiB",
        validator=byte_size,
    )

    def mask_pairs(self) -> tuple[str, ...]:
        """The mask configurations each draw makes (:class:`octfw.types.MaskingConfig`)."""
        return self.mask.pair_names()
