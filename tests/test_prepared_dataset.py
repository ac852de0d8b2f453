"""``octfw prepare`` on real Dask clusters and the ``prepared`` dataset that trains from it.

Everything runs for real: DICOM cohorts written by ``synthetic-oct``'s
writer, Dask local clusters of 2 worker processes (and one reached through
``--scheduler``), a killed ``octfw prepare`` process, the GCS emulator on
127.0.0.1, and training runs through ``octfw run``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import pytest

from octfw.cli.main import main
from octfw.dicom.dataset import DicomDataset
from octfw.plugins.transforms.oct_standard import OCTStandardConfig, build as build_transform
from octfw.plugins.datasets.prepared.dataset import PreparedDataset
from octfw.plugins.datasets.prepared.prepare import prepare_dataset
from octfw.plugins.datasets.prepared.store import (
    CHUNK, HEADER_FILE, dequantize, quantize, read_header,
)
from octfw.plugins.datasets.synthetic.cohort import write_synthetic_cohort
from octfw.engine.domains import domain_counts
from octfw.display.errors import CorruptFile
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.types import BuildContext

from conftest import TINY_RECIPE

SHAPES = {"heidelberg": (6, 40, 32), "topcon": (5, 36, 36), "zeiss": (7, 32, 40)}
IMAGE = [8, 32, 32]


def recipe_text(dataset: str, image=IMAGE) -> str:
    """The shared tiny recipe with another [dataset] table and image size."""
    return (TINY_RECIPE.replace('name = "synthetic-oct"\nn_volumes = 8', dataset)
            .replace("image_size = [8, 32, 32]", f"image_size = {json.dumps(image)}"))


def dicom_recipe(write_recipe, path: Path, name: str = "source.toml", **kwargs) -> Path:
    return write_recipe(recipe_text(f'name = "dicom"\npath = "{path}"', **kwargs), name)


def prepared_recipe(write_recipe, location: str, name: str = "prepared.toml", extra: str = "", **kwargs) -> Path:
    return write_recipe(recipe_text(f'name = "prepared"\npath = "{location}"\n{extra}', **kwargs), name)


def transform_for(image=IMAGE, **options):
    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                       image_size=tuple(image), patch_size=(4, 16, 16))
    return build_transform(OCTStandardConfig(image_size=tuple(image), cache=False, **options), ctx)


def prepare(recipe: Path, location, **kwargs):
    registry = load_registry()
    return prepare_dataset(load_recipe(recipe, (), registry), registry, str(location), report=lambda _: None, **kwargs)


@pytest.fixture
def cohort(tmp_path) -> Path:
    """12 labelled volumes, 2 of them corrupt, with their manifest."""
    folder = tmp_path / "cohort"
    write_synthetic_cohort(folder, 12, shapes=SHAPES, seed=3, corrupt_fraction=0.15, with_labels=True)
    return folder


def test_quantization_error_is_bounded():
    prepared = np.random.default_rng(0).random((4, 64, 64), dtype=np.float32)
    prepared[0, 0, :3] = [0.0, 1.0, 0.5]
    as_uint8 = np.abs(dequantize(quantize(prepared, "uint8")) - prepared).max()
    as_float16 = np.abs(dequantize(quantize(prepared, "float16")) - prepared).max()
    assert 0 < as_uint8 <= 1 / 510 + 1e-7
    assert 0 < as_float16 <= 2.0**-12
    assert quantize(prepared, "uint8").dtype == np.uint8 and quantize(prepared, "float16").dtype == np.float16


def test_a_running_2_worker_cluster_prepares_the_cohort_with_its_quarantine(cohort, write_recipe, tmp_path, capsys):
    from distributed import LocalCluster

    recipe = dicom_recipe(write_recipe, cohort / "manifest.jsonl")
    location = tmp_path / "prepared"
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        assert main(["prepare", str(recipe), "--out", str(location), "--scheduler", cluster.scheduler_address]) == 0
    out = capsys.readouterr().out
    assert "10 volumes (12 sources read now, 0 done before), 2 quarantined" in out

    header = read_header(str(location))
    assert header.complete and header.volumes == 10 and header.quarantined == 2
    quarantined = [json.loads(line) for line in (location / header.quarantine).read_text().splitlines()]
    assert len(quarantined) == 2 and all(q["reason"] and q["source"].endswith(".dcm") for q in quarantined)

    # Every usable volume is the transform's own prepare() output, within float16's bound.
    source = DicomDataset.from_location(cohort / "manifest.jsonl")
    transform = transform_for()
    dataset = PreparedDataset.open(str(location))
    by_source = {source.source(i): i for i in range(len(source))}
    assert len(dataset) == 10
    for index in range(len(dataset)):
        sample = dataset.load(index)
        original = source.load(by_source[dataset.source(index)])
        expected = transform.prepare(original)
        assert sample.volume.dtype == np.float16 and sample.volume.shape == tuple(IMAGE)  # as stored
        volume = transform.prepare(sample)  # accepted as prepared, not prepared again: as float32
        assert volume.dtype == np.float32 and np.abs(volume - expected).max() <= 2.0**-12
        assert sample.provenance == original.provenance
        assert sample.prepared_key == transform.cache_key()
        row = dataset.rows[index]
        assert row.content_hash == "sha256:" + hashlib.sha256(Path(row.source).read_bytes()).hexdigest()
        assert row.dtype == "float16" and row.label == original.provenance.label
    assert_views_travel_as_stored(dataset, transform, torch.float16)


def test_a_prepare_beside_another_dask_cluster_says_nothing_of_port_8787(write_recipe, tmp_path, recwarn):
    """Dask's HTTP server takes 8787 by default and warns when another cluster (a second prepare,
    a notebook's) holds it; a prepare's local cluster takes a free port instead."""
    import socket

    folder = tmp_path / "cohort"
    write_synthetic_cohort(folder, 2, shapes=SHAPES, seed=5)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("", 8787))
            holder.listen()
        except OSError:
            pass  # another process holds it already: the same case
        assert prepare(dicom_recipe(write_recipe, folder / "manifest.jsonl"), tmp_path / "prepared", workers=1).volumes == 2
    assert not [str(w.message) for w in recwarn if "8787" in str(w.message)]


def test_an_8_bit_cohort_is_stored_as_uint8_within_its_bound_of_the_transforms_output(write_recipe, tmp_path):
    """Devices export 8-bit voxels: stored as uint8 (round(255 x)), at most 1/510 from prepare()."""
    folder = tmp_path / "cohort8"
    write_synthetic_cohort(folder, 6, shapes=SHAPES, seed=5, sizes="device")  # device profiles are 8-bit
    location = tmp_path / "prepared8"
    assert prepare(dicom_recipe(write_recipe, folder / "manifest.jsonl"), location, workers=1).volumes == 6

    source = DicomDataset.from_location(folder / "manifest.jsonl")
    assert all(source.load(i).volume.max() <= 255 for i in range(len(source)))  # the sources are 8-bit
    transform = transform_for()
    dataset = PreparedDataset.open(str(location))
    by_source = {source.source(i): i for i in range(len(source))}
    errors = []
    for index in range(len(dataset)):
        assert dataset.rows[index].dtype == "uint8"
        expected = transform.prepare(source.load(by_source[dataset.source(index)]))
        sample = dataset.load(index)
        assert sample.volume.dtype == np.uint8  # as stored: b / 255
        errors.append(float(np.abs(transform.prepare(sample) - expected).max()))
    assert 0 < max(errors) <= 1 / 510 + 1e-6

    assert_views_travel_as_stored(dataset, transform, torch.uint8)
    # ... and the engine trains on them (a loader worker converting them for the cpu device, the model).
    recipe = prepared_recipe(write_recipe, str(location), name="train8.toml")
    assert main(["run", str(recipe), "--set", "run.max_steps=2", "--set", "engine.num_workers=1"]) == 0
    [summary] = [p for p in recipe.parent.rglob("summary.json") if "train8" in str(p)]
    assert np.isfinite(json.loads(summary.read_text())["last_loss"])


def assert_views_travel_as_stored(dataset, transform, dtype):
    """Unaugmented, the views stay as stored (``dtype``) through the loader and become
    transform.prepare()'s float32 on the device, bit for bit (octfw.engine.collate.float_views)."""
    from octfw.engine.collate import collate, float_views
    from octfw.engine.data import SampleSource

    spec = transform.batch_spec()
    batch = collate([SampleSource(dataset, transform, seed=0)[(0, i)] for i in range(2)], spec)["tensors"]
    assert batch["context"].dtype == batch["target"].dtype == dtype
    views = float_views(batch, ("context", "target"))
    for position in range(2):  # SampleSource[(epoch, i)] is dataset sample i
        expected = transform.prepare(dataset.load(position))
        assert views["context"].dtype == torch.float32
        np.testing.assert_array_equal(views["context"][position, 0].numpy(), expected)
        np.testing.assert_array_equal(views["target"][position, 0].numpy(), expected)
    # On an accelerator the device converts them (torch_xla's CPU device here), to the same bits.
    import torch_xla

    device = torch_xla.device()
    on_device = float_views({key: batch[key].to(device) for key in ("context", "target")}, ("context", "target"))
    assert on_device["context"].device.type == "xla"
    np.testing.assert_array_equal(on_device["context"].cpu().numpy(), views["context"].numpy())
    # An augmenting transform sends float32 views: the augmentation computes in float32.
    flipping = transform_for(flip_prob=1.0)
    augmented = collate([SampleSource(dataset, flipping, seed=0)[(0, 0)]], flipping.batch_spec())["tensors"]
    assert augmented["context"].dtype == torch.float32


def test_a_rerun_prepares_only_added_and_rewritten_files_and_prune_drops_replaced_ones(cohort, write_recipe, tmp_path):
    folder = cohort / "heidelberg"
    recipe = dicom_recipe(write_recipe, cohort)  # the folder: new files are listed
    location = tmp_path / "prepared"
    ticks = []
    first = prepare(recipe, location, workers=2, progress=lambda done, total: ticks.append((done, total)))
    assert (first.volumes, first.prepared, first.quarantined) == (10, 12, 2)
    assert ticks == [(done, 12) for done in range(1, 13)]  # the progress bar's feed: one tick per volume
    assert prepare(recipe, location, workers=2).prepared == 0

    files = sorted(folder.glob("*.dcm"))
    good = [f for f in files if any(r.source == str(f) for r in PreparedDataset.open(str(location)).rows)]
    shutil.copy(good[0], folder / "added.dcm")
    good[1].write_bytes(good[0].read_bytes())  # rewritten in place, new content
    os.utime(good[1], ns=(time.time_ns(), time.time_ns() + 10**9))
    third = prepare(recipe, location, workers=2)
    assert (third.prepared, third.reused, third.removed, third.stale, third.volumes) == (2, 11, 0, 1, 11)
    rows = PreparedDataset.open(str(location)).rows
    assert len({r.source for r in rows}) == len(rows) == 11
    assert len(list((location / "volumes").iterdir())) == 12  # the rewritten file's old volume, until --prune

    pruned = prepare(recipe, location, workers=2, prune=True)
    assert (pruned.prepared, pruned.removed, pruned.removed_sources, pruned.stale) == (0, 1, (str(good[1]),), 0)
    assert len(list((location / "volumes").iterdir())) == 11
    assert next(r for r in rows if r.source == str(good[1])).content_hash == \
        next(r for r in rows if r.source == str(good[0])).content_hash


def test_a_killed_prepare_resumes_without_redoing_or_duplicating_work(write_recipe, tmp_path):
    folder = tmp_path / "cohort"
    shapes = {name: (16, 160, 160) for name in SHAPES}  # slow enough to be caught halfway
    write_synthetic_cohort(folder, 30, shapes=shapes, seed=1)
    recipe = dicom_recipe(write_recipe, folder / "manifest.jsonl")
    location = tmp_path / "prepared"
    process = subprocess.Popen(
        [sys.executable, "-m", "octfw.cli", "prepare", str(recipe), "--out", str(location), "--workers", "1"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    entries = location / "entries"

    def committed() -> int:
        # A worker killed mid-write leaves its ".tmp-*-<key>.json", which is no commit record.
        return len([p for p in entries.glob("*.json") if not p.name.startswith(".")]) if entries.exists() else 0

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and committed() < 3:
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and its Dask workers, mid-work
    process.wait()
    done = committed()
    assert 3 <= done < 30, "the run was not caught halfway"
    assert not read_header(str(location), must_be_complete=False).complete
    assert main(["run", str(prepared_recipe(write_recipe, str(location)))]) == 2  # partly written

    summary = prepare(recipe, location, workers=2)
    assert (summary.reused, summary.prepared, summary.volumes) == (done, 30 - done, 30)
    sources = [r.source for r in PreparedDataset.open(str(location)).rows]
    assert sorted(sources) == sorted(set(sources)) and len(sources) == 30


def test_a_worker_killed_writing_its_record_leaves_no_stale_entry_and_prune_removes_its_file(
        cohort, write_recipe, tmp_path):
    recipe = dicom_recipe(write_recipe, cohort / "manifest.jsonl")
    location = tmp_path / "prepared"
    prepare(recipe, location, workers=2)
    record = next((location / "entries").glob("*.json"))
    leftover = record.with_name(f".tmp-0123456789ab-{record.name}")  # what write_atomically leaves when killed
    leftover.write_bytes(record.read_bytes()[:10])
    assert (summary := prepare(recipe, location, workers=2)).stale == 0 and summary.prepared == 0
    assert prepare(recipe, location, workers=2, prune=True).removed_sources == ()
    assert not leftover.exists() and record.exists()


@pytest.fixture
def prepared(cohort, write_recipe, tmp_path) -> Path:
    location = tmp_path / "prepared"
    prepare(dicom_recipe(write_recipe, cohort / "manifest.jsonl"), location, workers=2)
    return location


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_from_a_prepared_dataset_resumes_exactly_and_replays(prepared, write_recipe, tmp_path, capsys):
    from octfw.diagnostics.replay import replay

    recipe = prepared_recipe(write_recipe, str(prepared))
    overrides = ["--set", "run.max_steps=6", "--set", "engine.checkpoint_every_steps=3",
                 "--set", "engine.domain_sampling=balanced"]
    assert main(["run", str(recipe), *overrides]) == 0
    run_dir = next((tmp_path / "runs" / "prepared").iterdir())
    reference = metrics(run_dir)
    assert len(reference) == 6

    twin = tmp_path / "twin"
    shutil.copytree(run_dir, twin)
    (twin / "checkpoints" / "step_00000006.pt").unlink()
    (twin / "checkpoints" / "latest").write_text("step_00000003.pt")
    (twin / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in reference[:3]))
    from octfw.engine.trainer import train

    registry = load_registry()
    resumed = train(load_recipe(recipe, overrides[1::2], registry), registry, twin, resume="auto")
    assert resumed.update_steps == 6
    assert [m["loss"] for m in metrics(twin)[3:]] == [m["loss"] for m in reference[3:]]

    result = replay(run_dir, 5, load_registry(), report=lambda _: None)
    assert result["loss"] == pytest.approx(reference[4]["loss"], rel=1e-6)
    assert all(s.endswith(".dcm") for s in result["samples"])  # provenance: the DICOM sources
    assert not (tmp_path / "octfw-cache" / "prepared").exists() or not any(
        (tmp_path / "octfw-cache" / "prepared").rglob("*.npz"))


def test_a_damaged_volume_is_quarantined_never_trained_on(prepared, write_recipe, tmp_path):
    dataset = PreparedDataset.open(str(prepared))
    victim = dataset.rows[0]
    chunk = prepared / "volumes" / victim.key / CHUNK
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match="does not match its index entry"):
        dataset.load(0)
    shutil.rmtree(prepared / "volumes" / dataset.rows[1].key)
    with pytest.raises(CorruptFile, match="missing"):
        dataset.load(1)

    assert main(["run", str(prepared_recipe(write_recipe, str(prepared))), "--set", "run.max_steps=5"]) == 0
    run_dir = next((tmp_path / "runs" / "prepared").iterdir())
    listed = {json.loads(line)["url"] for line in (run_dir / "quarantine.jsonl").read_text().splitlines()}
    assert listed == {victim.source, dataset.rows[1].source}


def test_a_flipped_byte_in_the_first_volumes_metadata_quarantines_that_volume_only(prepared, write_recipe, tmp_path):
    """zarr.json is the same for every volume of a dtype; one damaged and read first must stay that
    volume's damage, not make the whole store unusable (all 10 failed, quarantine empty, before)."""
    from octfw.plugins.datasets.prepared.store import ARRAY_METADATA

    dataset = PreparedDataset.open(str(prepared))
    victim = dataset.rows[0]
    metadata = prepared / "volumes" / victim.key / ARRAY_METADATA
    data = bytearray(metadata.read_bytes())
    data[0] ^= 0xFF  # no longer JSON
    metadata.write_bytes(bytes(data))
    with pytest.raises(CorruptFile, match=f"its prepared volume {victim.key} does not decode"):
        dataset.load(0)
    assert all(dataset.load(i).volume.shape == tuple(IMAGE) for i in range(1, len(dataset)))

    assert main(["run", str(prepared_recipe(write_recipe, str(prepared))), "--set", "run.max_steps=3"]) == 0
    run_dir = next((tmp_path / "runs" / "prepared").iterdir())
    quarantine = run_dir / "quarantine.jsonl"
    listed = [json.loads(line)["url"] for line in quarantine.read_text().splitlines()] if quarantine.exists() else []
    assert set(listed) <= {victim.source}  # quarantined when read before a good one; never another volume


@pytest.mark.parametrize("damaged", ["header", "index", "quarantine"])
def test_a_flipped_byte_in_a_store_file_is_one_line_or_harmless_never_a_traceback(
        prepared, write_recipe, tmp_path, capsys, damaged):
    """The store's own files: the header and the index decide what the store is, so a damaged one
    refuses the store in one line (exit 2); the quarantine list only reports, so the run goes on."""
    header = read_header(str(prepared))
    target = {"header": prepared / HEADER_FILE, "index": prepared / header.index,
              "quarantine": prepared / header.quarantine}[damaged]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x55
    target.write_bytes(bytes(data))
    capsys.readouterr()
    code = main(["run", str(prepared_recipe(write_recipe, str(prepared))), "--set", "run.max_steps=2"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if damaged == "quarantine":
        assert code == 0, err
    else:
        lines = [line for line in err.splitlines() if line.startswith("octfw: error:")]
        assert code == 2 and len(lines) == 1 and str(prepared) in lines[0], err


def test_building_reads_the_index_only(prepared):
    shutil.rmtree(prepared / "volumes")  # no volume can be read: building must not try
    dataset = PreparedDataset.open(str(prepared))
    assert len(dataset) == 10 and sum(domain_counts(dataset).values()) == 10


@pytest.mark.parametrize("damage, message", [
    ("missing", "no prepared dataset there"),
    ("partial", "partly written prepared dataset"),
    ("index", "does not match its header"),
    ("transform", "image_size: prepared [8, 32, 32] != recipe [8, 48, 48]"),
])
def test_bad_prepared_locations_get_one_line_errors(prepared, write_recipe, tmp_path, capsys, damage, message):
    location, image = prepared, IMAGE
    if damage == "missing":
        location = tmp_path / "nowhere"
    elif damage == "partial":
        header = json.loads((prepared / HEADER_FILE).read_text())
        (prepared / HEADER_FILE).write_text(json.dumps({**header, "complete": False}))
    elif damage == "index":
        index = prepared / read_header(str(prepared)).index
        lines = index.read_text().splitlines()
        index.write_text("\n".join(lines[:-1]) + "\n")
    else:
        image = [8, 48, 48]
    capsys.readouterr()
    assert main(["run", str(prepared_recipe(write_recipe, str(location), image=image))]) == 2
    err = errors(capsys)
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


def test_prepare_into_a_location_of_other_transform_options_is_refused(prepared, cohort, write_recipe, capsys):
    recipe = dicom_recipe(write_recipe, cohort / "manifest.jsonl", name="other.toml", image=[8, 48, 48])
    assert main(["prepare", str(recipe), "--out", str(prepared)]) == 2
    assert "other transform options: image_size" in capsys.readouterr().err
    assert read_header(str(prepared)).complete  # untouched


def errors(capsys) -> list[str]:
    """What a command printed to stderr, but the recipe's own warnings (these recipes have no
    grad-clip guard, which octfw run warns of)."""
    return [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("octfw: warning:")]


BUCKET = "octfw-prepared"


def test_prepare_to_and_stream_from_the_gcs_emulator_with_a_bounded_cache(gcs, cohort, write_recipe, tmp_path):
    import gcsfs

    from octfw.storage.disk_cache import DiskCache

    gcsfs.GCSFileSystem.clear_instance_cache()
    gcs.make_bucket(BUCKET)
    location = f"gs://{BUCKET}/cohort-a"
    summary = prepare(dicom_recipe(write_recipe, cohort / "manifest.jsonl"), location, workers=2)
    assert (summary.volumes, summary.quarantined) == (10, 2)

    remote = PreparedDataset.open(location, cache=DiskCache(tmp_path / "cache", 10**9))
    volumes = [remote.load(i).volume for i in range(len(remote))]
    sizes = sorted(r.nbytes for r in remote.rows)
    bound = sum(sizes[-3:])  # room for three volumes, not ten
    bounded = PreparedDataset.open(location, cache=DiskCache(tmp_path / "small", bound))
    for _epoch in range(2):
        for index in range(len(bounded)):
            np.testing.assert_array_equal(bounded.load(index).volume, volumes[index])
            assert bounded.cache.total_bytes() <= bound
    # The big cache holds every volume: reads need no store any more.
    gcs.stop()
    assert all(np.array_equal(remote.load(i).volume, volumes[i]) for i in range(len(remote)))
    gcsfs.GCSFileSystem.clear_instance_cache()


def test_locations_that_cannot_be_written_or_read_get_one_line_errors(cohort, write_recipe, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    recipe = dicom_recipe(write_recipe, cohort / "manifest.jsonl")
    assert main(["prepare", str(recipe), "--out", str(blocker / "prepared")]) == 2
    err = errors(capsys)
    assert len(err) == 1 and str(blocker / "prepared") in err[0] and "Not a directory" in err[0]
    assert main(["run", str(prepared_recipe(write_recipe, str(blocker / "prepared")))]) == 2
    err = errors(capsys)
    assert len(err) == 1 and str(blocker) in err[0] and "cannot read" in err[0]


def test_an_unreachable_scheduler_is_one_line(cohort, write_recipe, tmp_path, capsys):
    recipe = dicom_recipe(write_recipe, cohort / "manifest.jsonl")
    assert main(["prepare", str(recipe), "--out", str(tmp_path / "p"), "--scheduler", "tcp://127.0.0.1:9"]) == 2
    err = errors(capsys)
    assert len(err) == 1 and "cannot reach a Dask scheduler" in err[0]
