"""The ``dicom`` dataset over gs://, against a real GCS emulator on 127.0.0.1.

A cohort (with corrupt files) is written straight into the emulator's
bucket; the dataset lists a folder there, reads a manifest there, and a tiny
training run reads its volumes from it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from octfw.cli.main import main
from octfw.dicom.dataset import DicomDataset
from octfw.plugins.datasets.synthetic.cohort import write_synthetic_cohort
from octfw.display.errors import CorruptFile

from conftest import TINY_RECIPE

SHAPES = {"heidelberg": (4, 20, 16), "topcon": (3, 16, 16), "zeiss": (5, 16, 12)}
BUCKET = "octfw-cohorts"


@pytest.fixture
def bucket(gcs):
    """The emulator with a bucket holding a 10-volume cohort, 2 of them corrupt."""
    import gcsfs

    # fsspec keeps one filesystem per set of arguments across tests; an earlier
    # test's instance would still point at an emulator that has stopped.
    gcsfs.GCSFileSystem.clear_instance_cache()
    gcs.make_bucket(BUCKET)
    files = write_synthetic_cohort(f"gs://{BUCKET}/cohort", 10, shapes=SHAPES, seed=4,
                                   corrupt_fraction=0.2)
    yield gcs, files
    gcsfs.GCSFileSystem.clear_instance_cache()


def test_folder_listing_reads_volumes_and_domains_from_the_bucket(bucket):
    _gcs, files = bucket
    dataset = DicomDataset.from_location(f"gs://{BUCKET}/cohort/")
    assert len(dataset) == 10
    assert sorted(dataset.source(i) for i in range(10)) == sorted(files)
    counts = dataset.domain_counts()
    assert sum(counts.values()) == 10 and {"heidelberg", "topcon", "zeiss"} <= set(counts)
    good, bad = [], []
    for index in range(len(dataset)):
        try:
            sample = dataset.load(index)
        except CorruptFile as exc:
            bad.append(exc.url)
            continue
        good.append(sample)
        assert sample.provenance.source.startswith(f"gs://{BUCKET}/cohort/")
        assert sample.volume.shape == SHAPES[sample.provenance.domain]
    assert (len(good), len(bad)) == (8, 2)
    heidelberg = next(s for s in good if s.provenance.domain == "heidelberg")
    assert heidelberg.provenance.spacing == pytest.approx((0.25, 0.02, 0.094))


def test_manifest_in_the_bucket_lists_relative_paths(bucket):
    dataset = DicomDataset.from_location(f"gs://{BUCKET}/cohort/manifest.jsonl", domain_from="manifest")
    assert len(dataset) == 10
    assert all(dataset.source(i).startswith(f"gs://{BUCKET}/cohort/") for i in range(10))
    assert dataset.domain_counts() == {"heidelberg": 4, "topcon": 3, "zeiss": 3}
    volumes = []
    for index in range(10):
        try:
            volumes.append(dataset.load(index).volume)
        except CorruptFile:
            pass
    assert len(volumes) == 8 and all(np.isfinite(v).all() for v in volumes)


def test_a_tiny_training_run_reads_from_gs(bucket, write_recipe, tmp_path, capsys):
    recipe = write_recipe(TINY_RECIPE.replace('n_volumes = 8\n', ''), "gs.toml")
    code = main(["run", str(recipe),
                 "--set", "dataset.name=dicom",
                 "--set", f"dataset.path=gs://{BUCKET}/cohort/manifest.jsonl",
                 "--set", "run.max_steps=3",
                 "--set", f"run.cache_dir={tmp_path / 'cache'}"])
    assert code == 0, capsys.readouterr().err
    run_dir = next((tmp_path / "runs").glob("gs/*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == 3
    assert set(summary["quarantined_files"]) <= {f for f in bucket[1] if "gs://" in f}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(m["loss"]) for m in metrics)
    # The prepared volumes came from gs:// once and now sit in the local cache.
    assert list((tmp_path / "cache" / "prepared").rglob("*.npz"))
