"""The largest per-device batch at the seeds' volume, for every preset, replicated and sharded.

For ``small``, ``base``, ``large``, ``giant`` and ``gigantic`` (V-JEPA3D, patch 4 x 16 x 16 over
[64, 384, 384]: 9,216 patches), ``engine.parallelism = "data"`` and ``"fsdp"``, on 8 x 80 GB GPUs
(cuda, bf16) and on a TPU v4-32 (16 chips of 32 GiB, xla, bf16, octfw's query-blocked
attention), with and without activation checkpointing: the largest per-device batch whose
estimate (``octfw.diagnostics.memory``, what ``octfw check`` prints) fills at most 85 % of a
device. The models are built on the meta device and the batch is shapes only: nothing is
computed, so the billion-parameter presets cost seconds. Estimates, not measurements: a
compiler's workspace and the allocator's fragmentation come on top (the estimate is within
20 % of the measured peak on the CPU; XLA:CPU planned about twice it for ``small``,
benchmarks/accelerators/README.md).

Usage: ``.venv/bin/python benchmarks/accelerators/sharded_fits.py``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py

from _common import ROOT, machine, write_result  # noqa: E402

PRESETS = ("small", "base", "large", "giant", "gigantic")
HARDWARE = {  # name: (device kind, GiB per device, devices)
    "8 x 80 GB GPU": ("cuda", 80, 8),
    "TPU v4-32": ("xla", 32, 16),
}


def shape_only_batch(transform) -> dict[str, torch.Tensor]:
    """One sample of what ``transform`` makes, as meta tensors (views as float32)."""
    return {key: torch.empty((1, *spec.shape), dtype=torch.float32 if spec.view else getattr(torch, spec.dtype),
                             device="meta")
            for key, spec in transform.batch_spec().items()}


def main() -> None:
    from octfw.diagnostics.memory import ADVISED_SHARE, GIB, largest_batch
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    registry = load_registry()
    rows = []
    for preset in PRESETS:
        recipe = load_recipe(ROOT / "recipes" / "multi_domain.toml",
                             [f"model.preset={preset}", "dataset.name=synthetic-oct"], registry)
        transform = recipe.transform.build(recipe.build_context(registry=registry))
        with torch.device("meta"):
            model = recipe.model.build(recipe.build_context(registry=registry, apply_init=False))
        batch = shape_only_batch(transform)
        for hardware, (kind, gib, devices) in HARDWARE.items():
            for parallelism, shards in (("data", 1), ("fsdp", devices)):
                fits = [largest_batch(model, batch, int(gib * GIB * ADVISED_SHARE), device=kind, precision="bf16",
                                      shards=shards, checkpointing=checkpointing, limit=256)
                        for checkpointing in (False, True)]
                rows.append({"preset": preset, "hardware": hardware, "parallelism": parallelism,
                             "without_checkpointing": fits[0], "with_checkpointing": fits[1]})
                print(f"{preset:>9} {hardware:>14} {parallelism:>5}: {fits[0]:>3} samples per device, "
                      f"{fits[1]:>3} with activation checkpointing", flush=True)
    write_result("sharded_fits", {"machine": machine(), "volume": [64, 384, 384], "patch": [4, 16, 16],
                                  "advised_share": ADVISED_SHARE, "rows": rows})


if __name__ == "__main__":
    main()
