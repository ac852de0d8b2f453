"""Fixed-size patch masks for JEPA pretraining.

A mask generator splits the patch grid ``(D/pd, H/ph, W/pw)`` into the
patches the context encoder sees (``context_idx``) and the patches the
predictor must predict (``target_idx``), once per *mask configuration* it
names (:meth:`MaskGenerator.pairs`). V-JEPA draws its short-range and its
long-range blocks as two such context/target pairs and averages the losses;
a single random mask is one pair named ``""``. Indices count patches in
row-major order over the grid. Both arrays are sorted int64 and their
lengths depend only on the generator's options and the grid, never on the
draw: XLA compiles one graph per shape, so a count that varied per sample
would recompile every step (and a varying count cannot be batched anyway).

All randomness comes from the ``rng`` argument, so the same seed gives the
same mask in any worker.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Protocol

import numpy as np

from octfw.display.errors import ContractError, UserError
from octfw.models.mask_config import MaskConfig

__all__ = [
    "Grid",
    "MIN_CONTEXT_SHARE",
    "check_context_share",
    "MaskGenerator",
    "RandomMask",
    "MultiBlock3DMask",
    "mask_generator_from_config",
    "validate_indices",
]

#: Patch grid ``(gd, gh, gw)``: patches along depth, height and width.
Grid = tuple[int, int, int]

#: The smallest share of the tokens a mask configuration may leave as context. Below
#: it the predictor guesses from a handful of patches: the old union of all ten
#: V-JEPA blocks left 3 of 64 on a 4 x 4 x 4 grid.
MIN_CONTEXT_SHARE = 0.10


class MaskGenerator(Protocol):
    """What the transform needs from a mask generator."""

    def pairs(self, grid: Grid) -> dict[str, tuple[int, int]]:
        """``{configuration: (num_context, num_target)}`` for ``grid``; the same for every draw.
        One entry per context/target pair a draw makes (``""`` for a single pair)."""
        ...

    def __call__(self, grid: Grid, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{configuration: (context_idx, target_idx)}``: sorted int64, disjoint, covering the grid."""
        ...


def check_context_share(generator: MaskGenerator, grid: Grid) -> None:
    """Refuse a mask configuration that leaves fewer than :data:`MIN_CONTEXT_SHARE` of the
    tokens as context (UserError naming it and its counts)."""
    for name, (num_context, num_target) in generator.pairs(grid).items():
        total = num_context + num_target
        if num_context < MIN_CONTEXT_SHARE * total:
            which = f"mask configuration {name!r}" if name else "the mask"
            raise UserError(
                f"transform.mask: {which} leaves {num_context} of {total} patches as context "
                f"({num_context / total:.0%}), fewer than {MIN_CONTEXT_SHARE:.0%}: the predictor "
                "would guess from almost nothing (use smaller or fewer blocks, a lower ratio, or "
                "a finer patch grid)")


def _num_patches(grid: Grid) -> int:
    if len(grid) != 3 or any(int(g) < 1 for g in grid):
        raise UserError(f"patch grid must be 3 positive sizes (D, H, W), got {list(grid)}")
    return int(np.prod(grid))


def _clamped_target_count(fraction: float, num_patches: int) -> int:
    """``round(fraction * N)`` clamped to ``[1, N - 1]`` so neither side is empty.

    Rounds half up (not Python's half-to-even) so the count is easy to predict.
    """
    if num_patches < 2:
        raise UserError(
            f"the patch grid has {num_patches} patch; masking needs at least 2 "
            "(make transform.image_size larger or the model's patch_size smaller)"
        )
    count = int(math.floor(fraction * num_patches + 0.5))
    return min(max(count, 1), num_patches - 1)


def _split(target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``(context_idx, target_idx)`` from a boolean target mask over the flat grid."""
    return (
        np.flatnonzero(~target).astype(np.int64),
        np.flatnonzero(target).astype(np.int64),
    )


class RandomMask:
    """Masks a fixed fraction of patches chosen uniformly at random.

    The seeds' variant: ``ratio`` 0.6 of the patches are targets.
    """

    def __init__(self, ratio: float = 0.6):
        if not 0.0 < ratio < 1.0:
            raise UserError(f"transform.mask.ratio must be in (0, 1), got {ratio!r}")
        self.ratio = float(ratio)

    def pairs(self, grid: Grid) -> dict[str, tuple[int, int]]:
        n = _num_patches(grid)
        num_target = _clamped_target_count(self.ratio, n)
        return {"": (n - num_target, num_target)}

    def __call__(self, grid: Grid, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        n = _num_patches(grid)
        _, num_target = self.pairs(grid)[""]
        target = np.zeros(n, dtype=bool)
        target[rng.permutation(n)[:num_target]] = True
        return {"": _split(target)}

    def __repr__(self) -> str:
        return f"RandomMask(ratio={self.ratio})"


def _block_size(scale: float, ratio: float, gh: int, gw: int) -> tuple[int, int]:
    """Height and width in patches of a block of ``scale`` x plane area and ``ratio`` = h / w.

    As V-JEPA's ``_sample_block_size``: the area is floored to whole patches
    (``int(gh * gw * scale)``) before the square roots are rounded. Unlike it,
    each side is at least 1 patch, so a small grid never draws an empty block.
    """
    area = int(gh * gw * scale)
    height = min(max(int(round(math.sqrt(area * ratio))), 1), gh)
    width = min(max(int(round(math.sqrt(area / ratio))), 1), gw)
    return height, width


def _line_cover(n: int, size: int) -> np.ndarray:
    """Probability that each of ``n`` cells is inside a run of ``size`` placed uniformly."""
    starts = n - size + 1
    cells = np.arange(n)
    first = np.maximum(cells - size + 1, 0)
    last = np.minimum(cells, n - size)
    return (last - first + 1) / starts


@functools.lru_cache(maxsize=64)
def _expected_union_fraction(
    scales: tuple[float, ...], aspect_ratio: tuple[float, float], gh: int, gw: int
) -> float:
    """Expected share of the H x W plane covered by the union of a configuration's blocks.

    Exact for the sampling in :meth:`MultiBlock3DMask.block_mask` up to the
    quadrature over the aspect ratio: one ratio is drawn per draw and shared by
    the blocks of a scale, and given it the blocks' places are independent, so
    a cell stays uncovered only if every block misses it.
    """
    low, high = aspect_ratio
    steps = 2048
    ratios = low + (np.arange(steps) + 0.5) / steps * (high - low)
    counts = collections.Counter(scales)
    covered = 0.0
    for ratio in ratios:
        uncovered = np.ones((gh, gw))
        for scale, blocks in counts.items():
            height, width = _block_size(scale, float(ratio), gh, gw)
            hit = np.outer(_line_cover(gh, height), _line_cover(gw, width))
            uncovered *= (1.0 - hit) ** blocks
        covered += 1.0 - uncovered.mean()
    return float(covered / steps)


class MultiBlock3DMask:
    """V-JEPA's multi-block masking on the patch grid, one context/target pair per configuration.

    Each block covers a rectangle of the H x W patch plane whose area is
    ``scale`` of the plane (floored to whole patches), placed uniformly at
    random, and spans the full depth. As in V-JEPA, the aspect ratio (height /
    width) is drawn once per draw from ``aspect_ratio`` and every block of the
    configuration has that shape (V-JEPA draws it once per batch;
    docs/reference-parity.md).
    The ``short`` configuration is ``short_blocks`` blocks of ``short_scale``,
    the ``long`` configuration ``long_blocks`` blocks of ``long_scale``. As in
    V-JEPA, each configuration is its own pair: its target is the union of its
    blocks, its context the complement, and the model averages the pairs'
    losses. (The union of all ten blocks as one pair left 3 context patches of
    64 on a 4 x 4 x 4 grid.) A configuration with no blocks is left out.

    Blocks overlap at random, so a union's size varies per draw. To keep the
    counts fixed, each union is then trimmed (random target patches are
    returned to the context) or padded (random context patches join the
    target) to its expected size for this grid, computed exactly from the
    block distribution (no sampling), clamped to ``[1, N - 1]``.
    """

    def __init__(
        self,
        short_blocks: int = 8,
        short_scale: float = 0.15,
        long_blocks: int = 2,
        long_scale: float = 0.7,
        aspect_ratio: tuple[float, float] = (0.75, 1.5),
    ):
        if short_blocks < 0 or long_blocks < 0 or short_blocks + long_blocks < 1:
            raise UserError(
                "transform.mask needs at least one block: short_blocks="
                f"{short_blocks}, long_blocks={long_blocks}"
            )
        for key, scale in (("short_scale", short_scale), ("long_scale", long_scale)):
            if not 0.0 < scale <= 1.0:
                raise UserError(f"transform.mask.{key} must be in (0, 1], got {scale!r}")
        low, high = aspect_ratio
        if not 0.0 < low <= high:
            raise UserError(
                f"transform.mask.aspect_ratio must be [low, high] with 0 < low <= high, "
                f"got {list(aspect_ratio)}"
            )
        #: configuration name -> the scale of each of its blocks
        self.configurations = {name: (float(scale),) * blocks
                               for name, blocks, scale in (("short", short_blocks, short_scale),
                                                           ("long", long_blocks, long_scale)) if blocks}
        self.aspect_ratio = (float(low), float(high))

    def expected_fraction(self, grid: Grid, configuration: str) -> float:
        """Expected share of the grid inside the union of ``configuration``'s blocks (before trimming)."""
        _num_patches(grid)
        # Blocks span the full depth, so the share of the plane is the share of the grid.
        return _expected_union_fraction(self.configurations[configuration], self.aspect_ratio,
                                        int(grid[1]), int(grid[2]))

    def pairs(self, grid: Grid) -> dict[str, tuple[int, int]]:
        n = _num_patches(grid)
        counts = {}
        for name in self.configurations:
            num_target = _clamped_target_count(self.expected_fraction(grid, name), n)
            counts[name] = (n - num_target, num_target)
        return counts

    def block_mask(self, grid: Grid, configuration: str, rng: np.random.Generator) -> np.ndarray:
        """The union of ``configuration``'s blocks before trimming: boolean ``[gd, gh, gw]``."""
        _num_patches(grid)
        gd, gh, gw = (int(g) for g in grid)
        mask = np.zeros((gd, gh, gw), dtype=bool)
        ratio = rng.uniform(*self.aspect_ratio)  # one shape per draw, shared by the blocks
        for scale in self.configurations[configuration]:
            height, width = _block_size(scale, ratio, gh, gw)
            top = int(rng.integers(0, gh - height + 1))
            left = int(rng.integers(0, gw - width + 1))
            # V-JEPA blocks are tubes: every depth slice of the block is masked.
            mask[:, top:top + height, left:left + width] = True
        return mask

    def __call__(self, grid: Grid, rng: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        drawn_pairs = {}
        for name, (_, num_target) in self.pairs(grid).items():
            target = self.block_mask(grid, name, rng).reshape(-1)
            drawn = int(target.sum())
            if drawn > num_target:
                drop = rng.choice(np.flatnonzero(target), size=drawn - num_target, replace=False)
                target[drop] = False
            elif drawn < num_target:
                add = rng.choice(np.flatnonzero(~target), size=num_target - drawn, replace=False)
                target[add] = True
            drawn_pairs[name] = _split(target)
        return drawn_pairs

    def __repr__(self) -> str:
        return f"MultiBlock3DMask(configurations={self.configurations}, aspect_ratio={self.aspect_ratio})"


def mask_generator_from_config(config: "MaskConfig") -> MaskGenerator:
    """The generator a ``[transform.mask]`` table names."""
    if config.generator == "random":
        return RandomMask(config.ratio)
    if config.generator == "multiblock3d":
        return MultiBlock3DMask(
            short_blocks=config.short_blocks,
            short_scale=config.short_scale,
            long_blocks=config.long_blocks,
            long_scale=config.long_scale,
            aspect_ratio=tuple(config.aspect_ratio),
        )
    raise UserError(
        f"transform.mask.generator must be 'random' or 'multiblock3d', got {config.generator!r}"
    )


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _check_one(name: str, value: object, num_patches: int) -> np.ndarray:
    array = np.asarray(value)
    if array.ndim != 1:
        hint = ""
        if array.ndim >= 3:
            hint = ": did you pass a voxel mask?"
        elif array.ndim == 2:
            hint = ": did you pass a batch? validate one sample's indices"
        raise ContractError(
            f"{name}: mask must be patch indices of shape [num_patches_masked], "
            f"got a {_shape_text(array.shape)} array{hint}"
        )
    if array.dtype == np.bool_:
        raise ContractError(
            f"{name}: mask must be integer patch indices, got a boolean array of shape "
            f"{_shape_text(array.shape)}: pass np.flatnonzero(mask), not the mask itself"
        )
    if not np.issubdtype(array.dtype, np.integer):
        raise ContractError(f"{name}: patch indices must be integers, got dtype {array.dtype}")
    if array.size == 0:
        raise ContractError(f"{name}: no patch indices; each side needs at least one patch")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= num_patches:
        raise ContractError(
            f"{name}: patch indices must be in [0, {num_patches - 1}] for a grid of "
            f"{num_patches} patches, got values from {low} to {high}"
        )
    if np.unique(array).size != array.size:
        raise ContractError(f"{name}: patch indices repeat; each patch may appear once")
    return array


def validate_indices(context_idx: object, target_idx: object, num_patches: int) -> None:
    """Check one sample's patch indices; raise :class:`ContractError` if unusable.

    Both must be 1-D integer arrays of distinct indices in ``[0, num_patches)``,
    and no patch may be both context and target. Accepts numpy arrays, CPU
    tensors or lists.
    """
    context = _check_one("context_idx", context_idx, num_patches)
    target = _check_one("target_idx", target_idx, num_patches)
    both = np.intersect1d(context, target)
    if both.size:
        shown = ", ".join(str(int(i)) for i in both[:5])
        more = ", ..." if both.size > 5 else ""
        raise ContractError(
            f"context_idx and target_idx must be disjoint, but {both.size} patch(es) are in "
            f"both: {shown}{more}"
        )
