"""Config of the patch masks (recipe key ``transform.mask``; light: attrs only).

Beside :mod:`octfw.models.masks`, which reads it, so a transform of any package
can take the same mask table; nothing here imports numpy or torch.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import choices, doc, in_range, length, non_negative

__all__ = ["MaskConfig"]


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
        "'multiblock3d' (V-JEPA's: the short-range blocks and the long-range blocks, each spanning "
        "the full depth, are two context/target pairs whose losses are averaged; each union is "
        "trimmed or padded to its expected size so the counts are fixed). A configuration that "
        "leaves under 10% of the patches as context is refused",
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

    def pair_names(self) -> tuple[str, ...]:
        """The context/target pairs one draw makes (:meth:`octfw.models.masks.MaskGenerator.pairs`):
        ``""`` for random masking; V-JEPA's ``short`` and ``long`` configurations for multiblock3d."""
        if self.generator == "random":
            return ("",)
        return tuple(name for name, blocks in (("short", self.short_blocks), ("long", self.long_blocks)) if blocks)
