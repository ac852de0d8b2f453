"""Fixed-size patch masks: counts, determinism, geometry, and index validation."""

from __future__ import annotations

import numpy as np
import pytest

from octfw.plugins.transforms.oct_standard import MaskConfig
from octfw.models.masks import (
    MultiBlock3DMask,
    RandomMask,
    mask_generator_from_config,
    validate_indices,
)
from octfw.errors import ContractError, UserError

GRIDS = [(4, 4, 4), (2, 8, 8), (1, 5, 13), (16, 24, 24)]
GENERATORS = [
    RandomMask(0.6),
    RandomMask(0.25),
    MultiBlock3DMask(),
    MultiBlock3DMask(long_blocks=0),
    MultiBlock3DMask(short_blocks=0, long_blocks=1, long_scale=0.5),
]


@pytest.mark.parametrize("generator", GENERATORS, ids=repr)
@pytest.mark.parametrize("grid", GRIDS)
def test_counts_are_fixed_across_seeds(generator, grid):
    n = int(np.prod(grid))
    num_context, num_target = generator.counts(grid)
    assert num_context + num_target == n
    assert 1 <= num_target <= n - 1
    for seed in range(25):
        context, target = generator(grid, np.random.default_rng(seed))
        assert (len(context), len(target)) == (num_context, num_target)


@pytest.mark.parametrize("generator", GENERATORS, ids=repr)
@pytest.mark.parametrize("grid", GRIDS[:3])
def test_indices_are_sorted_int64_disjoint_and_cover_the_grid(generator, grid):
    n = int(np.prod(grid))
    for seed in range(10):
        context, target = generator(grid, np.random.default_rng(seed))
        for idx in (context, target):
            assert idx.dtype == np.int64 and idx.ndim == 1
            assert np.all(np.diff(idx) > 0)
        assert np.intersect1d(context, target).size == 0
        np.testing.assert_array_equal(np.union1d(context, target), np.arange(n))
        validate_indices(context, target, n)


@pytest.mark.parametrize("generator", GENERATORS, ids=repr)
def test_same_seed_gives_same_mask_and_seeds_differ(generator):
    grid = (2, 8, 8)
    first = generator(grid, np.random.default_rng(7))
    again = generator(grid, np.random.default_rng(7))
    np.testing.assert_array_equal(first[1], again[1])
    np.testing.assert_array_equal(first[0], again[0])
    others = {tuple(generator(grid, np.random.default_rng(s))[1]) for s in range(8)}
    assert len(others) > 1


def test_random_count_is_rounded_ratio():
    assert RandomMask(0.6).counts((16, 24, 24)) == (3686, 5530)  # round(0.6 * 9216)
    assert RandomMask(0.6).counts((4, 4, 4)) == (26, 38)  # 38.4 -> 38


def test_random_count_is_clamped_so_neither_side_is_empty():
    assert RandomMask(0.01).counts((1, 2, 2)) == (3, 1)
    assert RandomMask(0.99).counts((1, 2, 2)) == (1, 3)
    with pytest.raises(UserError, match="at least 2"):
        RandomMask(0.5).counts((1, 1, 1))


def test_random_ratio_out_of_range_is_refused():
    with pytest.raises(UserError, match="transform.mask.ratio"):
        RandomMask(1.0)


def test_multiblock_blocks_span_full_depth_before_trimming():
    generator = MultiBlock3DMask()
    for seed in range(20):
        blocks = generator.block_mask((5, 12, 12), np.random.default_rng(seed))
        assert blocks.shape == (5, 12, 12)
        # Every (h, w) column is either masked at all depths or at none.
        np.testing.assert_array_equal(blocks.all(axis=0), blocks.any(axis=0))
        assert blocks.any()


def test_multiblock_trims_or_pads_the_union_of_its_blocks():
    generator = MultiBlock3DMask()
    grid = (2, 8, 8)
    _, num_target = generator.counts(grid)
    for seed in range(30):
        union = np.flatnonzero(generator.block_mask(grid, np.random.default_rng(seed)))
        _, target = generator(grid, np.random.default_rng(seed))
        if union.size >= num_target:
            assert np.isin(target, union).all()  # trimmed: target is inside the blocks
        else:
            assert np.isin(union, target).all()  # padded: blocks are all in the target


@pytest.mark.parametrize("grid", [(2, 8, 8), (1, 6, 10)])
def test_multiblock_target_count_is_the_expected_union_size(grid):
    generator = MultiBlock3DMask()
    rng = np.random.default_rng(0)
    mean_union = np.mean([generator.block_mask(grid, rng).mean() for _ in range(1500)])
    assert generator.expected_fraction(grid) == pytest.approx(mean_union, abs=0.01)
    _, num_target = generator.counts(grid)
    assert num_target == round(generator.expected_fraction(grid) * np.prod(grid))


def test_multiblock_needs_a_block():
    with pytest.raises(UserError, match="at least one block"):
        MultiBlock3DMask(short_blocks=0, long_blocks=0)


def test_mask_config_builds_the_named_generator():
    assert isinstance(mask_generator_from_config(MaskConfig()), RandomMask)
    generator = mask_generator_from_config(
        MaskConfig(generator="multiblock3d", short_blocks=3, long_blocks=1)
    )
    assert isinstance(generator, MultiBlock3DMask)
    assert generator.scales == (0.15, 0.15, 0.15, 0.7)


def test_mask_config_refuses_bad_values():
    with pytest.raises(ValueError, match="short_blocks \\+ long_blocks"):
        MaskConfig(short_blocks=0, long_blocks=0)
    with pytest.raises(ValueError, match="must be one of"):
        MaskConfig(generator="blocks")
    with pytest.raises(ValueError):
        MaskConfig(aspect_ratio=(1.5, 0.75))


def test_validate_indices_refuses_a_voxel_mask():
    voxel_mask = np.zeros((16, 64, 64), dtype=bool)
    with pytest.raises(ContractError) as info:
        validate_indices(np.arange(4), voxel_mask, 64)
    assert (
        "mask must be patch indices of shape [num_patches_masked], got a [16, 64, 64] "
        "array: did you pass a voxel mask?" in str(info.value)
    )
    assert "target_idx" in str(info.value)


@pytest.mark.parametrize(
    ("context", "target", "message"),
    [
        (np.arange(4), np.zeros(8, dtype=bool), "boolean"),
        (np.arange(4), np.arange(4, 8, dtype=np.float32), "integers"),
        (np.arange(4), np.array([4, 8]), r"\[0, 7\]"),
        (np.arange(4), np.array([-1, 5]), r"\[0, 7\]"),
        (np.arange(4), np.array([3, 5]), "disjoint"),
        (np.arange(4), np.array([5, 5]), "repeat"),
        (np.arange(4), np.array([], dtype=np.int64), "at least one"),
        (np.zeros((2, 4), dtype=np.int64), np.array([5]), "batch"),
    ],
)
def test_validate_indices_refuses_unusable_indices(context, target, message):
    with pytest.raises(ContractError, match=message):
        validate_indices(context, target, 8)


def test_validate_indices_accepts_lists_and_int32():
    assert validate_indices([0, 2], np.array([1, 3], dtype=np.int32), 4) is None
    assert validate_indices(np.array([3, 1], dtype=np.int32), [2], 4) is None
    # Accepted means checked like int64 arrays, not waved through.
    with pytest.raises(ContractError, match="disjoint"):
        validate_indices([0, 2], np.array([2, 3], dtype=np.int32), 4)
    with pytest.raises(ContractError, match=r"\[0, 3\]"):
        validate_indices([0, 4], [1], 4)
