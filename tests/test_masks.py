"""Fixed-size patch masks: counts, determinism, geometry, and index validation."""

from __future__ import annotations

import numpy as np
import pytest

from octfw.plugins.transforms.oct_standard import MaskConfig
from octfw.models.masks import (
    MultiBlock3DMask,
    RandomMask,
    check_context_share,
    mask_generator_from_config,
    validate_indices,
)
from octfw.display.errors import ContractError, UserError

GRIDS = [(4, 4, 4), (2, 8, 8), (1, 5, 13), (16, 24, 24)]
GENERATORS = [
    RandomMask(0.6),
    RandomMask(0.25),
    MultiBlock3DMask(),
    MultiBlock3DMask(long_blocks=0),
    MultiBlock3DMask(short_blocks=0, long_blocks=1, long_scale=0.5),
]


def draws(generator, grid, seed):
    """Every (configuration, context, target) of one draw."""
    return [(name, *pair) for name, pair in generator(grid, np.random.default_rng(seed)).items()]


@pytest.mark.parametrize("generator", GENERATORS, ids=repr)
@pytest.mark.parametrize("grid", GRIDS)
def test_counts_are_fixed_across_seeds(generator, grid):
    n = int(np.prod(grid))
    pairs = generator.pairs(grid)
    for num_context, num_target in pairs.values():
        assert num_context + num_target == n
        assert 1 <= num_target <= n - 1
    for seed in range(25):
        drawn = draws(generator, grid, seed)
        assert [name for name, _, _ in drawn] == list(pairs)
        for name, context, target in drawn:
            assert (len(context), len(target)) == pairs[name]


@pytest.mark.parametrize("generator", GENERATORS, ids=repr)
@pytest.mark.parametrize("grid", GRIDS[:3])
def test_indices_are_sorted_int64_disjoint_and_cover_the_grid(generator, grid):
    n = int(np.prod(grid))
    for seed in range(10):
        for _, context, target in draws(generator, grid, seed):
            for idx in (context, target):
                assert idx.dtype == np.int64 and idx.ndim == 1
                assert np.all(np.diff(idx) > 0)
            assert np.intersect1d(context, target).size == 0
            np.testing.assert_array_equal(np.union1d(context, target), np.arange(n))
            validate_indices(context, target, n)


@pytest.mark.parametrize("generator", GENERATORS, ids=repr)
def test_same_seed_gives_same_mask_and_seeds_differ(generator):
    grid = (2, 8, 8)
    first, again = draws(generator, grid, 7), draws(generator, grid, 7)
    for (_, c1, t1), (_, c2, t2) in zip(first, again):
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(c1, c2)
    others = {tuple(draws(generator, grid, s)[0][2]) for s in range(8)}
    assert len(others) > 1


def test_random_count_is_rounded_ratio():
    assert RandomMask(0.6).pairs((16, 24, 24)) == {"": (3686, 5530)}  # round(0.6 * 9216)
    assert RandomMask(0.6).pairs((4, 4, 4)) == {"": (26, 38)}  # 38.4 -> 38


def test_random_count_is_clamped_so_neither_side_is_empty():
    assert RandomMask(0.01).pairs((1, 2, 2)) == {"": (3, 1)}
    assert RandomMask(0.99).pairs((1, 2, 2)) == {"": (1, 3)}
    with pytest.raises(UserError, match="at least 2"):
        RandomMask(0.5).pairs((1, 1, 1))


def test_random_ratio_out_of_range_is_refused():
    with pytest.raises(UserError, match="transform.mask.ratio"):
        RandomMask(1.0)


def test_multiblock_is_vjepas_two_configurations_each_its_own_pair():
    """V-JEPA's short-range and long-range blocks are two context/target pairs, not one union:
    on the 4 x 4 x 4 grid the union of all ten blocks left 3 context patches of 64."""
    generator = MultiBlock3DMask()
    pairs = generator.pairs((4, 4, 4))
    assert list(pairs) == ["short", "long"]
    assert pairs["short"][0] > pairs["long"][0] >= 0.1 * 64  # short-range leaves more context
    assert all(context >= 7 for context, _ in pairs.values())
    drawn = dict((name, (c, t)) for name, c, t in draws(generator, (4, 4, 4), 0))
    assert not np.array_equal(drawn["short"][1], drawn["long"][1])  # drawn apart


def test_multiblock_blocks_span_full_depth_before_trimming():
    generator = MultiBlock3DMask()
    for seed in range(20):
        for configuration in generator.configurations:
            blocks = generator.block_mask((5, 12, 12), configuration, np.random.default_rng(seed))
            assert blocks.shape == (5, 12, 12)
            # Every (h, w) column is either masked at all depths or at none.
            np.testing.assert_array_equal(blocks.all(axis=0), blocks.any(axis=0))
            assert blocks.any()


def test_multiblock_trims_or_pads_the_union_of_its_blocks():
    generator = MultiBlock3DMask(long_blocks=0)  # one configuration: one draw of blocks per mask
    grid = (2, 8, 8)
    _, num_target = generator.pairs(grid)["short"]
    for seed in range(30):
        union = np.flatnonzero(generator.block_mask(grid, "short", np.random.default_rng(seed)))
        _, target = generator(grid, np.random.default_rng(seed))["short"]
        if union.size >= num_target:
            assert np.isin(target, union).all()  # trimmed: target is inside the blocks
        else:
            assert np.isin(union, target).all()  # padded: blocks are all in the target


@pytest.mark.parametrize("grid", [(2, 8, 8), (1, 6, 10)])
@pytest.mark.parametrize("configuration", ["short", "long"])
def test_multiblock_target_count_is_the_expected_union_size(grid, configuration):
    generator = MultiBlock3DMask()
    rng = np.random.default_rng(0)
    mean_union = np.mean([generator.block_mask(grid, configuration, rng).mean() for _ in range(1500)])
    assert generator.expected_fraction(grid, configuration) == pytest.approx(mean_union, abs=0.01)
    _, num_target = generator.pairs(grid)[configuration]
    assert num_target == round(generator.expected_fraction(grid, configuration) * np.prod(grid))


def test_multiblock_needs_a_block():
    with pytest.raises(UserError, match="at least one block"):
        MultiBlock3DMask(short_blocks=0, long_blocks=0)


def test_mask_config_builds_the_named_generator():
    assert isinstance(mask_generator_from_config(MaskConfig()), RandomMask)
    assert MaskConfig().pair_names() == ("",)
    config = MaskConfig(generator="multiblock3d", short_blocks=3, long_blocks=1)
    generator = mask_generator_from_config(config)
    assert isinstance(generator, MultiBlock3DMask)
    assert generator.configurations == {"short": (0.15, 0.15, 0.15), "long": (0.7,)}
    assert config.pair_names() == tuple(generator.configurations)
    assert MaskConfig(generator="multiblock3d", short_blocks=0).pair_names() == ("long",)


@pytest.mark.parametrize("generator, grid, message", [
    (RandomMask(0.95), (4, 4, 4), r"the mask leaves 3 of 64 patches as context \(5%\)"),
    (MultiBlock3DMask(short_blocks=0, long_blocks=3, long_scale=0.8), (4, 4, 4),
     r"mask configuration 'long' leaves \d of 64 patches as context"),
])
def test_a_configuration_leaving_under_a_tenth_as_context_is_refused(generator, grid, message):
    with pytest.raises(UserError, match=message):
        check_context_share(generator, grid)


def test_the_published_configurations_pass_on_every_grid_here():
    for grid in GRIDS:
        check_context_share(MultiBlock3DMask(), grid)
        check_context_share(RandomMask(0.6), grid)


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


def test_block_area_is_floored_to_whole_patches_as_vjepa_does():
    # V-JEPA: int(16 * 0.15) = 2 patches, so 1 x 1 at ratio 1 (an unfloored 2.4 gave 2 x 2);
    # int(64 * 0.15) = 9: 4 x 2 at ratio 1.5 (9.6 gave 4 x 3). tests/test_reference_masks.py
    # compares the shapes' frequencies with the reference's.
    from octfw.models.masks import _block_size

    assert _block_size(0.15, 1.0, 4, 4) == (1, 1)
    assert _block_size(0.15, 1.5, 8, 8) == (4, 2)
    assert _block_size(0.01, 1.0, 4, 4) == (1, 1)  # octfw's floor of one patch (V-JEPA's would be empty)


def _rectangles(plane: np.ndarray) -> list[tuple[int, int]]:
    """(height, width) of the bounding box of each 4-connected region of ``plane``."""
    seen = np.zeros_like(plane, dtype=bool)
    boxes = []
    for start in zip(*np.nonzero(plane)):
        if seen[start]:
            continue
        stack, cells = [start], []
        seen[start] = True
        while stack:
            r, c = stack.pop()
            cells.append((r, c))
            for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= nr < plane.shape[0] and 0 <= nc < plane.shape[1] and plane[nr, nc] and not seen[nr, nc]:
                    seen[nr, nc] = True
                    stack.append((nr, nc))
        rows, cols = zip(*cells)
        boxes.append((max(rows) - min(rows) + 1, max(cols) - min(cols) + 1))
    return boxes


def test_the_blocks_of_one_draw_share_one_shape_as_vjepas_do():
    generator = MultiBlock3DMask(short_blocks=2, short_scale=0.01, long_blocks=0, aspect_ratio=(0.5, 2.0))
    shapes_seen, separate = set(), 0
    for seed in range(60):
        boxes = _rectangles(generator.block_mask((1, 64, 64), "short", np.random.default_rng(seed))[0])
        if len(boxes) != 2:
            continue  # the two blocks touch: their shapes cannot be told apart
        separate += 1
        assert boxes[0] == boxes[1], seed
        shapes_seen.add(boxes[0])
    assert separate > 40 and len(shapes_seen) > 3  # the shape does vary from draw to draw
