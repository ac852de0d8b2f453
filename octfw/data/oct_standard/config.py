"""Config classes of the ``oct-standard`` transform (light: attrs only).

They live below :mod:`octfw.data.oct_standard.transform` and :mod:`octfw.data.oct_standard.masks`,
which read them, and :mod:`octfw.data.oct_standard` registers them; nothing here imports
numpy or torch, so recipe validation stays fast.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.fields import byte_size, choices, doc, in_range, length, non_negative, positive

__all__ = ["MaskConfig", "OCTStandardConfig"]


_each_positive = attrs.validators.deep_iterable(member_validator=positive)


def _percentile_pair(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    low, high = value
    if not 0.0 <= low < high <= 100.0:
        raise ValueError(f"must be [low, high] with 0 <= low < high <= 100, got {list(value)!r}")


def _aspect_pair(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    low, high = value
    if not 0.0 < low <= high:
        raise ValueError(f"must be [low, high] with 0 < low <= high, got {list(value)!r}")


def _at_least_one_block(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    # Validators run once every field is set, so the sibling field is readable.
    if instance.short_blocks + value < 1:
        raise ValueError(
            f"short_blocks + long_blocks must be >= 1, got {instance.short_blocks} + {value}"
        )


@attrs.frozen
class MaskConfig:
    """The ``[transform.mask]`` table: how patches are split into context and target."""

    generator: str = doc(
        "'random' (a fixed share of patches at random, the seeds' masking) or "
        "'multiblock3d' (V-JEPA blocks spanning full depth, trimmed or padded to the "
        "expected union size so the count is fixed)",
        default="random",
        validator=choices("random", "multiblock3d"),
    )
    ratio: float = doc(
        "random: share of patches that are targets (count = round(ratio x patches))",
        default=0.6,
        validator=in_range(0.0, 1.0, low_open=True, high_open=True),
    )
    short_blocks: int = doc(
        "multiblock3d: number of short-range blocks", default=8, validator=non_negative
    )
    short_scale: float = doc(
        "multiblock3d: area of a short-range block as a share of the H x W patch plane",
        default=0.15,
        validator=in_range(0.0, 1.0, low_open=True),
    )
    long_blocks: int = doc(
        "multiblock3d: number of long-range blocks",
        default=2,
        validator=[non_negative, _at_least_one_block],
    )
    long_scale: float = doc(
        "multiblock3d: area of a long-range block as a share of the H x W patch plane",
        default=0.7,
        validator=in_range(0.0, 1.0, low_open=True),
    )
    aspect_ratio: tuple[float, float] = doc(
        "multiblock3d: [low, high] range of block height / width on the patch plane",
        default=(0.75, 1.5),
        validator=[length(2), _aspect_pair],
    )


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
