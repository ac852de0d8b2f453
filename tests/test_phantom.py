"""The phantom-oct families: real DICOM, determinism, patients, labels, and independence
from synthetic-oct's renderer (issue #29, item 1)."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_RECIPE
from test_user_mistakes import octfw, refused
from octfw.types import BuildContext
from octfw.dicom.dataset import DicomDataset
from octfw.dicom.manifest import read_manifest
from octfw.registry import load_registry

PACKAGE = Path(__file__).resolve().parents[1] / "octfw" / "data" / "phantom"


def _build(tmp_path, **options):
    component = load_registry(entry_points=[]).get("dataset", "phantom-oct")
    ctx = BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path / "cache", run_dir=None, seed=3)
    return component.build(component.config(**options), ctx)


def _digests(dataset) -> list[str]:
    return [hashlib.sha256(Path(dataset.url(i)).read_bytes()).hexdigest() for i in range(len(dataset))]


@pytest.mark.parametrize("family", ["tuning", "held-out"])
def test_each_family_writes_dicom_read_back_with_labels_and_two_eyes_per_patient(tmp_path, family):
    dataset = _build(tmp_path, family=family, n_volumes=12, labels=True)
    assert isinstance(dataset, DicomDataset) and len(dataset) == 12
    labels = [dataset.load(i).provenance.label for i in range(12)]
    assert set(labels) == {0, 1}
    patients = [dataset.patient(i) for i in range(12)]
    assert all(patients) and len(set(patients)) == 6
    assert all(patients.count(p) == 2 for p in patients)
    (folder,) = (tmp_path / "cache" / "phantom-oct").iterdir()
    assert [row.patient for row in read_manifest(str(folder / "manifest.jsonl"))] == patients
    # Both eyes of a patient come from one device.
    domains = [dataset.load(i).provenance.domain for i in range(12)]
    assert domains[0::2] == domains[1::2] and len(set(domains)) == 3


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_bytes(tmp_path):
    first = _digests(_build(tmp_path / "a", family="held-out", n_volumes=4, seed=7))
    again = _digests(_build(tmp_path / "b", family="held-out", n_volumes=4, seed=7))
    other = _digests(_build(tmp_path / "c", family="held-out", n_volumes=4, seed=8))
    assert first == again
    assert not set(first) & set(other)


def test_the_families_have_their_own_vendors_and_shapes(tmp_path):
    seen = {}
    for family in ("tuning", "held-out"):
        dataset = _build(tmp_path / family, family=family, n_volumes=6)
        samples = [dataset.load(i) for i in range(6)]
        seen[family] = {s.provenance.domain: s.volume.shape for s in samples}
    assert set(seen["tuning"]) == {"optovue", "nidek", "canon"}
    assert set(seen["held-out"]) == {"optopol", "bioptigen", "moptim"}
    assert not set(seen["tuning"].values()) & set(seen["held-out"].values())


def test_a_positive_eye_has_its_negative_twins_noise_and_differs_in_part():
    # The finding draws from its own stream; what it changes is a region (the swelling of the
    # held-out family moves the layers below it), not the whole volume's speckle.
    from octfw.plugins.datasets.phantom import held_out, tuning

    for module in (tuning, held_out):
        anatomy = module.draw_patient(np.random.default_rng(0))
        vendor = module.VENDORS[0]
        volumes = [module.render(np.random.default_rng(1), anatomy, vendor, mirrored=False, positive=p,
                                 finding_scale=1.0)[0].astype(float) for p in (False, True)]
        changed = np.abs(volumes[1] - volumes[0]) > 0
        assert 0.0 < changed.mean() < 0.4, module.__name__


def test_a_cohort_is_reused_until_its_record_is_gone(tmp_path):
    first = _build(tmp_path, n_volumes=2)
    (folder,) = (tmp_path / "cache" / "phantom-oct").iterdir()
    stamp = (folder / "cohort.json").stat().st_mtime_ns
    _build(tmp_path, n_volumes=2)
    assert (folder / "cohort.json").stat().st_mtime_ns == stamp
    (folder / "cohort.json").unlink()  # as a write cut short leaves it
    again = _build(tmp_path, n_volumes=2)
    assert (folder / "cohort.json").exists()
    assert _digests(again) == _digests(first)


def test_an_unknown_family_is_a_one_line_recipe_error(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(TINY_RECIPE.replace('name = "synthetic-oct"', 'name = "phantom-oct"\nfamily = "x"'))
    out = octfw("check", str(recipe), cwd=tmp_path)
    assert refused(out).endswith("recipe.toml: 1 problem")
    assert out.stderr.splitlines()[1:] == ["  dataset.family: must be one of 'tuning', 'held-out', 'context', got 'x'"]


def test_a_task_other_than_the_familys_is_refused():
    component = load_registry(entry_points=[]).get("dataset", "phantom-oct")
    assert component.config(family="held-out", task="cysts").task == "cysts"
    with pytest.raises(ValueError, match="has the one task 'drusen'"):
        component.config(family="tuning", task="cysts")


def test_the_package_imports_nothing_of_synthetic_oct():
    for source in PACKAGE.glob("*.py"):
        tree = ast.parse(source.read_text())
        imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        assert not [m for m in imported if m and m.startswith("octfw.plugins.datasets.synthetic")], source.name


_WRITE = """
import sys
from octfw.plugins.datasets.phantom.cohort import write_phantom_cohort
write_phantom_cohort(sys.argv[1], "held-out", int(sys.argv[2]), seed=4, labels=True)
"""


def _write_in_process(folder: Path, n: int):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", _WRITE, str(folder), str(n)])


def _files(folder: Path) -> dict[str, str]:
    """The cohort's volumes. A writer killed inside a write leaves its hidden ``.tmp-*`` file
    (atomic writes: never renamed, never listed in the manifest); it is not part of the cohort."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.dcm")) if not p.name.startswith(".tmp-")}


def test_a_write_killed_mid_way_is_finished_by_the_next_and_two_writers_agree(tmp_path):
    import os
    import signal
    import time

    from octfw.plugins.datasets.phantom.cohort import write_phantom_cohort

    reference = tmp_path / "reference"
    write_phantom_cohort(str(reference), "held-out", 24, seed=4, labels=True)

    # kill -9 once a few volumes are on disk: no record, so the cohort is not taken as complete
    killed = tmp_path / "killed"
    writer = _write_in_process(killed, 24)
    deadline = time.monotonic() + 60
    while len(list(killed.rglob("*.dcm"))) < 3 and time.monotonic() < deadline and writer.poll() is None:
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)
    assert writer.wait() == -signal.SIGKILL  # killed, not finished
    assert len(list(killed.rglob("*.dcm"))) < 24 and not (killed / "cohort.json").exists()
    write_phantom_cohort(str(killed), "held-out", 24, seed=4, labels=True)
    assert (killed / "cohort.json").exists() and _files(killed) == _files(reference)
    assert ".tmp-" not in (killed / "manifest.jsonl").read_text()

    # two processes writing the same cohort at once both succeed, with the same bytes
    shared = tmp_path / "shared"
    writers = [_write_in_process(shared, 24) for _ in range(2)]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    assert _files(shared) == _files(reference)
    assert (shared / "manifest.jsonl").read_bytes() == (reference / "manifest.jsonl").read_bytes().replace(
        str(reference).encode(), str(shared).encode())


def _twins(module, seed: int = 0):
    """One eye rendered without and with its finding (the same noise): volumes and masks."""
    anatomy = module.draw_patient(np.random.default_rng(seed))
    vendor = module.VENDORS[0]
    return [module.render(np.random.default_rng(seed + 1), anatomy, vendor, mirrored=False, positive=p,
                          finding_scale=1.0) for p in (False, True)]


def test_the_cyst_mask_covers_the_voxels_the_cysts_darken():
    from octfw.plugins.datasets.phantom import held_out

    (negative, empty), (positive, mask) = _twins(held_out)
    assert not empty.any() and mask.shape == positive.shape and mask.dtype == bool
    assert 0.0 < mask.mean() < 0.05
    darker = positive.astype(float) < negative.astype(float)
    # The same voxel without the finding was brighter: the mask is where the cysts are.
    assert darker[mask].mean() > 0.95
    assert positive[mask].mean() < 0.5 * negative[mask].mean()


def test_the_drusen_mask_covers_the_deposit_under_the_lifted_epithelium():
    from octfw.plugins.datasets.phantom import tuning

    (negative, empty), (positive, mask) = _twins(tuning)
    assert not empty.any() and 0.0 < mask.mean() < 0.05
    changed = positive != negative
    assert changed[mask].mean() > 0.95  # every deposit voxel was something else without drusen
    # Drusen lift the epithelium: every masked column starts below retina that was there anyway.
    columns = mask.any(axis=1)
    assert columns.any() and (mask.argmax(axis=1)[columns] > 0).all()


def test_a_cohort_writes_each_volumes_mask_beside_it_and_in_the_manifest(tmp_path):
    dataset = _build(tmp_path, family="held-out", n_volumes=6, labels=True)
    for index in range(6):
        source = dataset.mask_source(index)
        assert source == dataset.url(index).replace(".dcm", ".mask.npy") and Path(source).is_file()
        mask, sample = dataset.mask(index), dataset.load(index)
        assert mask.shape == sample.volume.shape
        assert bool(mask.any()) == bool(sample.provenance.label)


def test_the_context_family_renders_the_same_eye_for_the_same_seed():
    from octfw.plugins.datasets.phantom import context

    anatomy = context.draw_patient(np.random.default_rng(5))
    for vendor in context.VENDORS:
        first, first_mask = context.render(np.random.default_rng(6), anatomy, vendor, mirrored=True, positive=True,
                                           finding_scale=1.0)
        again, again_mask = context.render(np.random.default_rng(6), anatomy, vendor, mirrored=True, positive=True,
                                           finding_scale=1.0)
        assert first.shape == first_mask.shape == vendor.shape and first.dtype == np.uint16
        np.testing.assert_array_equal(first, again)
        np.testing.assert_array_equal(first_mask, again_mask)


@pytest.mark.parametrize("seed", range(4))
def test_the_context_findings_mask_is_non_empty_exactly_in_positive_eyes(seed):
    from octfw.plugins.datasets.phantom import context

    anatomy = context.draw_patient(np.random.default_rng(seed))
    vendor = context.VENDORS[seed % 3]
    negative, empty = context.render(np.random.default_rng(seed + 10), anatomy, vendor, mirrored=bool(seed % 2),
                                     positive=False, finding_scale=1.0)
    positive, mask = context.render(np.random.default_rng(seed + 10), anatomy, vendor, mirrored=bool(seed % 2),
                                    positive=True, finding_scale=1.0)
    assert mask.dtype == empty.dtype == bool
    assert not empty.any()
    assert 0.005 < mask.mean() < 0.2
    # The finding changes the eye where the mask says, under the same noise; most voxels are untouched.
    changed = positive != negative
    assert changed[mask].mean() > 0.5
    assert changed[~mask].mean() < 0.25


@pytest.mark.parametrize("seed", range(3))
def test_the_context_reversal_swaps_which_half_is_brighter_and_keeps_the_volumes_brightness(seed):
    from octfw.plugins.datasets.phantom import context

    assert context.FINDING.kind == "reversal"
    anatomy = context.draw_patient(np.random.default_rng(seed))
    vendor = context.VENDORS[seed]
    normal, _ = context.render(np.random.default_rng(seed + 10), anatomy, vendor, mirrored=False, positive=False,
                               finding_scale=1.0)
    positive, _ = context.render(np.random.default_rng(seed + 10), anatomy, vendor, mirrored=False, positive=True,
                                 finding_scale=1.0)
    normal, positive = normal.astype(float), positive.astype(float)
    half = vendor.shape[0] // 2  # the slices below the fovea come first (z grows with the index)
    assert normal[:half].mean() > normal[half:].mean()
    assert positive[:half].mean() < positive[half:].mean()
    # The same reflectivities, swapped between the halves: the volume's mean and spread stay.
    assert positive.mean() == pytest.approx(normal.mean(), rel=0.01)
    assert positive.std() == pytest.approx(normal.std(), rel=0.02)


def test_a_recipe_of_the_context_family_validates_and_builds_a_labelled_cohort(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(TINY_RECIPE.replace('name = "synthetic-oct"',
                                          'name = "phantom-oct"\nfamily = "context"\ntask = "reversal"\nlabels = true'))
    assert octfw("check", str(recipe), cwd=tmp_path).returncode == 0
    dataset = _build(tmp_path, family="context", n_volumes=6, labels=True)
    assert {dataset.load(i).provenance.domain for i in range(6)} == {"tomey", "visionix", "thorlabs"}
    assert {dataset.load(i).provenance.label for i in range(6)} <= {0, 1}


def test_the_listing_names_each_familys_layer_labels_as_its_cohort_writes_them(tmp_path):
    """``octfw list --name phantom-oct`` names the layers every volume is labelled with, in label
    order, for each family: the names a written cohort's manifest gives (label k, the k-th)."""
    from octfw.plugins.datasets.phantom.cohort import write_phantom_cohort
    from octfw.plugins.datasets.phantom.config import FAMILY_TASKS

    listing = " ".join(octfw("list", "--name", "phantom-oct", cwd=tmp_path).stdout.split())
    for family in FAMILY_TASKS:
        manifest = write_phantom_cohort(str(tmp_path / family), family, 2, seed=1)
        names = DicomDataset.from_location(manifest, domain_from="header").layer_names(0)
        assert f"{family}: {', '.join(names)}" in listing, (family, names)
