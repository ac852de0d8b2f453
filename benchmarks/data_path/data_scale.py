"""Data at the seeds' scale: bytes, preparation and streaming rates, dataset build time.

On a cohort of device-size 8-bit volumes written by ``synthetic-oct``
(``sizes = "device"``: Spectralis 49 x 496 x 512, Maestro 128 x 885 x 512,
Cirrus 128 x 1024 x 512), prepared to the seeds' [64, 384, 384]
(``recipes/multi_domain.toml``'s ``image_size``, but not its
``target_spacing``: volumes are fitted to the size without first being
resampled to a spacing, so preparation here is cheaper than the seeds' real
job), measured side by side in one run:

- **bytes per volume**: the raw DICOM file; today's float32 cache entry of
  ``oct-standard``; the prepared volume (zarr, blosc zstd); and, as the
  measured alternative, the same voxels in ``np.savez_compressed`` (zlib),
  with encode and decode time of each;
- **preparation rate** per core: ``octfw prepare`` on a Dask local cluster of
  one worker per core, into a local folder and into the GCS emulator;
- **streaming rate** per core: samples per second of ``PreparedDataset.load``
  plus the transform's random half (views and masks) and collation into
  batches of 4, in one process on one thread, from local disk and from the
  GCS emulator (no local cache: every read is a GET);
- **dataset build time** at 1,000 / 10,000 / 100,000 index entries against
  today's header scan of a folder (measured on the cohort's folder, as a
  cost per file);
- from those, the CPU cores a TPU v4 host needs to feed its 4 chips at the
  seeds' 2-4 samples/s per chip and at 40 % MFU (model FLOPs of ``small`` at
  [64, 384, 384], TPU v4 peak 275 TFLOP/s bf16).

Disk: the 240-volume cohort takes 11 GB of DICOM and 1.9 GB prepared
(``--work-dir``, default a temporary folder that is not removed). Writes
``benchmarks/results/data_scale.json``; ``--smoke`` runs every path
on a few small volumes and writes ``data_scale_smoke.json``.

    PJRT_DEVICE=CPU python benchmarks/data_path/data_scale.py --volumes 240
    PJRT_DEVICE=CPU python benchmarks/data_path/data_scale.py --smoke
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from _common import ROOT, machine, write_result  # noqa: E402

SEEDS_IMAGE = [64, 384, 384]
TPU_V4_PEAK = 275e12
CHIPS_PER_HOST = 4
SEEDS_RATE = (2.0, 4.0)  # samples/s per chip in the seeds' notes
BUILD_SIZES = (1_000, 10_000, 100_000)

RECIPE = """
[run]
seed = 0
device = "cpu"
max_steps = 1

[engine]
per_device_batch = 4

[dataset]
name = "dicom"
path = "{path}"

[transform]
name = "oct-standard"
image_size = {image}

[model]
name = "vjepa3d"
preset = "small"
patch_size = [4, 16, 16]

[scheduler]
name = "cosine-no-restart"
"""


def log(text: str) -> None:
    print(text, flush=True)


def write_recipe(folder: Path, source: str, image: list[int]) -> Path:
    path = folder / f"prepare-{hashlib.sha256(source.encode()).hexdigest()[:8]}.toml"
    path.write_text(RECIPE.format(path=source, image=json.dumps(image)))
    return path


def prepare(recipe: Path, location: str, workers: int) -> dict[str, Any]:
    from octfw.plugins.datasets.prepared.prepare import prepare_dataset
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    registry = load_registry()
    summary = prepare_dataset(load_recipe(recipe, (), registry), registry, location, workers=workers,
                              report=lambda _: None)
    rate = summary.prepared / summary.seconds
    return {"volumes": summary.volumes, "seconds": round(summary.seconds, 1), "workers": workers,
            "volumes_per_s": round(rate, 3), "volumes_per_s_per_core": round(rate / workers, 3),
            "stored_bytes_per_volume": round(summary.stored_bytes / max(summary.volumes, 1))}


def formats(location: str, count: int) -> dict[str, Any]:
    """Bytes and codec time per volume: zarr (blosc zstd) against np.savez_compressed and float32 .npz."""
    from octfw.plugins.datasets.prepared.dataset import PreparedDataset
    from octfw.plugins.datasets.prepared.store import ARRAY_METADATA, CHUNK, decode_volume, dequantize, encode_volume, quantize

    dataset = PreparedDataset.open(location)
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for index in range(min(count, len(dataset))):
        volume = dequantize(dataset.load(index).volume)  # loaded as stored
        stored = quantize(volume, dataset.rows[index].dtype)
        started = time.perf_counter()
        objects = encode_volume(stored)
        add("zarr_encode_s", time.perf_counter() - started)
        started = time.perf_counter()
        decode_volume(objects[ARRAY_METADATA], objects[CHUNK])
        add("zarr_decode_s", time.perf_counter() - started)
        add("zarr_bytes", len(objects[CHUNK]))
        buffer = io.BytesIO()
        started = time.perf_counter()
        np.savez_compressed(buffer, volume=stored)
        add("npz_zlib_encode_s", time.perf_counter() - started)
        add("npz_zlib_bytes", buffer.tell())
        buffer.seek(0)
        started = time.perf_counter()
        with np.load(buffer) as loaded:
            loaded["volume"]
        add("npz_zlib_decode_s", time.perf_counter() - started)
        buffer = io.BytesIO()
        np.savez(buffer, prepared=volume.astype(np.float32))  # the oct-standard cache entry
        add("float32_cache_entry_bytes", buffer.tell())
    return {name: round(statistics.mean(values), 4) for name, values in rows.items()}


def stream(location: str, transform: Any, samples: int, batch: int = 4) -> dict[str, Any]:
    """Samples/s on one thread: read + check + decode + views + masks + collate."""
    import torch

    from octfw.plugins.datasets.prepared.dataset import PreparedDataset
    from octfw.engine.collate import collate
    from octfw.engine.data import SampleSource

    torch.set_num_threads(1)
    dataset = PreparedDataset.open(location)
    source = SampleSource(dataset, transform, seed=0)
    source[(0, 0)]  # metadata and imports, once
    started, done, items = time.perf_counter(), 0, []
    while done < samples:
        items.append(source[(1, done % len(dataset))])
        done += 1
        if len(items) == batch:
            collate(items, transform.batch_spec())
            items = []
    seconds = time.perf_counter() - started
    torch.set_num_threads(os.cpu_count() or 1)
    return {"samples": samples, "seconds": round(seconds, 2), "samples_per_s_per_core": round(samples / seconds, 2)}


def build_times(location: str, scratch: Path) -> dict[str, Any]:
    """PreparedDataset.open on indexes of 1k/10k/100k entries (rows copied from the real index)."""
    import attrs

    from octfw.plugins.datasets.prepared.dataset import PreparedDataset
    from octfw.plugins.datasets.prepared.store import HEADER_FILE, INDEX_FILE, read_header
    from octfw.engine.domains import domain_counts

    header = read_header(location)
    template = [json.loads(line) for line in Path(location, header.index).read_text().splitlines()]
    results = {}
    for size in BUILD_SIZES:
        folder = scratch / f"index-{size}"
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for i in range(size):
            row = dict(template[i % len(template)])
            row["key"] = f"{i:032x}"
            row["source"] = f"gs://cohort/volume-{i:06d}.dcm"
            lines.append(json.dumps(row, sort_keys=True) + "\n")
        data = "".join(lines).encode()
        (folder / INDEX_FILE).write_bytes(data)
        fake = attrs.evolve(header, index=INDEX_FILE, volumes=size, index_sha256=hashlib.sha256(data).hexdigest())
        (folder / HEADER_FILE).write_bytes(fake.to_bytes())
        started = time.perf_counter()
        domain_counts(PreparedDataset.open(str(folder)))
        results[str(size)] = round(time.perf_counter() - started, 3)
    return results


def header_scan(folder: str) -> dict[str, Any]:
    """Today's build of a folder dataset: list it, read every header (series grouping, domains)."""
    from octfw.dicom.dataset import DicomDataset

    started = time.perf_counter()
    dataset = DicomDataset.from_location(folder)
    dataset.domain_counts()
    seconds = time.perf_counter() - started
    return {"files": len(dataset), "seconds": round(seconds, 3), "per_file_ms": round(1000 * seconds / len(dataset), 2)}


def model_flops(image: list[int]) -> float:
    """Training FLOPs per sample of the seeds' model (small) at ``image``, counted on meta tensors."""
    import torch

    from octfw.engine.throughput import flops_per_sample
    from octfw.plugins.models.vjepa3d import build
    from octfw.plugins.models.vjepa3d.config import VJEPA3DConfig
    from octfw.types import BuildContext

    ctx = BuildContext(recipe_dir=ROOT, cache_dir=ROOT, run_dir=None, seed=0, image_size=tuple(image),
                       patch_size=(4, 16, 16))
    with torch.device("meta"):
        model = build(VJEPA3DConfig(preset="small", patch_size=(4, 16, 16)), ctx)
    grid = [s // p for s, p in zip(image, (4, 16, 16))]
    patches = int(np.prod(grid))
    target = int(round(0.6 * patches))
    batch = {"context": torch.zeros(1, 1, *image), "target": torch.zeros(1, 1, *image),
             "context_idx": torch.zeros(1, patches - target, dtype=torch.int64),
             "target_idx": torch.zeros(1, target, dtype=torch.int64)}
    return float(flops_per_sample(model, batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volumes", type=int, default=240, help="device-size volumes in the cohort (default 240)")
    parser.add_argument("--gcs-volumes", type=int, default=24, help="of those, prepared into the GCS emulator")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--work-dir", type=Path, help="where the cohort and prepared data go (default: temporary)")
    parser.add_argument("--smoke", action="store_true", help="a few small volumes: checks every path")
    args = parser.parse_args()

    from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build as build_transform
    from octfw.plugins.datasets.synthetic.cohort import write_synthetic_cohort
    from octfw.types import BuildContext

    n = 6 if args.smoke else args.volumes
    n_gcs = min(3 if args.smoke else args.gcs_volumes, n)
    image = [16, 64, 64] if args.smoke else SEEDS_IMAGE
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="data-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine(), "smoke": args.smoke, "volumes": n, "image_size": image,
                              "workers": args.workers}

    started = time.perf_counter()
    cohort = work / "cohort"
    files = write_synthetic_cohort(cohort, n, seed=0, sizes="small" if args.smoke else "device")
    result["cohort_write_s"] = round(time.perf_counter() - started, 1)
    raw = [os.path.getsize(f) for f in files]
    result["raw_dicom_bytes_per_volume"] = round(statistics.mean(raw))
    log(f"cohort: {n} volumes, {statistics.mean(raw) / 2**20:.1f} MiB per DICOM file, "
        f"written in {result['cohort_write_s']} s")

    result["header_scan"] = header_scan(str(cohort))
    log(f"header scan of the folder: {result['header_scan']['per_file_ms']} ms per file")

    recipe = write_recipe(work, str(cohort / "manifest.jsonl"), image)
    local = str(work / "prepared")
    result["prepare_local"] = prepare(recipe, local, args.workers)
    log(f"prepare to local disk: {result['prepare_local']['volumes_per_s_per_core']} volumes/s per core "
        f"({args.workers} workers)")

    ctx = BuildContext(recipe_dir=work, cache_dir=work, run_dir=None, seed=0, image_size=tuple(image),
                       patch_size=(4, 16, 16))
    transform = build_transform(OCTStandardConfig(image_size=tuple(image), cache=False), ctx)
    result["formats"] = formats(local, 3 if args.smoke else 12)
    log("formats: " + json.dumps(result["formats"]))
    result["stream_local"] = stream(local, transform, 24 if args.smoke else 200)
    log(f"stream from local disk: {result['stream_local']['samples_per_s_per_core']} samples/s per core")

    from gcs_emulator import GCSEmulator
    import gcsfs

    emulator = GCSEmulator().start()
    os.environ.update(emulator.env())
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        emulator.make_bucket("data-scale")
        subset = cohort / "subset.jsonl"  # beside the manifest: its paths are relative to it
        subset.write_text("".join(line + "\n" for line in
                                  (cohort / "manifest.jsonl").read_text().splitlines()[:n_gcs]))
        gcs_recipe = write_recipe(work, str(subset), image)
        result["prepare_gcs"] = prepare(gcs_recipe, "gs://data-scale/prepared", args.workers)
        log(f"prepare to the GCS emulator: {result['prepare_gcs']['volumes_per_s_per_core']} volumes/s per core")
        result["stream_gcs"] = stream("gs://data-scale/prepared", transform, 12 if args.smoke else 96)
        log(f"stream from the GCS emulator: {result['stream_gcs']['samples_per_s_per_core']} samples/s per core")
    finally:
        emulator.stop()
        gcsfs.GCSFileSystem.clear_instance_cache()

    result["build_seconds"] = build_times(local, work / "indexes")
    log(f"build from the index: {result['build_seconds']} s at {list(BUILD_SIZES)} entries; "
        f"a header scan would take {result['header_scan']['per_file_ms'] * 100_000 / 1000:.0f} s for 100,000 files here")

    flops = model_flops(SEEDS_IMAGE)
    per_chip_40 = 0.4 * TPU_V4_PEAK / flops
    per_core = min(result["stream_local"]["samples_per_s_per_core"], result["stream_gcs"]["samples_per_s_per_core"])
    result["tpu_v4_host"] = {
        "training_flops_per_sample": flops,
        "samples_per_s_per_chip_at_40pct_mfu": round(per_chip_40, 2),
        "streaming_samples_per_s_per_core": per_core,
        "cores_at_seeds_rate": [round(CHIPS_PER_HOST * r / per_core, 2) for r in SEEDS_RATE],
        "cores_at_40pct_mfu": round(CHIPS_PER_HOST * per_chip_40 / per_core, 2),
    }
    log("TPU v4 host: " + json.dumps(result["tpu_v4_host"]))
    result["seconds"] = round(time.perf_counter() - started, 1)
    path = write_result("data_scale_smoke" if args.smoke else "data_scale", result)
    log(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
