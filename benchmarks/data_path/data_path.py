"""The data path side by side: octfw against the MONAI pipeline a user would write, and the machine's limit.

On device-size multi-vendor DICOM files written by ``synthetic-oct``
(``sizes = "device"``: Spectralis 49 x 496 x 512, Maestro 128 x 885 x 512,
Cirrus 128 x 1024 x 512, 8-bit) and the seeds' transform
(``recipes/multi_domain.toml``: ``image_size`` [64, 384, 384],
``target_spacing`` [0.05, 0.02, 0.02] mm, anti-aliasing, percentiles 1-99),
measured in one run, one core each (torch on one thread):

**Preparation**, core-seconds per volume (the mean over the cohort):

- ``decode``: reading and decoding the DICOM alone (``read_oct_volume``): the limit;
- ``octfw``: decode + ``oct-standard``'s ``prepare`` (its separable resize);
- ``octfw_monai_resize``: the same preparation computed with MONAI's ``Resize``,
  as octfw did before (``tests/test_resize.py``'s oracle);
- ``monai``: the pipeline MONAI's tutorials write: ``LoadImage`` (pydicom
  reader), the volume's axes and spacing set from the DICOM (MONAI's reader
  does not know the OCT functional groups: every user adds this),
  ``Spacing`` to the target spacing, ``ScaleIntensityRangePercentiles``,
  ``Resize`` with anti-aliasing.

**Streaming**, samples/s per core with 0, 1 and 2 loader workers (batches of
4, two views each, octfw's also with its patch masks), and the peak resident
memory of a worker:

- ``octfw_prepared``: the ``prepared`` dataset (``octfw prepare``'s zarr
  store: read, SHA-256, zstd decode) + ``oct-standard``'s views and masks +
  collate, through octfw's ``SampleSource`` and ``collate``;
- ``monai_persistent``: MONAI's ``PersistentDataset`` over the pipeline above
  (its cache warmed first, then timed), two views drawn as ``oct-standard``
  draws them (``RandFlip`` and ``RandAffine`` with its probabilities and
  ranges: with the seeds' transform, none, so a copy), collated;
- ``limit``: reading the stored bytes and decompressing them, nothing else.

Per core: a run with W workers spends W cores on loading (the main process
waits), one with 0 workers one core. Writes ``benchmarks/results/data_path.json``
and the profile of octfw's stream (cProfile, the 25 costliest functions by
their own time) to ``benchmarks/results/data_path_profile.txt``.

    PJRT_DEVICE=CPU python benchmarks/data_path/data_path.py --volumes 6
    PJRT_DEVICE=CPU python benchmarks/data_path/data_path.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from _common import ROOT, machine, write_result  # noqa: E402

SEEDS_TRANSFORM = {"image_size": (64, 384, 384), "target_spacing": (0.05, 0.02, 0.02)}
WORKERS = (0, 1, 2)
BATCH = 4


def log(text: str) -> None:
    print(text, flush=True)


def per_volume(files: list[str], work: Callable[[str], Any]) -> float:
    """Mean seconds of ``work`` per file, after one untimed call (imports, caches of sizes)."""
    work(files[0])
    times = []
    for path in files:
        started = time.perf_counter()
        work(path)
        times.append(time.perf_counter() - started)
    return statistics.mean(times)


# --- the MONAI pipeline -------------------------------------------------------


def oct_geometry_transform(spacing_of: dict[str, tuple[float, float, float]]) -> Any:
    """A MONAI transform (deterministic, so PersistentDataset caches past it): MONAI's pydicom
    reader returns an OCT volume as [1, H, D, W] with spacing 1; this puts the B-scans first and
    the DICOM's spacing in the affine, as a user of MONAI must."""
    from monai.data import MetaTensor
    from monai.transforms import Transform

    class OCTGeometry(Transform):
        def __call__(self, image: Any) -> Any:
            spacing = spacing_of[str(image.meta["filename_or_obj"])]
            affine = torch.diag(torch.tensor([*spacing, 1.0], dtype=torch.float64))
            return MetaTensor(image.as_tensor().permute(0, 2, 1, 3).contiguous(), affine=affine)

    return OCTGeometry()


def monai_deterministic(config: Any, spacing_of: dict[str, tuple[float, float, float]]) -> Any:
    """LoadImage -> OCT geometry -> Spacing -> percentiles -> Resize, as a MONAI Compose on a path."""
    from monai.transforms import Compose, LoadImage, Resize, ScaleIntensityRangePercentiles, Spacing

    low, high = config.percentiles
    return Compose([
        LoadImage(reader="PydicomReader", ensure_channel_first=True, image_only=True),
        oct_geometry_transform(spacing_of),
        Spacing(pixdim=config.target_spacing, mode="bilinear"),
        ScaleIntensityRangePercentiles(lower=low, upper=high, b_min=0.0, b_max=1.0, clip=True),
        Resize(config.image_size, mode="trilinear", anti_aliasing=config.anti_aliasing),
    ])


def monai_views(config: Any) -> Callable[[Any], dict[str, torch.Tensor]]:
    """Two views of a prepared volume as oct-standard draws them (the seeds' transform: none of
    its augmentations on, so the context is a copy and the target the volume itself)."""
    import math

    from monai.transforms import Compose, RandAffine, RandFlip

    augment = Compose([
        RandFlip(prob=config.flip_prob, spatial_axis=2),
        RandAffine(prob=config.affine_prob, rotate_range=(math.radians(config.rotate_degrees), 0, 0),
                   scale_range=(0, config.scale_range, config.scale_range), mode="bilinear", padding_mode="zeros"),
    ])

    def views(volume: Any) -> dict[str, torch.Tensor]:
        volume = torch.as_tensor(volume)
        target = torch.as_tensor(augment(volume)) if config.augment_target else volume
        return {"context": torch.as_tensor(augment(volume)).clone(), "target": target}

    return views


class MonaiStream(torch.utils.data.Dataset):
    def __init__(self, persistent: Any, views: Callable[[Any], dict[str, torch.Tensor]]):
        self.persistent, self.views = persistent, views

    def __len__(self) -> int:
        return len(self.persistent)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.views(self.persistent[index])


# --- measuring ----------------------------------------------------------------


class PeakWorkerMemory:
    """The largest resident set of any child process (a loader worker), sampled every 20 ms."""

    def __init__(self) -> None:
        import psutil

        self.process, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for child in self.process.children(recursive=True):
                try:
                    self.peak = max(self.peak, child.memory_info().rss)
                except Exception:  # noqa: BLE001 - a worker that just exited
                    pass
            time.sleep(0.02)

    def __enter__(self) -> "PeakWorkerMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def loader_rate(dataset: Any, workers: int, samples: int, collate_fn: Any, sampler: Any = None) -> dict[str, Any]:
    """Samples/s through a DataLoader, its first batch (worker start) untimed."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=collate_fn,
                                         sampler=sampler, persistent_workers=workers > 0,
                                         worker_init_fn=lambda _: torch.set_num_threads(1))
    with PeakWorkerMemory() as memory:
        batches = iter(loader)
        next(batches)
        started, done = time.perf_counter(), 0
        while done < samples:
            try:
                next(batches)
            except StopIteration:
                batches = iter(loader)
                continue
            done += BATCH
        seconds = time.perf_counter() - started
    rate = done / seconds
    return {"workers": workers, "samples_per_s": round(rate, 2), "samples_per_s_per_core": round(rate / max(1, workers), 2),
            "peak_worker_rss_mb": round(memory.peak / 2**20) if workers else None}


class Forever(torch.utils.data.Sampler):
    """``(epoch, index)`` keys of octfw's SampleSource, epoch after epoch."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        epoch = 0
        while True:
            for index in range(self.size):
                yield (epoch, index)
            epoch += 1


def read_and_decompress(location: str, rows: Any, samples: int) -> float:
    """Samples/s of reading a stored volume's bytes and decompressing them, nothing else."""
    from octfw.plugins.datasets.prepared.store import ARRAY_METADATA, CHUNK, VOLUMES, decode_volume

    metadata = {}
    started = time.perf_counter()
    for i in range(samples):
        row = rows[i % len(rows)]
        folder = Path(location) / VOLUMES / row.key
        if row.dtype not in metadata:
            metadata[row.dtype] = (folder / ARRAY_METADATA).read_bytes()
        decode_volume(metadata[row.dtype], (folder / CHUNK).read_bytes())
    return samples / (time.perf_counter() - started)


def profile_stream(source: Any, collate_fn: Any, samples: int, name: str) -> str:
    """cProfile of ``samples`` samples of octfw's stream in this process (what a worker does),
    the 25 costliest functions by own time, kept beside the result as ``<name>.txt``."""
    import cProfile
    import io
    import pstats

    from _common import RESULTS

    def stream() -> None:
        items = []
        for i in range(samples):
            items.append(source[(2, i % len(source))])
            if len(items) == BATCH:
                collate_fn(items)
                items = []

    profiler = cProfile.Profile()
    profiler.runcall(stream)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    path = RESULTS / f"{name}.txt"
    path.write_text(text.getvalue().replace(str(ROOT) + "/", ""), encoding="utf-8")
    return str(path.relative_to(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volumes", type=int, default=6, help="device-size volumes (default 6: two per vendor)")
    parser.add_argument("--samples", type=int, default=48, help="samples timed per streaming figure")
    parser.add_argument("--work-dir", type=Path, help="where the cohort, store and caches go (default: temporary)")
    parser.add_argument("--smoke", action="store_true", help="small volumes and image: checks every path")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from octfw.dicom.decoding import read_oct_volume
    from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build as build_transform
    from octfw.plugins.datasets.prepared.dataset import PreparedDataset
    from octfw.plugins.datasets.synthetic.cohort import write_synthetic_cohort
    from octfw.engine.collate import collate
    from octfw.engine.data import SampleSource
    from octfw.types import BuildContext
    from test_resize import monai_prepare

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="data-path-"))
    work.mkdir(parents=True, exist_ok=True)
    image = (16, 64, 64) if args.smoke else SEEDS_TRANSFORM["image_size"]
    config = OCTStandardConfig(image_size=image, target_spacing=SEEDS_TRANSFORM["target_spacing"], cache=False)
    ctx = BuildContext(recipe_dir=work, cache_dir=work, run_dir=None, seed=0, image_size=image, patch_size=(4, 16, 16))
    transform = build_transform(config, ctx)
    files = [str(f) for f in write_synthetic_cohort(work / "cohort", args.volumes, seed=0,
                                                    sizes="small" if args.smoke else "device")]
    result: dict[str, Any] = {"machine": machine(), "smoke": args.smoke, "volumes": len(files),
                              "image_size": list(image), "target_spacing": list(config.target_spacing)}

    # --- preparation, one core -------------------------------------------------
    spacing_of = {path: read_oct_volume(path).provenance.spacing for path in files}
    pipeline = monai_deterministic(config, spacing_of)
    prep = {
        "decode": per_volume(files, read_oct_volume),
        "octfw": per_volume(files, lambda p: transform.prepare(read_oct_volume(p))),
        "octfw_monai_resize": per_volume(files, lambda p: monai_prepare(config, read_oct_volume(p))),
        "monai": per_volume(files, pipeline),
    }
    result["prepare_core_s_per_volume"] = {k: round(v, 3) for k, v in prep.items()}
    result["prepare_ratios"] = {
        "octfw_monai_resize / octfw": round(prep["octfw_monai_resize"] / prep["octfw"], 2),
        "monai / octfw": round(prep["monai"] / prep["octfw"], 2),
        "octfw / decode": round(prep["octfw"] / prep["decode"], 2),
    }
    log("preparation, core-seconds per volume: " + json.dumps(result["prepare_core_s_per_volume"]))
    log("                                ratios: " + json.dumps(result["prepare_ratios"]))

    # --- streaming ---------------------------------------------------------------
    from octfw.plugins.datasets.prepared.prepare import prepare_dataset
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    recipe = work / "prepare.toml"
    recipe.write_text(
        f'[run]\nmax_steps = 1\ndevice = "cpu"\n[dataset]\nname = "dicom"\npath = "{work / "cohort"}"\n'
        f'[transform]\nname = "oct-standard"\nimage_size = {list(image)}\n'
        f'target_spacing = {list(config.target_spacing)}\n[model]\nname = "vjepa3d"\npreset = "tiny"\n'
        f'patch_size = [4, 16, 16]\n[scheduler]\nname = "constant"\n')
    registry = load_registry()
    store = str(work / "prepared")
    prepare_dataset(load_recipe(recipe, (), registry), registry, store, workers=2, report=lambda _: None)
    dataset = PreparedDataset.open(store)
    source = SampleSource(dataset, transform, seed=0)

    from monai.data import PersistentDataset

    persistent = PersistentDataset(files, transform=pipeline, cache_dir=work / "monai-cache")
    for index in range(len(persistent)):  # warm MONAI's cache: every volume prepared once
        persistent[index]
    monai_stream = MonaiStream(persistent, monai_views(config))

    limit = read_and_decompress(store, dataset.rows, args.samples)
    result["limit_read_and_decompress_samples_per_s_per_core"] = round(limit, 2)
    log(f"limit: read and decompress {limit:.1f} samples/s per core")
    streaming: dict[str, list[dict[str, Any]]] = {"octfw_prepared": [], "monai_persistent": []}
    for workers in WORKERS:
        streaming["octfw_prepared"].append(loader_rate(source, workers, args.samples, collate, Forever(len(source))))
        streaming["monai_persistent"].append(loader_rate(monai_stream, workers, args.samples, None))
        for name in streaming:
            log(f"{name}, {workers} workers: " + json.dumps(streaming[name][-1]))
    result["streaming"] = streaming
    best = {name: max(r["samples_per_s_per_core"] for r in rows) for name, rows in streaming.items()}
    result["streaming_ratios"] = {
        "octfw_prepared / monai_persistent": round(best["octfw_prepared"] / best["monai_persistent"], 2),
        "limit / octfw_prepared": round(limit / best["octfw_prepared"], 2),
    }
    log("streaming ratios (best per core): " + json.dumps(result["streaming_ratios"]))
    result["profile"] = profile_stream(source, collate, args.samples, "data_path_profile_smoke" if args.smoke
                                       else "data_path_profile")
    log(f"profile of the in-process stream: {result['profile']}")
    path = write_result("data_path_smoke" if args.smoke else "data_path", result)
    log(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
