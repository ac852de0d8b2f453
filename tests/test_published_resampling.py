"""Published weights resampled to the recipe's geometry keep their orientation: position
tables (2D to 3D, grid changes, MAE-ST's 1-D temporal table) and patch kernels (in-plane
resize, inflation over depth) are checked with axis ramps, tables whose channels hold the
row, column or slice index, against timm's ``resample_abs_pos_embed`` (the resampling of
timm's ViTs) and MAE's ``interpolate_pos_embed`` (facebookresearch/mae ``util/pos_embed.py``,
reproduced from its documented behaviour: the patch rows read as an (h, w) grid in row-major
order, resized bicubically with align_corners=False). A table read with H and W swapped,
or an axis flipped, changes the ramps by whole patches and fails here; shapes and a
constant table could not tell.

A ramp is exact under linear interpolation: after resampling, a channel that held the row
index holds, at each new row, the source row it was read from
((i + 0.5) * h / H - 0.5, clamped to the grid, as align_corners=False places it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed

from octfw.models.published.adapt import inflate_kernel, resample_positions
from octfw.models.published.retfound import inflated_table
from octfw.plugins.models.mae3d import MAE3DConfig
from octfw.plugins.models.mae3d import build as build_mae
from octfw.types import BuildContext

REPO = Path(__file__).resolve().parents[1]
MAE_ST = REPO / "tests" / "fixtures" / "reference" / "mae_st" / "checkpoint.pt"
#: octfw's bilinear / trilinear resampling against timm's bilinear one: the same arithmetic (measured 0.0).
EXACT = 1e-5
#: octfw's bilinear against MAE's bicubic on a ramp, in patches: the two kernels agree on a
#: line away from the border and differ near it by under a tenth of a patch (measured 0.098
#: for 14 x 14 -> 24 x 20); a swapped or flipped axis is whole patches off.
BICUBIC = 0.15


def source_coordinate(new: int, old: int) -> torch.Tensor:
    """Where each of ``new`` cells reads the old axis of ``old`` cells (align_corners=False)."""
    return ((torch.arange(new, dtype=torch.float32) + 0.5) * old / new - 0.5).clamp(0, old - 1)


def ramp_table(grid: tuple[int, ...], extra: int = 3, seed: int = 0) -> torch.Tensor:
    """A ``[1, prod(grid), len(grid) + extra]`` table in row-major ``grid`` order: channel k holds
    the index along axis k, the last ``extra`` channels random (content with no symmetry)."""
    axes = torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij")
    noise = torch.randn(extra, *grid, generator=torch.Generator().manual_seed(seed))
    return torch.stack([*axes, *noise], dim=-1).reshape(1, -1, len(grid) + extra)


def ramp_expected(old: tuple[int, ...], new: tuple[int, ...]) -> torch.Tensor:
    """The ramp channels of :func:`ramp_table` (``old``) after linear resampling to ``new``."""
    coords = [source_coordinate(n, o) for n, o in zip(new, old)]
    return torch.stack(torch.meshgrid(*coords, indexing="ij"), dim=-1).reshape(1, -1, len(new))


def mae_interpolate(table: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    """MAE's ``interpolate_pos_embed`` on a table without extra tokens: rows read as an (h, w)
    grid, channels first, bicubic with align_corners=False, flattened back row-major
    (MAE squares both grids; the same steps take any (h, w))."""
    grid = table.reshape(1, *old, -1).permute(0, 3, 1, 2)
    out = F.interpolate(grid, size=new, mode="bicubic", align_corners=False)
    return out.permute(0, 2, 3, 1).reshape(1, new[0] * new[1], -1)


def timm_bilinear(table: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    return resample_abs_pos_embed(table, list(new), list(old), num_prefix_tokens=0, interpolation="bilinear",
                                  antialias=False)


# --- position tables -----------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new", [((6, 9), (10, 4)), ((14, 14), (24, 20)), ((14, 14), (8, 8)),
                                      ((4, 7), (4, 7 * 3))])
def test_an_in_plane_table_is_resampled_as_timm_resamples_it_rows_as_rows(old, new):
    table = ramp_table(old)
    ours, how = resample_positions(table, (1, *old), (1, *new))
    assert how == f"position table of grid {[1, *old]} resampled to {[1, *new]} (trilinear)"
    assert (ours - timm_bilinear(table, old, new)).abs().max() < EXACT
    assert (ours[..., :2] - ramp_expected(old, new)).abs().max() < EXACT
    # timm's default (bicubic, antialiased) and MAE's bicubic agree on the orientation.
    assert (ours[..., :2] - mae_interpolate(table, old, new)[..., :2]).abs().max() < BICUBIC
    timm_default = resample_abs_pos_embed(table, list(new), list(old), num_prefix_tokens=0)
    assert (ours[..., :2] - timm_default[..., :2]).abs().max() < BICUBIC


@pytest.mark.parametrize("old, new", [((2, 3, 5), (5, 4, 7)), ((8, 4, 4), (4, 6, 3)), ((1, 6, 4), (3, 6, 4))])
def test_a_3d_table_keeps_depth_rows_and_columns_apart(old, new):
    """Trilinear is separable: each source slice resized in-plane as timm resizes it, then each
    in-plane position resampled linearly over depth, is the same table."""
    table = ramp_table(old)
    ours, _ = resample_positions(table, old, new)
    assert ours.shape == (1, new[0] * new[1] * new[2], table.shape[-1])
    assert (ours[..., :3] - ramp_expected(old, new)).abs().max() < EXACT
    planes = torch.cat([timm_bilinear(table.reshape(old[0], -1, table.shape[-1])[d:d + 1], old[1:], new[1:])
                        for d in range(old[0])])  # [d, H*W, E]
    over_depth = F.interpolate(planes.permute(1, 2, 0), size=new[0], mode="linear", align_corners=False)
    expected = over_depth.permute(2, 0, 1).reshape(1, -1, table.shape[-1])
    assert (ours - expected).abs().max() < EXACT


@pytest.mark.parametrize("side, grid", [(4, (3, 6, 10)), (14, (16, 24, 24)), (6, (1, 6, 6))])
def test_a_2d_table_becomes_3d_resized_in_plane_as_timm_and_mae_and_repeated_over_depth(side, grid):
    """RETFound's (MAE's, timm's) table to the recipe's grid: every slice of the grid gets the 2D
    table resized to its in-plane grid, rows as rows."""
    table = ramp_table((side, side))
    ours, _ = inflated_table(table, grid)
    slices = ours.reshape(grid[0], grid[1] * grid[2], -1)
    expected = timm_bilinear(table, (side, side), grid[1:])[0]
    for depth in range(grid[0]):
        assert (slices[depth] - expected).abs().max() < EXACT
        assert (slices[depth, :, :2] - mae_interpolate(table, (side, side), grid[1:])[0, :, :2]).abs().max() < BICUBIC
    assert (slices[0, :, :2] - ramp_expected((side, side), grid[1:])[0]).abs().max() < EXACT


def test_mae_sts_spatial_and_temporal_tables_resample_each_along_its_own_axes(tmp_path):
    """MAE-ST's separable positions (a spatial g x g table and a 1-D temporal one, summed as the
    reference sums them) reach a recipe's grid as the spatial table resized in-plane (timm)
    plus the temporal one resampled over depth: slice t, row i, column j holds
    spatial(i, j) + temporal(t)."""
    state = torch.load(MAE_ST, weights_only=True)
    spatial = ramp_table((3, 3), extra=14, seed=1)  # channels: row, column, then 14 random
    spatial[..., 2] = 0.0  # channel 2 is the temporal table's
    temporal = torch.zeros(1, 4, 16)
    temporal[0, :, 2] = 10 * torch.arange(4.0)  # channel 2: the clip's time index, apart from the rows
    temporal[0, :, 3:] = torch.randn(4, 13, generator=torch.Generator().manual_seed(2))
    state["model_state"]["pos_embed_spatial"], state["model_state"]["pos_embed_temporal"] = spatial, temporal
    torch.save(state, tmp_path / "ramps.pth")
    image, patch = (12, 20, 8), (2, 4, 4)  # grid (6, 5, 2): every axis resampled, in-plane not square
    config = MAE3DConfig(preset="tiny", patch_size=patch, init=str(tmp_path / "ramps.pth"), embed_dim=16, depth=2,
                         num_heads=2, mlp_ratio=4.0, position="learned", norm_eps=1e-6, standardise_input=False)
    ctx = BuildContext(recipe_dir=REPO, cache_dir=Path("."), run_dir=None, seed=0, image_size=image, in_channels=3,
                       mask_pairs=("a",))
    ours = build_mae(config, ctx).encoder.pos_embed.detach()
    grid = (6, 5, 2)
    plane = timm_bilinear(spatial, (3, 3), grid[1:])  # [1, 10, 16]
    time = F.interpolate(temporal.transpose(1, 2), size=grid[0], mode="linear", align_corners=False).transpose(1, 2)
    expected = plane.repeat(1, grid[0], 1) + time.repeat_interleave(grid[1] * grid[2], dim=1)
    assert (ours - expected).abs().max() < EXACT
    by_axis = ours.reshape(*grid, 16)
    rows, columns = ramp_expected((3, 3), grid[1:]).reshape(*grid[1:], 2).unbind(-1)
    assert (by_axis[..., 0] - rows).abs().max() < EXACT and (by_axis[..., 1] - columns).abs().max() < EXACT
    assert (by_axis[..., 2] - 10 * source_coordinate(grid[0], 4)[:, None, None]).abs().max() < 1e-4


# --- patch kernels ----------------------------------------------------------------------------------------


def ramp_kernel(size: tuple[int, ...]) -> torch.Tensor:
    """A ``[4, 1, *size]`` kernel: filter k holds the index along axis k of ``size``, the last random."""
    table = ramp_table(size, extra=4 - len(size))
    return table.reshape(*size, 4).permute(-1, *range(len(size)))[:, None].contiguous()


@pytest.mark.parametrize("old, patch", [((16, 16), (4, 8, 12)), ((4, 4), (2, 16, 8)), ((14, 10), (1, 7, 20))])
def test_a_2d_kernel_is_resized_in_plane_as_timm_resizes_a_grid_rows_as_rows(old, patch):
    kernel = ramp_kernel(old)  # [4, 1, h, w]: filters row and column ramps, two random
    inflated, how = inflate_kernel(kernel, patch)
    assert inflated.shape == (4, 1, *patch) and f"resized in-plane to {list(patch[1:])}" in how
    # Divided over the slices and rescaled by source / target voxels: the kernel's sum is kept.
    scale = (old[0] * old[1]) / (patch[1] * patch[2]) / patch[0]
    as_table = kernel.reshape(4, -1).T[None]  # the kernel as a [1, h*w, filters] grid
    plane = timm_bilinear(as_table, old, patch[1:])[0].T.reshape(4, 1, *patch[1:]) * scale
    for depth in range(patch[0]):
        assert (inflated[:, :, depth] - plane).abs().max() < EXACT
    ramps = ramp_expected(old, patch[1:])[0].T.reshape(2, *patch[1:]) * scale
    assert (inflated[:2, 0, 0] - ramps).abs().max() < EXACT


@pytest.mark.parametrize("old, patch", [((2, 16, 16), (4, 8, 12)), ((2, 4, 6), (3, 8, 4))])
def test_a_tubelet_is_resampled_over_time_rows_and_columns_each_on_its_own_axis(old, patch):
    kernel = ramp_kernel(old)  # filters: time, row, column ramps and one random
    inflated, how = inflate_kernel(kernel, patch)
    assert f"kernel {list(old)} resampled to {list(patch)} (trilinear)" in how
    scale = (old[0] * old[1] * old[2]) / (patch[0] * patch[1] * patch[2])
    ramps = ramp_expected(old, patch)[0].T.reshape(3, *patch) * scale
    assert (inflated[:3, 0] - ramps).abs().max() < EXACT
    frames = torch.stack([timm_bilinear(kernel[:, 0, t].reshape(4, -1).T[None], old[1:], patch[1:])[0]
                          for t in range(old[0])], dim=-1)  # [ph*pw, filters, t]
    over_time = F.interpolate(frames, size=patch[0], mode="linear", align_corners=False)  # [ph*pw, filters, pd]
    expected = over_time.permute(1, 2, 0).reshape(4, patch[0], *patch[1:]) * scale
    assert (inflated[:, 0] - expected).abs().max() < EXACT
