"""Data throughput of the quickstart: raw decode, cold and cached epochs, data wait.

Measured side by side in one process, with the engine's own pieces (the
recipe's dataset and transform, ``SampleSource``, ``make_loader``):

- raw decode: volumes per second of ``dataset.load`` alone (DICOM read + decode);
- first epoch: volumes per second through ``SampleSource`` with an empty
  prepared-volume cache (decode + resample + normalise + fit + views + mask);
- cached epochs: the same with the cache warm (views + mask only);
- data wait: the share of training-step time spent in ``next(loader)``
  rather than in forward, backward and the optimizer step, with the cache
  cold (first epoch) and warm (later epochs), in the recipe's own loader
  configuration (batch size, workers).

Prints one line per figure and writes ``benchmarks/results/data_throughput.json``.

    PJRT_DEVICE=CPU python benchmarks/data_path/data_throughput.py [--recipe recipes/quickstart.toml]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from octfw.engine.build import build_components
from octfw.engine.data import SampleSource, make_loader
from octfw.display.errors import CorruptFile
from octfw.recipe import load_recipe
from octfw.registry import load_registry

ROOT = Path(__file__).resolve().parents[2]


def raw_decode(dataset) -> float:
    started, decoded = time.perf_counter(), 0
    for index in range(len(dataset)):
        try:
            dataset.load(index)
            decoded += 1
        except CorruptFile:
            pass
    return decoded / (time.perf_counter() - started)


def epoch_rate(source: SampleSource, epoch: int) -> float:
    started = time.perf_counter()
    for index in range(len(source)):
        source[(epoch, index)]
    return len(source) / (time.perf_counter() - started)


def data_wait_share(parts, recipe, source: SampleSource, start: int, steps: int) -> dict[str, float]:
    """Time ``next(loader)`` against the model step over ``steps`` training steps."""
    engine = recipe.engine
    loader = make_loader(source, engine.per_device_batch, recipe.run.seed, start, engine.num_workers,
                         domain_sampling=engine.domain_sampling)
    model = parts.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=engine.base_lr)
    batches = iter(loader)
    wait = compute = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        out = model(batch["tensors"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if hasattr(model, "ema_update"):
            model.ema_update(torch.tensor(0.996))
        t2 = time.perf_counter()
        wait, compute = wait + (t1 - t0), compute + (t2 - t1)
    return {"data_wait_s": wait, "step_s": wait + compute, "share": wait / (wait + compute)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.toml"))
    parser.add_argument("--cached-epochs", type=int, default=2)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "data_throughput.json"))
    args = parser.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="octfw-bench-") as scratch:
        # A fresh cache: the cohort is written there and every volume starts unprepared.
        registry = load_registry()
        recipe = load_recipe(args.recipe, [f"run.cache_dir={scratch}"], registry)
        parts = build_components(recipe, registry, run_dir=None, with_loggers=False)
        dataset, transform = parts.dataset, parts.transform
        n = len(dataset)
        steps_per_epoch = n // recipe.engine.per_device_batch

        results: dict[str, object] = {
            "recipe": str(Path(args.recipe).resolve().relative_to(ROOT)) if args.recipe.startswith(str(ROOT)) else args.recipe,
            "volumes": n,
            "image_size": list(transform.image_size),
            "per_device_batch": recipe.engine.per_device_batch,
            "num_workers": recipe.engine.num_workers,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        }
        results["raw_decode_volumes_per_s"] = raw_decode(dataset)

        # Data wait with a cold cache: the first epoch of a run, through the loader.
        cold = SampleSource(dataset, transform, recipe.run.seed)
        results["data_wait_cold"] = data_wait_share(parts, recipe, cold, 0, steps_per_epoch)
        # Clear and refill to time the cold epoch alone, outside the training loop.
        import shutil

        shutil.rmtree(transform.cache.folder, ignore_errors=True)
        results["first_epoch_volumes_per_s"] = epoch_rate(SampleSource(dataset, transform, recipe.run.seed), 0)
        warm = SampleSource(dataset, transform, recipe.run.seed)
        cached = [epoch_rate(warm, e) for e in range(1, 1 + args.cached_epochs)]
        results["cached_epoch_volumes_per_s"] = float(np.mean(cached))
        results["data_wait_cached"] = data_wait_share(parts, recipe, warm, n, steps_per_epoch)

    lines = [
        f"raw decode        {results['raw_decode_volumes_per_s']:8.1f} volumes/s",
        f"first epoch       {results['first_epoch_volumes_per_s']:8.1f} volumes/s (cold cache)",
        f"cached epochs     {results['cached_epoch_volumes_per_s']:8.1f} volumes/s "
        f"({results['cached_epoch_volumes_per_s'] / results['first_epoch_volumes_per_s']:.1f}x first epoch)",
        f"data wait, cold   {100 * results['data_wait_cold']['share']:8.1f} % of step time",
        f"data wait, cached {100 * results['data_wait_cached']['share']:8.1f} % of step time "
        f"({'under' if results['data_wait_cached']['share'] < 0.05 else 'NOT under'} the 5% target)",
    ]
    print("\n".join(lines))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"written {output}")


if __name__ == "__main__":
    main()
