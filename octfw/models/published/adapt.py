"""The adaptations every converter shares: a checkpoint's patch kernel and position table
made to fit the recipe's 3D ViT, and the check that its blocks fit at all.

Each function returns the adapted tensor and a short description of what it did (None when
the tensor fits as it is), which goes into the :class:`~octfw.models.published.InitReport`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from octfw.display.errors import UserError

__all__ = ["adapt_channels", "fold_normalisation", "inflate_kernel", "resample_positions", "encoder_shape", "refuse_misfit",
           "load_into"]


def adapt_channels(weight: torch.Tensor, in_channels: int) -> tuple[torch.Tensor, str | None]:
    """A patch kernel ``[E, C, ...]`` for ``in_channels`` input channels.

    RGB (3) to one channel: the sum of the three channel kernels. A grey volume shown to the
    RGB network is the same intensity in the three channels, and a convolution of three
    equal channels is the convolution of one with the summed kernel: the one-channel network
    gives exactly the RGB network's tokens for the grey volume repeated three times
    (tests/test_published_weights.py checks it). The published per-channel colour
    normalisation is folded in before, where ``init_channels`` asks for it
    (:func:`fold_normalisation`, :mod:`octfw.models.published.inputs`). One channel to C: the
    kernel repeated and divided by C (the same identity read the other way)."""
    source = weight.shape[1]
    if source == in_channels:
        return weight, None
    if in_channels == 1:
        return weight.sum(dim=1, keepdim=True), f"{source} input channels summed into 1 (a grey volume as RGB)"
    if source == 1:
        return (weight.repeat(1, in_channels, *[1] * (weight.ndim - 2)) / in_channels,
                f"1 input channel spread over {in_channels}, divided by {in_channels}")
    raise UserError(f"model.init: the checkpoint's patch projection takes {source} input channels and the recipe's "
                    f"data has {in_channels}: only 3 -> 1 and 1 -> C are adapted")


def fold_normalisation(weight: torch.Tensor, bias: torch.Tensor, mean: tuple[float, ...],
                       std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A patch projection (kernel ``[E, C, ...]``, bias ``[E]``) that gives on raw intensities
    what the original gives on ``(x - mean_c) / std_c``: the projection is linear and its patches
    do not overlap, so ``W_c`` becomes ``W_c / std_c`` and ``b`` becomes
    ``b - sum_c (mean_c / std_c) * sum(W_c)`` (computed in float64, returned in the input's dtype)."""
    shape = (1, len(std)) + (1,) * (weight.ndim - 2)
    inv_std = 1.0 / torch.tensor(std, dtype=torch.float64)
    kernel = weight.double()
    shift = (kernel.sum(dim=tuple(range(2, weight.ndim))) * (torch.tensor(mean, dtype=torch.float64) * inv_std)).sum(1)
    return (kernel * inv_std.view(shape)).to(weight.dtype), (bias.double() - shift).to(bias.dtype)


def inflate_kernel(weight: torch.Tensor, patch_size: tuple[int, int, int]) -> tuple[torch.Tensor, str | None]:
    """A patch kernel ``[E, C, t, p, p]`` (or a 2D one ``[E, C, p, p]``) reshaped to the
    recipe's 3D patch ``(pd, ph, pw)``.

    I3D-style inflation: a 2D kernel (or a 1-deep tubelet) is repeated over the ``pd``
    slices and divided by ``pd``; a deeper tubelet (V-JEPA 2's 2 frames) is resampled over
    depth. Where the in-plane patch differs, the kernel is resized bilinearly in-plane. After
    any resampling the kernel is rescaled by source voxels / target voxels, so that a volume
    constant over the patch gives the same response as before (the sum of the kernel is kept)."""
    if weight.ndim == 4:
        weight = weight[:, :, None]
    source = tuple(weight.shape[2:])
    target = tuple(patch_size)
    if source == target:
        return weight, None
    if source[0] == 1:
        inflated = weight.repeat(1, 1, target[0], 1, 1) / target[0]
        how = f"kernel {list(source)} repeated over {target[0]} slices and divided by {target[0]} (I3D)"
        if source[1:] != target[1:]:
            inflated = _resample(inflated, target)
            how += f", resized in-plane to {list(target[1:])}"
        return inflated, how
    inflated = _resample(weight, target)
    return inflated, f"kernel {list(source)} resampled to {list(target)} (trilinear) and rescaled to keep its sum"


def _resample(weight: torch.Tensor, target: tuple[int, int, int]) -> torch.Tensor:
    source = weight.shape[2:]
    out = F.interpolate(weight.float(), size=target, mode="trilinear", align_corners=False)
    return (out * (math.prod(source) / math.prod(target))).to(weight.dtype)


def resample_positions(table: torch.Tensor, source_grid: tuple[int, int, int],
                       target_grid: tuple[int, int, int]) -> tuple[torch.Tensor, str | None]:
    """A position table ``[1, N, E]`` in row-major ``source_grid`` order resampled to
    ``target_grid`` (trilinear over depth, height and width), ``[1, N', E]``."""
    source_grid, target_grid = tuple(source_grid), tuple(target_grid)
    if source_grid == target_grid:
        return table, None
    width = table.shape[-1]
    grid = table.reshape(1, *source_grid, width).permute(0, 4, 1, 2, 3).float()
    out = F.interpolate(grid, size=target_grid, mode="trilinear", align_corners=False)
    out = out.permute(0, 2, 3, 4, 1).reshape(1, -1, width).to(table.dtype)
    return out, f"position table of grid {list(source_grid)} resampled to {list(target_grid)} (trilinear)"


_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def encoder_shape(state: Mapping[str, torch.Tensor], blocks: str = "blocks") -> dict[str, Any]:
    """Width, depth and MLP width of the ViT whose state dict (prefix stripped) is ``state``."""
    pattern = re.compile(rf"^{re.escape(blocks)}\.(\d+)\.")
    depth = 1 + max((int(m.group(1)) for key in state if (m := pattern.match(key))), default=-1)
    fc1 = state.get(f"{blocks}.0.mlp.fc1.weight")
    qkv = state.get(f"{blocks}.0.attn.qkv.weight")
    return {"width": None if qkv is None else qkv.shape[1], "depth": depth,
            "mlp": None if fc1 is None else fc1.shape[0]}


def refuse_misfit(what: str, source: Mapping[str, Any], width: int, depth: int, mlp: int, recipe: str) -> None:
    """UserError in one line when a checkpoint's network is not the recipe's: both named."""
    if (source["width"], source["depth"], source["mlp"]) == (width, depth, mlp):
        return
    raise UserError(f"model.init: {what} is {source['width']} wide, {source['depth']} blocks deep (MLP {source['mlp']}) but "
                    f"{recipe} is {width} wide, {depth} blocks deep (MLP {mlp}): choose the preset of the "
                    "checkpoint's size (large: ViT-L 1024/24, giant: ViT-g 1408/40) or set the sizes to match")


def load_into(module: torch.nn.Module, state: Mapping[str, torch.Tensor], name: str) -> None:
    """Copy ``state`` (a subset of the module's own keys, right shapes) into ``module``."""
    own = module.state_dict()
    for key, tensor in state.items():
        if key not in own:
            raise UserError(f"model.init: {name}'s {key!r} has no place in octfw's network")
        if tuple(own[key].shape) != tuple(tensor.shape):
            raise UserError(f"model.init: {name}'s {key!r} is {list(tensor.shape)} where octfw's network "
                            f"has {list(own[key].shape)}")
    with torch.no_grad():
        for key, tensor in state.items():
            own[key].copy_(tensor.to(own[key].dtype))
