"""Memory estimate against the measured peak of the engine's update step, on the CPU.

Measured peak = the bytes of every tensor alive before the step (parameters,
EMA, buffers, AdamW moments, the batch: counted exactly) + how far the
process's peak resident size rose during the step (activations, gradients and
every transient buffer: measured by the kernel, see
``octfw.diagnostics.device_memory.peak_rss_growth``). Each configuration runs in a fresh
process started with ``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors
leave the resident set at once. ``tests/test_memory.py`` asserts the 20 % bound
on the same measurement.

    python benchmarks/accelerators/memory_estimate.py                      # the table, JSON in results/
    python benchmarks/accelerators/memory_estimate.py --one small 32,192,192 1 1   # one configuration
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (preset, image size D,H,W, per-device batch, activation checkpointing)
CONFIGS = [
    ("tiny", "32,128,128", 4, False),
    ("tiny", "64,192,192", 2, False),
    ("tiny", "64,192,192", 2, True),
    ("small", "32,128,128", 2, False),
    ("small", "32,192,192", 1, False),
    ("small", "32,192,192", 1, True),
]


def measure_one(preset: str, size: str, batch: int, checkpointing: bool) -> dict:
    """In this process: build the real Trainer, run a warm-up update, measure the next."""
    import torch

    from octfw.diagnostics.device_memory import peak_rss_growth
    from octfw.diagnostics.memory import estimate_memory
    from octfw.engine.trainer import Trainer
    from octfw.engine.plan import plan_for_folder
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    registry = load_registry()
    recipe = load_recipe(ROOT / "recipes" / "quickstart.toml", [
        f"run.output_dir={json.dumps(tempfile.mkdtemp(prefix='octfw-memory-'))}", 'logger=[{name="jsonl"}]',
        "dataset.n_volumes=6", f"model.preset={json.dumps(preset)}", f"transform.image_size=[{size}]",
        f"model.activation_checkpointing={str(checkpointing).lower()}",
        f"engine.per_device_batch={batch}", "engine.grad_accum_steps=1"], registry)
    trainer = Trainer(plan_for_folder(recipe, registry, create_run_dir(recipe, registry)), registry)
    first = next(trainer.batches)
    trainer.batches = iter([first] * 3)  # no loader work inside the measured step
    trainer.update(0)  # AdamW's moments come to life on the first update
    tensors = first["tensors"]
    estimate = estimate_memory(trainer.model, tensors, device="cpu")

    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    moments = (t for state in trainer.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)
    resident = (nbytes(trainer.model.parameters()) + nbytes(trainer.model.buffers()) + nbytes(moments)
                + nbytes(tensors.values()))
    growth = peak_rss_growth(lambda: trainer.update(1))
    return {"preset": preset, "image_size": [int(s) for s in size.split(",")], "batch": batch,
            "checkpointing": checkpointing, "estimate": estimate.total, "parts": estimate.parts,
            "resident": resident, "growth": growth, "measured": resident + growth,
            "ratio": estimate.total / (resident + growth)}


def measure_in_fresh_process(preset: str, size: str, batch: int, checkpointing: bool) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, __file__, "--one", preset, size, str(batch), str(int(checkpointing))],
                          capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{preset} {size} batch {batch}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        preset, size, batch, checkpointing = sys.argv[2:6]
        print(json.dumps(measure_one(preset, size, int(batch), checkpointing == "1")))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py
    from _common import machine, write_result

    rows = [measure_in_fresh_process(*config) for config in CONFIGS]
    print("| preset | image size | batch | checkpointing | estimate MiB | measured MiB | estimate / measured |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['preset']} | {r['image_size']} | {r['batch']} | {'on' if r['checkpointing'] else 'off'} "
              f"| {r['estimate'] / 2**20:.0f} | {r['measured'] / 2**20:.0f} | {r['ratio']:.3f} |")
    print("written", write_result("memory_estimate", {"machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
