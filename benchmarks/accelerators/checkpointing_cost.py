"""What activation checkpointing costs in step time: the engine's update step with
``model.activation_checkpointing`` off and on, side by side in one process.

Both sides are the real Trainer (fed from batches built once in memory, see
``_common.make_trainer``) on the same batches; they run in alternating blocks
of steps, so load from other work falls on both alike. Printed as the ratio
of median step times (on / off). The memory side is in
``benchmarks/accelerators/memory_estimate.py``.

    PJRT_DEVICE=CPU python benchmarks/accelerators/checkpointing_cost.py [--device cpu|cuda] [--rounds 6]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, alternate, machine, make_trainer, median, octfw_step, write_result  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart.toml"
#: (preset, image size, per-device batch): the sizes of benchmarks/accelerators/memory_estimate.py.
CASES = [("tiny", [64, 192, 192], 2), ("small", [32, 192, 192], 1)]


def trainer_for(preset: str, size: list[int], batch: int, device: str, checkpointing: bool):
    trainer, _ = make_trainer(RECIPE, [
        f"run.device={device}", f'model.preset="{preset}"', f"transform.image_size={size}",
        f"engine.per_device_batch={batch}", "engine.grad_accum_steps=1", "engine.log_every_steps=1000000",
        f"model.activation_checkpointing={str(checkpointing).lower()}", "dataset.n_volumes=8"], n_batches=2)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=3, help="update steps per timed block")
    args = parser.parse_args()
    results = []
    for preset, size, batch in CASES:
        trainers = {side: trainer_for(preset, size, batch, args.device, side == "on") for side in ("off", "on")}
        sides = {side: functools.partial(octfw_step, trainer) for side, trainer in trainers.items()}
        times = alternate(sides, rounds=args.rounds, block=args.block, log_every=10**9,
                          sync=trainers["off"].backend.synchronize)
        off, on = median(times["off"]), median(times["on"])
        results.append({"preset": preset, "image_size": size, "batch": batch, "step_s_off": off, "step_s_on": on,
                        "ratio": on / off, "times": times})
        print(f"activation checkpointing [{preset}, {size}, batch {batch}, {args.device}]: "
              f"{off * 1e3:.0f} ms -> {on * 1e3:.0f} ms per update step, {on / off:.3f}x", flush=True)
    path = write_result(f"checkpointing_cost_{args.device}", {"machine": machine(), "device": args.device,
                                                              "rounds": args.rounds, "block": args.block,
                                                              "results": results})
    print(f"written {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
