"""Record the statistics of V-JEPA's 3D multi-block masks over many draws.

Runs facebookresearch/vjepa2's own ``src.masks.multiseq_multiblock3d._MaskGenerator``
(the commit in ``_reference.REFERENCES``) with the two mask configurations of
its pretraining configs (configs/train/vitl16/pretrain-256px-16f.yaml: 8
short-range blocks of spatial scale 0.15 and 2 long-range blocks of 0.7, aspect
ratio 0.75-1.5, temporal scale 1.0, max_temporal_keep 1.0), on the reference's
3D grid (16 frames, tubelet 2, 256 px, patch 16: 8 x 16 x 16) and on octfw's
recipes' grids, read as (frames / tubelet, height, width) = octfw's (D, H, W).

For each grid and configuration it records, from draws of batch size 1 (one
sample: the reference's per-sample masks before its batch truncation):

- ``blocks``: the blocks per draw (``npred``);
- ``block_shapes``: every (t, h, w) block size the reference drew, with counts
  (read by calling its ``_sample_block_size`` with the seed the draw is about
  to use), their h / w range (``aspect_observed``) and their area as a share of the
  H x W plane (``scale_observed``);
- ``target_fraction`` and ``context_fraction``: mean and sd over the draws.

And, at the published batch size (24), the fractions the collator keeps
after cutting every sample's indices to the batch's smallest count
(``collated``): what the reference's model actually sees.

Usage::

    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/mask_statistics.py --vjepa2 /tmp/ref/vjepa2
"""

from __future__ import annotations

import argparse
import collections
import math
from pathlib import Path

import yaml

from _reference import checkout, write_fixture

#: name -> (D, H, W) patch grid: the reference's 3D setting, then octfw's recipes'.
GRIDS = {
    "vjepa2-16f-256px": (8, 16, 16),  # 16 frames / tubelet 2, 256 / 16, 256 / 16
    "quickstart": (4, 4, 4),          # recipes/quickstart.toml, pretrain_cpu.toml: [16, 64, 64] / [4, 16, 16]
    "smoke_test": (4, 8, 8),          # recipes/smoke_test.toml: [16, 128, 128] / [4, 16, 16]
    "multi_domain": (16, 24, 24),     # recipes/multi_domain.toml, the seeds': [64, 384, 384] / [4, 16, 16]
}
DRAWS = 4000
BATCHES = 200
SPATIAL_PATCH, TUBELET = 16, 2


def generator_for(grid, mask_cfg):
    from src.masks.multiseq_multiblock3d import _MaskGenerator

    d, h, w = grid
    return _MaskGenerator(
        crop_size=(h * SPATIAL_PATCH, w * SPATIAL_PATCH), num_frames=d * TUBELET,
        spatial_patch_size=(SPATIAL_PATCH, SPATIAL_PATCH), temporal_patch_size=TUBELET,
        spatial_pred_mask_scale=mask_cfg["spatial_scale"], temporal_pred_mask_scale=mask_cfg["temporal_scale"],
        aspect_ratio=mask_cfg["aspect_ratio"], npred=mask_cfg["num_blocks"],
        max_context_frames_ratio=mask_cfg["max_temporal_keep"], max_keep=mask_cfg["max_keep"],
        full_complement=mask_cfg["full_complement"],
    )


def mean_sd(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return {"n": n, "mean": mean, "sd": sd}


def record(grid, mask_cfg) -> dict:
    import torch

    total = grid[0] * grid[1] * grid[2]
    generator = generator_for(grid, mask_cfg)
    shapes: collections.Counter = collections.Counter()
    target, context = [], []
    for _ in range(DRAWS):
        # The size the next draw uses: the same seeded call the generator makes (no global RNG used).
        seed = generator._itr_counter.value + 1
        size = generator._sample_block_size(
            torch.Generator().manual_seed(seed), generator.temporal_pred_mask_scale,
            generator.spatial_pred_mask_scale, generator.aspect_ratio)
        shapes[size] += 1
        masks_enc, masks_pred = generator(1)
        target.append(masks_pred.numel() / total)
        context.append(masks_enc.numel() / total)
    collated_target, collated_context = [], []
    for _ in range(BATCHES):
        masks_enc, masks_pred = generator(24)
        collated_target.append(masks_pred.shape[1] / total)
        collated_context.append(masks_enc.shape[1] / total)
    ratios = [h / w for (_, h, w) in shapes]
    scales = [h * w / (grid[1] * grid[2]) for (_, h, w) in shapes]
    return {
        "blocks": mask_cfg["num_blocks"],
        "block_shapes": [{"t": t, "h": h, "w": w, "count": c} for (t, h, w), c in sorted(shapes.items())],
        "aspect_observed": [min(ratios), max(ratios)],
        "scale_observed": [min(scales), max(scales)],
        "target_fraction": mean_sd(target),
        "context_fraction": mean_sd(context),
        "collated": {"batch_size": 24, "target_fraction": mean_sd(collated_target),
                     "context_fraction": mean_sd(collated_context)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vjepa2", required=True, help="a checkout of facebookresearch/vjepa2")
    args = parser.parse_args()
    root = Path(args.vjepa2).resolve()
    reference = checkout("vjepa2", root)
    import torch

    torch.manual_seed(0)  # the block positions come from torch's global generator
    source = "configs/train/vitl16/pretrain-256px-16f.yaml"
    mask_cfgs = yaml.safe_load((root / source).read_text())["mask"]
    names = ("short", "long")  # the config's order: 8 blocks of 0.15, then 2 of 0.7
    grids = {}
    for grid_name, grid in GRIDS.items():
        grids[grid_name] = {"grid": list(grid),
                            "configurations": {n: record(grid, c) for n, c in zip(names, mask_cfgs)}}
    write_fixture("masks.json", {
        "what": "V-JEPA's multi-block 3D mask statistics (src/masks/multiseq_multiblock3d.py) per grid "
                "and configuration; regenerate with tools/parity/mask_statistics.py",
        "reference": reference,
        "source": source,
        "mask": dict(zip(names, mask_cfgs)),
        "draws": DRAWS,
        "grids": grids,
    })


if __name__ == "__main__":
    main()
