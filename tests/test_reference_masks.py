"""octfw's multi-block masks against V-JEPA's, statistic by statistic (tests/fixtures/reference/masks.json).

The fixture holds what facebookresearch/vjepa2's own mask generator drew
(tools/parity/mask_statistics.py): per grid and configuration, the block
shapes with their counts and the mean and sd of the target share over 4,000
one-sample draws, and the shares its collator keeps at batch size 24.

The bound is sampling error: a share observed over ``n`` draws is compared
with octfw's within 4 standard errors (``|octfw - reference| < 4 * SE``, SE of
the difference of two independent means, or of a proportion ``sqrt(p (1 - p) / n)``).
A true difference of 4 SE fails; a correct generator fails by chance about
once in 16,000 comparisons, and octfw's draws here are seeded, so it never flakes.

Two differences are octfw's on purpose (docs/reference-parity.md) and are
asserted as such: the counts are fixed (XLA), at octfw's expected union size,
where the reference redraws a sample whose blocks cover the whole grid and
then cuts a batch to its smallest sample.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from octfw.models.mask_config import MaskConfig
from octfw.models.masks import MultiBlock3DMask, _block_size, mask_generator_from_config

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "reference" / "masks.json").read_text())
CASES = [(grid, name) for grid, entry in FIXTURE["grids"].items() for name in entry["configurations"]]
GENERATOR = MultiBlock3DMask()
DRAWS = 4000


def case(grid_name: str, configuration: str) -> tuple[tuple[int, int, int], dict]:
    entry = FIXTURE["grids"][grid_name]
    return tuple(entry["grid"]), entry["configurations"][configuration]


def octfw_unions(grid, configuration: str, redraw: bool = False) -> np.ndarray:
    """Shares of the grid inside octfw's block unions (before trimming), DRAWS seeded draws.

    ``redraw``: as the reference does, a draw whose blocks cover the whole grid (no
    context) is placed again with the same block shape (its ``while empty_context``
    loop keeps the size it drew once per call). octfw's own generator draws the shape
    here, from a one-point aspect range."""
    rng = np.random.default_rng(20261127)
    shares = []
    for _ in range(DRAWS):
        if not redraw:
            shares.append(GENERATOR.block_mask(grid, configuration, rng).mean())
            continue
        ratio = rng.uniform(*GENERATOR.aspect_ratio)
        one_shape = MultiBlock3DMask(aspect_ratio=(ratio, ratio))
        union = one_shape.block_mask(grid, configuration, rng)
        while union.all():
            union = one_shape.block_mask(grid, configuration, rng)
        shares.append(union.mean())
    return np.array(shares)


def test_the_fixture_names_the_reference_commit_and_its_draws():
    assert FIXTURE["reference"]["repo"].endswith("facebookresearch/vjepa2")
    assert len(FIXTURE["reference"]["commit"]) == 40
    assert FIXTURE["grids"]["vjepa2-16f-256px"]["grid"] == [8, 16, 16]
    assert all(c["target_fraction"]["n"] == FIXTURE["draws"] for _, c in map(lambda k: case(*k), CASES))


def test_octfw_defaults_are_the_published_configurations():
    published = FIXTURE["mask"]
    generator = mask_generator_from_config(MaskConfig(generator="multiblock3d"))
    for name, scales in generator.configurations.items():
        assert len(scales) == published[name]["num_blocks"]
        assert [scales[0], scales[0]] == published[name]["spatial_scale"]
        assert list(generator.aspect_ratio) == published[name]["aspect_ratio"]
        # Blocks span all frames in the reference and all depth slices in octfw.
        assert published[name]["temporal_scale"] == [1.0, 1.0] and published[name]["max_temporal_keep"] == 1.0


@pytest.mark.parametrize("grid_name, configuration", CASES)
def test_block_shapes_and_their_frequencies_match(grid_name, configuration):
    grid, recorded = case(grid_name, configuration)
    assert all(shape["t"] == grid[0] for shape in recorded["block_shapes"])  # the full depth
    n = sum(shape["count"] for shape in recorded["block_shapes"])
    # octfw's probability of each (h, w): the share of the aspect-ratio range that gives it.
    low, high = GENERATOR.aspect_ratio
    ratios = low + (np.arange(100_000) + 0.5) / 100_000 * (high - low)
    scale = GENERATOR.configurations[configuration][0]
    shapes, counts = np.unique([_block_size(scale, r, grid[1], grid[2]) for r in ratios], axis=0,
                               return_counts=True)
    ours = {tuple(int(v) for v in s): c / len(ratios) for s, c in zip(shapes, counts)}
    theirs = {(s["h"], s["w"]): s["count"] / n for s in recorded["block_shapes"]}
    assert set(theirs) <= set(ours)
    # The blocks' areas as a share of the plane span the same range (the floored area, rounded sides).
    areas = [h * w / (grid[1] * grid[2]) for h, w in ours]
    assert [min(areas), max(areas)] == pytest.approx(recorded["scale_observed"])
    for shape, p in ours.items():
        bound = 4 * math.sqrt(max(p * (1 - p), 1e-4) / n)
        assert abs(theirs.get(shape, 0.0) - p) < bound, (shape, theirs.get(shape, 0.0), p)


@pytest.mark.parametrize("grid_name, configuration", CASES)
def test_target_share_mean_and_sd_match_within_four_standard_errors(grid_name, configuration):
    grid, recorded = case(grid_name, configuration)
    ref = recorded["target_fraction"]
    # The reference redraws the places of a sample whose blocks leave no context; the same
    # rule applied to octfw's draws (octfw itself trims instead: the next test).
    unions = octfw_unions(grid, configuration, redraw=True)
    mean, sd, n = unions.mean(), unions.std(ddof=1), len(unions)
    se_mean = math.hypot(ref["sd"] / math.sqrt(ref["n"]), sd / math.sqrt(n))
    assert abs(mean - ref["mean"]) < 4 * se_mean, (mean, ref["mean"], se_mean)
    se_sd = math.hypot(ref["sd"] / math.sqrt(2 * (ref["n"] - 1)), sd / math.sqrt(2 * (n - 1)))
    assert abs(sd - ref["sd"]) < 4 * se_sd, (sd, ref["sd"], se_sd)
    assert recorded["context_fraction"]["mean"] == pytest.approx(1 - ref["mean"])


@pytest.mark.parametrize("grid_name, configuration", CASES)
def test_fixed_counts_are_the_expected_union_not_the_redrawn_one(grid_name, configuration):
    """octfw's target count is round(E[union] x N), the same for every draw; the reference's mean
    excludes the draws it redraws (the whole grid covered), so the two agree where no draw covers
    the grid, and octfw's is the larger where some do."""
    grid, recorded = case(grid_name, configuration)
    ref = recorded["target_fraction"]
    total = int(np.prod(grid))
    fixed = GENERATOR.pairs(grid)[configuration][1] / total
    unconditional = octfw_unions(grid, configuration)
    redrawn = octfw_unions(grid, configuration, redraw=True)
    bound = 4 * ref["sd"] / math.sqrt(ref["n"]) + 0.5 / total  # sampling error + the count's rounding
    if not unconditional.max() == 1.0:  # no draw covered the grid: nothing to redraw
        assert abs(fixed - ref["mean"]) < bound, (fixed, ref["mean"], bound)
        return
    # The gap is what the redraw removes, as octfw's own draws measure it.
    gap = unconditional.mean() - redrawn.mean()
    se_gap = math.hypot(unconditional.std() / math.sqrt(DRAWS), redrawn.std() / math.sqrt(DRAWS))
    assert fixed - ref["mean"] > -bound
    assert abs((fixed - ref["mean"]) - gap) < bound + 4 * se_gap, (fixed, ref["mean"], gap)


@pytest.mark.parametrize("grid_name, configuration", CASES)
def test_the_reference_batch_sees_fewer_targets_than_octfw(grid_name, configuration):
    """The reference cuts every sample of a batch to the batch's smallest count (here 24 samples):
    its model sees fewer targets and context than one sample's mean; octfw keeps each sample's
    fixed count, with no coupling between the samples of a batch."""
    grid, recorded = case(grid_name, configuration)
    collated, single = recorded["collated"], recorded["target_fraction"]
    fixed = GENERATOR.pairs(grid)[configuration][1] / int(np.prod(grid))
    assert collated["batch_size"] == 24
    se = math.hypot(collated["target_fraction"]["sd"] / math.sqrt(collated["target_fraction"]["n"]),
                    single["sd"] / math.sqrt(single["n"]))
    assert collated["target_fraction"]["mean"] < single["mean"] - 4 * se
    assert collated["target_fraction"]["mean"] < fixed
    assert collated["context_fraction"]["mean"] < 1 - single["mean"]
