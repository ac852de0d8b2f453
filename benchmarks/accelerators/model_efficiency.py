"""Model efficiency: achieved FLOP/s of a training step over the matmul peak
measured on the same device in the same process.

- FLOPs: ``octfw.models.flops.training_flops_per_sample`` (forward incl. the
  EMA target encoder, plus backward; FlopCounterMode on meta tensors) times
  the samples of one update step.
- Step time: the real Trainer's update step, median over alternating blocks,
  fed from batches built once in memory (data loading excluded), fp32 on the
  CPU (bf16 autocast on cuda).
- Peak: the best of several large square matmuls (``--matmul-n``) at the
  step's dtype, timed right before and after the model.

Reported for the ``tiny`` and ``small`` presets. On a 2-core CPU ``small`` at
the seeds' full [64, 384, 384] (9,216 patches) takes minutes per step; the
default here is [32, 128, 128] (512 patches), ``--small-full`` uses the full size.
Prints one line per figure and writes ``benchmarks/results/model_efficiency.json``.

    PJRT_DEVICE=CPU python benchmarks/accelerators/model_efficiency.py [--device cpu|cuda] [--small-full]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, machine, make_trainer, median, octfw_step, write_result  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart.toml"


def matmul_peak(n: int, dtype: torch.dtype, device: str, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def training_step(preset: str, image_size: list[int], batch: int, device: str, steps: int) -> dict:
    from octfw.models.flops import training_flops_per_sample

    trainer, batches = make_trainer(RECIPE, [
        f"run.device={device}", f"model.preset={preset}", f"transform.image_size={image_size}",
        f"engine.per_device_batch={batch}", "engine.grad_accum_steps=1", "engine.log_every_steps=1000000",
        "dataset.n_volumes=8"], n_batches=2)
    flops = training_flops_per_sample(trainer.model, batches[0]) * batch
    sync = trainer.backend.synchronize
    octfw_step(trainer, 0, False)  # warm-up: optimizer state, allocator
    times = []
    for step in range(1, steps + 1):
        sync()
        started = time.perf_counter()
        octfw_step(trainer, step, False)
        sync()
        times.append(time.perf_counter() - started)
    step_s = median(times)
    grid = [s // p for s, p in zip(image_size, trainer.recipe.model.config.patch_size)]
    return {"preset": preset, "image_size": image_size, "patches": grid[0] * grid[1] * grid[2], "batch": batch,
            "parameters": trainer.model.count_parameters(), "flops_per_step": flops, "step_s": step_s,
            "step_times_s": times, "achieved_flops": flops / step_s, "precision": trainer.backend.precision}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--small-full", action="store_true", help="small at [64, 384, 384] (slow on a CPU)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--matmul-n", type=int, default=2048)
    args = parser.parse_args()
    small_size = [64, 384, 384] if args.small_full else [32, 128, 128]
    cases = [("tiny", [16, 64, 64], 4), ("small", small_size, 1)]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    peaks = [matmul_peak(args.matmul_n, dtype, args.device)]
    results = []
    for preset, size, batch in cases:
        results.append(training_step(preset, size, batch, args.device, args.steps))
        peaks.append(matmul_peak(args.matmul_n, dtype, args.device))
    peak = max(peaks)
    print(f"matmul peak [{args.device}, {str(dtype).replace('torch.', '')}, n={args.matmul_n}]: "
          f"{peak / 1e9:.1f} GFLOP/s (best of {len(peaks)} measurements around the model steps)")
    for r in results:
        r["fraction_of_peak"] = r["achieved_flops"] / peak
        print(f"model efficiency [{r['preset']}, {r['image_size']}, {r['patches']} patches, batch {r['batch']}]: "
              f"{r['flops_per_step'] / 1e9:.2f} GFLOP per step in {r['step_s'] * 1e3:.0f} ms = "
              f"{r['achieved_flops'] / 1e9:.1f} GFLOP/s, {r['fraction_of_peak']:.1%} of the measured matmul peak")
    path = write_result("model_efficiency", {"machine": machine(), "device": args.device, "dtype": str(dtype),
                                             "matmul_peak_flops": peak, "matmul_peaks": peaks,
                                             "small_reduced": not args.small_full, "results": results})
    print(f"written {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
