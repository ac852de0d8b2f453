"""Synthetic cohorts and the dataset components: determinism, corruption,
reuse, manifests, domains, listing over fsspec, pickling, registration."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import attrs
import numpy as np
import pydicom
import pytest

from octfw.dicom.dataset import DicomDataset, list_dicom_files
from octfw.dicom.decoding import read_oct_volume
from octfw.dicom.writing import write_oct_dicom
from octfw.plugins.datasets.synthetic.cohort import cohort_key, cohort_options, read_cohort, write_synthetic_cohort
from octfw.plugins.datasets.synthetic.corruption import CORRUPTION_KINDS, corrupt_count
from octfw.plugins.datasets.synthetic.labels import TASKS
from octfw.plugins.datasets.synthetic.retina import synthetic_volume
from octfw.plugins.datasets.synthetic.vendors import PROFILES, VendorProfile
from octfw.display.errors import CorruptFile, UserError
from octfw.registry import load_registry
from octfw.types import BuildContext, Dataset

SMALL = {"heidelberg": (4, 16, 12), "topcon": (3, 12, 16), "zeiss": (5, 14, 10)}


def _cohort(folder, n=6, **kwargs):
    kwargs.setdefault("shapes", SMALL)
    kwargs.setdefault("seed", 11)
    return write_synthetic_cohort(folder, n, **kwargs)


def _volume(seed=0, shape=(3, 8, 8)):
    return np.random.default_rng(seed).integers(1, 999, size=shape, dtype=np.uint16)


def _ctx(tmp_path, seed=3):
    return BuildContext(recipe_dir=tmp_path, cache_dir=tmp_path / "cache", run_dir=None, seed=seed)


# --- synthetic cohorts ----------------------------------------------------


def test_same_seed_gives_byte_identical_files(tmp_path):
    first = _cohort(tmp_path / "a", seed=5)
    second = _cohort(tmp_path / "b", seed=5)
    for a, b in zip(first, second):
        assert Path(a).read_bytes() == Path(b).read_bytes()


def test_another_seed_gives_other_pixels(tmp_path):
    first = read_oct_volume(_cohort(tmp_path / "a", seed=5)[0]).volume
    second = read_oct_volume(_cohort(tmp_path / "b", seed=6)[0]).volume
    assert first.shape == second.shape and not np.array_equal(first, second)


def test_domains_differ_in_size_spacing_and_manufacturer(tmp_path):
    files = write_synthetic_cohort(tmp_path, 3, seed=0)  # default, vendor-sized volumes
    for path, domain in zip(files, ("heidelberg", "topcon", "zeiss")):
        sample = read_oct_volume(path)
        profile = PROFILES[domain]
        assert sample.provenance.domain == domain
        assert sample.volume.shape == profile.shape
        assert sample.provenance.spacing == pytest.approx(profile.spacing)
        assert pydicom.dcmread(path, stop_before_pixels=True).Manufacturer == profile.manufacturer
    shapes = {PROFILES[d].shape for d in ("heidelberg", "topcon", "zeiss")}
    assert len(shapes) == 3


def test_synthetic_volumes_have_bright_layers_below_a_dark_vitreous(tmp_path):
    volume = read_oct_volume(write_synthetic_cohort(tmp_path, 1, seed=2)[0]).volume
    axial_profile = volume.mean(axis=(0, 2))  # mean over B-scans and A-scans, per depth
    height = len(axial_profile)
    vitreous = axial_profile[: height // 8].mean()
    retina = axial_profile[height // 5 : height * 3 // 5].max()
    assert retina > 4 * vitreous


@pytest.mark.parametrize("n, fraction", [(10, 0.3), (8, 0.5), (7, 0.0), (5, 1.0)])
def test_corrupt_fraction_breaks_the_expected_number_of_files(tmp_path, n, fraction):
    files = _cohort(tmp_path, n, corrupt_fraction=fraction)
    expected = corrupt_count(n, fraction)
    assert expected == int(np.floor(n * fraction + 0.5))

    failed = []
    for path in files:
        try:
            read_oct_volume(path)
        except CorruptFile as error:
            failed.append(error.reason)
    assert len(failed) == expected
    recorded = [item["corrupt"] for item in read_cohort(tmp_path)["files"] if item["corrupt"]]
    assert recorded == [CORRUPTION_KINDS[k % 4] for k in range(expected)]


def test_each_corruption_kind_fails_with_its_own_reason(tmp_path):
    files = _cohort(tmp_path, 4, corrupt_fraction=1.0)
    reasons = {}
    for path, item in zip(files, read_cohort(tmp_path)["files"]):
        with pytest.raises(CorruptFile) as info:
            read_oct_volume(path)
        reasons[item["corrupt"]] = info.value.reason
    assert reasons["truncated"].startswith("truncated pixel data")
    assert reasons["not-dicom"].startswith("not a DICOM file")
    assert reasons["no-pixel-data"] == "no PixelData element"
    assert reasons["constant"].startswith("constant volume")


def test_labels_are_recorded_and_show_as_a_bright_lesion(tmp_path):
    files = _cohort(tmp_path, 12, with_labels=True)
    cohort = read_cohort(tmp_path)
    assert set(cohort["labels"]) == {0, 1}
    manifest = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert [row["label"] for row in manifest] == cohort["labels"]
    dataset = DicomDataset.from_location(tmp_path / "manifest.jsonl")
    assert [dataset.load(i).provenance.label for i in range(len(files))] == cohort["labels"]


# Speckle-free, noise-free and without offset: stored values are the signal
# (reflectivity x 20000), so layer positions can be read off exactly.
CLEAN = VendorProfile("test", "clean", (6, 128, 64), (0.3, 0.016, 0.094), gain=1.0, offset=0.0,
                      looks=1e9, noise=0.0)


def _healthy_and(finding, seed=3):
    """The same retina (same draws up to the finding) without and with ``finding``."""
    healthy = synthetic_volume(np.random.default_rng(seed), CLEAN.shape, CLEAN).astype(float) / 20000
    ill = synthetic_volume(np.random.default_rng(seed), CLEAN.shape, CLEAN, finding=finding).astype(float) / 20000
    return healthy, ill


def _surface_rows(volume):
    """[D, W] index of the first row brighter than the nerve fibre layer's half (the inner surface)."""
    return np.argmax(volume > 0.4, axis=1)


def _epithelium_rows(volume):
    """[D, W] index of the last row brighter than the choroid ever is: the pigment epithelium's base."""
    return volume.shape[1] - 1 - np.argmax(volume[:, ::-1] > 0.7, axis=1)


def test_the_lesion_task_keeps_generator_version_2s_options_and_pixels():
    # Cohorts written before tasks existed (the quickstart's, the evaluation's)
    # must keep their cache folder and bytes: their options have no task key,
    # and the volumes match what generator version 2 drew (sha256 taken then).
    options = cohort_options(120, seed=1, with_labels=True)
    assert "task" not in options and cohort_key(options) == "7c14e970e202"
    assert cohort_options(120, seed=1, with_labels=True, task="lesion", finding_scale=1.0) == options
    pinned = {(False, "heidelberg"): "d7b9b7103ba238ef", (False, "zeiss"): "c764e53fd6bc7288",
              (True, "heidelberg"): "1f4947166cff03cb", (True, "zeiss"): "e6264d4017819bc0"}
    for (lesion, vendor), digest in pinned.items():
        volume = synthetic_volume(np.random.default_rng([7, 1]), (4, 24, 16), PROFILES[vendor], lesion=lesion)
        assert hashlib.sha256(volume.tobytes()).hexdigest()[:16] == digest


def test_each_task_and_scale_has_its_own_cache_key():
    keys = {cohort_key(cohort_options(12, with_labels=True, task=task)) for task in TASKS}
    keys.add(cohort_key(cohort_options(12, with_labels=True, task="fluid", finding_scale=1.2)))
    keys.add(cohort_key(cohort_options(12, with_labels=True, finding_scale=0.8)))
    assert len(keys) == len(TASKS) + 2


def test_tasks_and_scales_need_labels_and_known_names():
    with pytest.raises(ValueError, match="need with_labels"):
        cohort_options(4, task="fluid")
    with pytest.raises(ValueError, match="need with_labels"):
        cohort_options(4, finding_scale=2.0)
    with pytest.raises(ValueError, match="unknown synthetic task 'drusen'"):
        cohort_options(4, with_labels=True, task="drusen")
    with pytest.raises(ValueError, match="finding_scale must be > 0"):
        cohort_options(4, with_labels=True, finding_scale=0.0)


def test_fluid_is_a_dark_pocket_on_a_flat_pigment_epithelium_under_a_lifted_retina():
    healthy, fluid = _healthy_and("fluid")
    # The pigment epithelium stays where it was in every A-scan.
    assert np.array_equal(_epithelium_rows(healthy), _epithelium_rows(fluid))
    lifted = _surface_rows(healthy) - _surface_rows(fluid)
    assert lifted.min() >= 0 and lifted.max() >= 0.15 * CLEAN.shape[1]  # about the dome's height
    # Where the retina is lifted most, the A-scan above the epithelium holds a
    # run of voxels that reflect nothing; the healthy retina has none there.
    d, w = np.unravel_index(np.argmax(lifted), lifted.shape)
    rpe = int(_epithelium_rows(fluid)[d, w])
    for volume, expected in ((fluid, True), (healthy, False)):
        column = volume[d, _surface_rows(volume)[d, w]:rpe, w]
        dark = column < 0.02
        longest = max((len(run) for run in "".join("1" if v else "0" for v in dark).split("0")), default=0)
        assert (longest >= 0.1 * CLEAN.shape[1]) is expected


def test_thinning_sinks_the_inner_surface_over_a_region_and_leaves_the_outer_layers():
    healthy, thinned = _healthy_and("thinning")
    assert np.array_equal(_epithelium_rows(healthy), _epithelium_rows(thinned))
    sunk = _surface_rows(thinned) - _surface_rows(healthy)
    # 70 % of the outer nuclear layer (9 % of H) at the centre: about 8 of 128 rows.
    assert sunk.min() >= -1 and sunk.max() >= 6
    # A region, not a line: a good part of the scan is thinner by 3 rows or more.
    assert 0.05 < (sunk >= 3).mean() < 0.8


def test_the_finding_task_labels_four_classes_each_with_its_own_finding(tmp_path):
    files = _cohort(tmp_path, 16, with_labels=True, task="finding", seed=2)
    cohort = read_cohort(tmp_path)
    assert cohort["options"]["task"] == "finding" and set(cohort["labels"]) == {0, 1, 2, 3}
    dataset = DicomDataset.from_location(tmp_path / "manifest.jsonl")
    assert [dataset.load(i).provenance.label for i in range(len(files))] == cohort["labels"]
    # The same seed with the binary fluid task draws other findings into other files.
    fluid = _cohort(tmp_path / "fluid", 16, with_labels=True, task="fluid", seed=2)
    assert set(read_cohort(tmp_path / "fluid")["labels"]) == {0, 1}
    assert Path(fluid[0]).read_bytes() != Path(files[0]).read_bytes()


def test_a_complete_cohort_is_reused_without_writing(tmp_path):
    files = _cohort(tmp_path)
    before = {p: os.stat(p).st_mtime_ns for p in files}
    assert _cohort(tmp_path) == files
    assert {p: os.stat(p).st_mtime_ns for p in files} == before


@pytest.mark.parametrize("damage", ["no-record", "missing-file", "short-file"])
def test_a_half_written_cohort_is_rewritten(tmp_path, damage):
    files = _cohort(tmp_path)
    original = Path(files[2]).read_bytes()
    if damage == "no-record":
        (tmp_path / "cohort.json").unlink()
    elif damage == "missing-file":
        Path(files[2]).unlink()
    else:
        Path(files[2]).write_bytes(original[:100])
    assert _cohort(tmp_path) == files
    assert Path(files[2]).read_bytes() == original
    assert read_cohort(tmp_path) is not None


def test_other_options_rewrite_the_folder_and_drop_stale_files(tmp_path):
    old = _cohort(tmp_path, 6)
    new = _cohort(tmp_path, 3)
    assert new == old[:3]
    assert not any(Path(p).exists() for p in old[3:])
    assert read_cohort(tmp_path)["options"]["n_volumes"] == 3


def test_unknown_domain_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown synthetic domains"):
        write_synthetic_cohort(tmp_path, 2, domains=("heidelberg", "canon"))


# --- the dicom dataset ----------------------------------------------------


def test_folder_dataset_lists_loads_and_counts_domains(tmp_path):
    files = _cohort(tmp_path, 7)
    dataset = DicomDataset.from_location(tmp_path)
    assert isinstance(dataset, Dataset)
    assert len(dataset) == 7
    assert sorted(dataset.url(i) for i in range(7)) == sorted(files)
    sample = dataset.load(0)
    assert sample.volume.dtype == np.float32 and sample.volume.ndim == 3
    assert dataset.domain(0) == sample.provenance.domain
    assert dataset.domain_counts() == {"heidelberg": 3, "topcon": 2, "zeiss": 2}


def test_corrupt_files_count_as_unknown_domain_and_fail_to_load(tmp_path):
    _cohort(tmp_path, 4, corrupt_fraction=1.0)
    dataset = DicomDataset.from_location(tmp_path, domain_from="folder")
    assert dataset.domain_counts() == {"heidelberg": 2, "topcon": 1, "zeiss": 1}
    header_dataset = DicomDataset.from_location(tmp_path)
    counts = header_dataset.domain_counts()
    assert counts["unknown"] == 1  # the file that is not DICOM at all
    for index in range(len(dataset)):
        with pytest.raises(CorruptFile):
            dataset.load(index)


def test_reading_headers_in_threads_leaves_the_warning_filters_as_they_were(tmp_path):
    # Headers are read in a thread pool, and warnings.catch_warnings() is not
    # thread-safe: interleaved threads used to leave "ignore" installed for the
    # whole process, hiding every later warning (the prepared cache's "cannot
    # write" in tests/test_data_cache.py never reached pytest.warns).
    _cohort(tmp_path / "cohort", 24)
    before = list(warnings.filters)
    for _ in range(5):
        DicomDataset.from_location(tmp_path / "cohort").domain_counts()  # listing: headers in threads
        DicomDataset.from_location(tmp_path / "cohort" / "manifest.jsonl").domain_counts()  # domains in threads
        assert warnings.filters == before


def test_folder_listing_filters_extensions_hidden_files_and_dicomdir(tmp_path):
    volume = _volume()
    for name in ["a.dcm", "b.DCM", "1.2.840.113619.2.55", "noext", "sub/c.dcm"]:
        write_oct_dicom(tmp_path / name, volume, (1, 1, 1), "Zeiss", "Cirrus")
    for name in ["notes.txt", ".hidden.dcm", "DICOMDIR", ".cache/d.dcm"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    names = [Path(p).relative_to(tmp_path).as_posix() for p in list_dicom_files(str(tmp_path))]
    assert names == ["1.2.840.113619.2.55", "a.dcm", "b.DCM", "noext", "sub/c.dcm"]
    only_dcm = DicomDataset.from_location(tmp_path, extensions=(".dcm",))
    assert len(only_dcm) == 3


def test_glob_selects_files(tmp_path):
    _cohort(tmp_path, 6)
    dataset = DicomDataset.from_location(str(tmp_path / "topcon" / "*.dcm"))
    assert len(dataset) == 2
    assert dataset.domain_counts() == {"topcon": 2}


def test_domain_from_folder_uses_the_parent_folder(tmp_path):
    for site in ("site-a", "site-b", "site-b"):
        write_oct_dicom(tmp_path / site / f"{uuid.uuid4().hex}.dcm", _volume(), (1, 1, 1), "Topcon", "x")
    dataset = DicomDataset.from_location(tmp_path, domain_from="folder")
    assert dataset.domain_counts() == {"site-a": 1, "site-b": 2}
    assert dataset.load(0).provenance.domain == "site-a"


def test_empty_folder_is_a_user_error_naming_it(tmp_path):
    (tmp_path / "readme.txt").write_text("no scans here")
    with pytest.raises(UserError, match=re.escape(str(tmp_path))):
        DicomDataset.from_location(tmp_path)


def test_missing_path_is_a_user_error_naming_it(tmp_path):
    with pytest.raises(UserError, match="does not exist.*nowhere"):
        DicomDataset.from_location(tmp_path / "nowhere")


def test_dataset_pickles_for_loader_workers(tmp_path):
    _cohort(tmp_path, 3, with_labels=True)
    dataset = DicomDataset.from_location(tmp_path / "manifest.jsonl")
    dataset.domain(0)
    clone = pickle.loads(pickle.dumps(dataset))
    assert len(clone) == 3
    np.testing.assert_array_equal(clone.load(1).volume, dataset.load(1).volume)
    assert clone.domain(0) == "heidelberg"


def test_dataset_over_an_fsspec_url(tmp_path):
    root = f"memory://octfw-test-{uuid.uuid4().hex}/scans"
    write_oct_dicom(f"{root}/heidelberg/a.dcm", _volume(1), (0.1, 0.01, 0.01), "Heidelberg Engineering", "S")
    write_oct_dicom(f"{root}/zeiss/b.dcm", _volume(2), (0.1, 0.01, 0.01), "Carl Zeiss Meditec", "C")
    dataset = DicomDataset.from_location(root)
    assert len(dataset) == 2
    assert all(dataset.url(i).startswith("memory://") for i in range(2))
    assert dataset.domain_counts() == {"heidelberg": 1, "zeiss": 1}
    assert dataset.load(1).provenance.spacing == pytest.approx((0.1, 0.01, 0.01))


# --- manifests ------------------------------------------------------------


def _three_scans(tmp_path):
    names = ["scans/a.dcm", "scans/b.dcm", "scans/c.dcm"]
    for i, name in enumerate(names):
        write_oct_dicom(tmp_path / name, _volume(i), (1, 1, 1), "Heidelberg Engineering", "S")
    return names


def test_csv_manifest_with_domain_split_and_label(tmp_path):
    names = _three_scans(tmp_path)
    (tmp_path / "m.csv").write_text(
        "path,domain,split,label,notes\n"
        f"{names[0]},site-a,train,1,first\n"
        f"{names[1]},site-b,val,0,\n"
        f"{tmp_path / names[2]},site-a,train,,absolute path\n"
    )
    train = DicomDataset.from_location(tmp_path / "m.csv", split="train", domain_from="manifest")
    assert len(train) == 2
    assert train.domain_counts() == {"site-a": 2}
    first = train.load(0)
    assert (first.provenance.domain, first.provenance.label) == ("site-a", 1)
    assert train.load(1).provenance.label is None
    everything = DicomDataset.from_location(tmp_path / "m.csv")
    assert len(everything) == 3
    assert everything.domain_counts() == {"heidelberg": 3}  # header domains by default


def test_jsonl_manifest_with_domain_and_split(tmp_path):
    names = _three_scans(tmp_path)
    rows = [
        {"path": names[0], "domain": "topcon", "split": "test"},
        {"path": names[1], "domain": "zeiss", "split": "train", "label": 1},
        {"path": names[2], "domain": "zeiss", "split": "train", "label": None},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    train = DicomDataset.from_location(tmp_path / "m.jsonl", split="train", domain_from="manifest")
    assert [train.domain(i) for i in range(len(train))] == ["zeiss", "zeiss"]
    assert [train.label(i) for i in range(len(train))] == [1, None]
    with pytest.raises(UserError, match="no rows with split 'val'"):
        DicomDataset.from_location(tmp_path / "m.jsonl", split="val")


def test_manifest_without_domains_cannot_supply_them(tmp_path):
    names = _three_scans(tmp_path)
    (tmp_path / "m.csv").write_text("path,domain\n" + f"{names[0]},a\n{names[1]},\n")
    with pytest.raises(UserError, match="1 rows have no domain"):
        DicomDataset.from_location(tmp_path / "m.csv", domain_from="manifest")


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("m.csv", "file,domain\na.dcm,x\n", "no 'path' column"),
        ("m.csv", "path,label\na.dcm,yes\n", r"m.csv:2: label must be an integer"),
        ("m.jsonl", '{"path": "a.dcm"}\n{oops\n', r"m.jsonl:2: not valid JSON"),
        ("m.jsonl", '{"path": ""}\n', r"m.jsonl:1: empty path"),
    ],
)
def test_malformed_manifests_are_user_errors_naming_the_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError, match=message):
        DicomDataset.from_location(tmp_path / name)


def test_split_without_a_manifest_is_a_user_error(tmp_path):
    _cohort(tmp_path, 2)
    with pytest.raises(UserError, match="split needs a manifest"):
        DicomDataset.from_location(tmp_path, split="train")


def test_missing_manifest_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="manifest not found"):
        DicomDataset.from_location(tmp_path / "absent.csv")


# --- components -----------------------------------------------------------


def test_all_components_register_with_documented_configs():
    registry = load_registry(entry_points=[])
    assert registry.names("dataset") == ["dicom", "oct-vendor", "phantom-oct", "prepared", "synthetic-oct"]
    for name in registry.names("dataset"):
        component = registry.get("dataset", name)
        for field in attrs.fields(component.config):
            assert field.metadata.get("doc"), f"{name}.{field.name} has no doc"


def test_synthetic_oct_component_writes_to_the_cache_and_reads_it_as_dicom(tmp_path):
    registry = load_registry(entry_points=[])
    component = registry.get("dataset", "synthetic-oct")
    config = component.config(n_volumes=5, corrupt_fraction=0.2, labels=True)
    dataset = component.build(config, _ctx(tmp_path, seed=4))
    assert isinstance(dataset, DicomDataset)
    assert len(dataset) == 5
    (folder,) = (tmp_path / "cache" / "synthetic-oct").iterdir()
    assert read_cohort(folder)["options"]["seed"] == 4  # the run's seed by default
    loaded, failed = 0, 0
    for index in range(len(dataset)):
        try:
            sample = dataset.load(index)
            assert sample.provenance.label in (0, 1)
            loaded += 1
        except CorruptFile:
            failed += 1
    assert (loaded, failed) == (4, 1)
    # A second build reuses the same cohort.
    again = component.build(config, _ctx(tmp_path, seed=4))
    assert [again.url(i) for i in range(5)] == [dataset.url(i) for i in range(5)]


def test_synthetic_oct_component_honours_folder_and_seed(tmp_path):
    registry = load_registry(entry_points=[])
    component = registry.get("dataset", "synthetic-oct")
    config = component.config(n_volumes=2, domains=("zeiss",), seed=9, folder=str(tmp_path / "mine"))
    dataset = component.build(config, _ctx(tmp_path))
    assert dataset.domain_counts() == {"zeiss": 2}
    assert read_cohort(tmp_path / "mine")["options"]["seed"] == 9


def test_dicom_component_builds_from_a_folder(tmp_path):
    _cohort(tmp_path / "data", 3)
    registry = load_registry(entry_points=[])
    component = registry.get("dataset", "dicom")
    dataset = component.build(component.config(path=str(tmp_path / "data"), domain_from="folder"), _ctx(tmp_path))
    assert dataset.domain_counts() == {"heidelberg": 1, "topcon": 1, "zeiss": 1}


@pytest.mark.parametrize(
    "component, options, message",
    [
        ("synthetic-oct", {"domains": ("heidelberg", "canon")}, "unknown domains"),
        ("synthetic-oct", {"domains": ()}, "at least one domain"),
        ("synthetic-oct", {"corrupt_fraction": 1.5}, r"must be in \[0.0, 1.0\]"),
        ("synthetic-oct", {"n_volumes": 0}, "must be > 0"),
        ("synthetic-oct", {"labels": True, "task": "drusen"}, "must be one of lesion, fluid"),
        ("synthetic-oct", {"task": "fluid"}, "only with labels = true"),
        ("synthetic-oct", {"finding_scale": 2.0}, "only with labels = true"),
        ("synthetic-oct", {"labels": True, "finding_scale": 0.0}, "must be > 0"),
        ("dicom", {"path": "x", "domain_from": "vendor"}, "must be one of"),
        ("dicom", {"path": "x", "extensions": ("dcm",)}, "start with '.'"),
    ],
)
def test_configs_refuse_bad_values(component, options, message):
    registry = load_registry(entry_points=[])
    with pytest.raises(ValueError, match=message):
        registry.get("dataset", component).config(**options)


def test_plugin_modules_import_without_heavy_packages():
    code = (
        "import sys, octfw.plugins.datasets.dicom.config, octfw.plugins.datasets.dicom, octfw.plugins.datasets.prepared, "
        "octfw.plugins.datasets.synthetic, octfw.plugins.datasets.phantom, octfw.plugins.datasets.vendor\n"
        "heavy = [m for m in ('torch', 'pydicom', 'gcsfs', 'fsspec', 'torch_xla', 'oct_converter') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


# --- series of single-frame files -------------------------------------------


def _write_series(folder, volume, *, series_uid="1.2.3.4.5", manufacturer="Heidelberg Engineering",
                  order=None, instance_numbers=True, positions=False, spacing=(0.2, 0.01, 0.02),
                  names=None):
    """One single-frame OPT file per B-scan, written in a shuffled file-name order."""
    import io

    from octfw.dicom.writing import encode_oct_dicom

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    order = list(order if order is not None else range(len(volume)))
    paths = []
    for slot, frame in enumerate(order):
        data = encode_oct_dicom(volume[frame:frame + 1], spacing, manufacturer, "S")
        ds = pydicom.dcmread(io.BytesIO(data))
        ds.SeriesInstanceUID = series_uid
        if instance_numbers:
            ds.InstanceNumber = frame + 1
        else:
            del ds.InstanceNumber
        if positions:
            ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
            ds.ImagePositionPatient = [0.0, 0.0, 5.0 + spacing[0] * frame]
            del ds.SpacingBetweenSlices
            del ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].SpacingBetweenSlices
            del ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].SliceThickness
        name = names[slot] if names else f"img{slot:03d}.dcm"
        ds.save_as(folder / name, enforce_file_format=True)
        paths.append(folder / name)
    return paths


def test_single_frame_files_of_one_series_are_one_volume_in_instance_order(tmp_path):
    volume = _volume(4, shape=(5, 12, 10))
    _write_series(tmp_path / "heidelberg" / "scan1", volume, order=[3, 0, 4, 1, 2])
    write_oct_dicom(tmp_path / "heidelberg" / "multi.dcm", _volume(5), (0.1, 0.01, 0.01),
                    "Heidelberg Engineering", "S")
    dataset = DicomDataset.from_location(tmp_path)
    assert len(dataset) == 2
    index = [dataset.source(i) for i in range(2)].index(str(tmp_path / "heidelberg" / "scan1"))
    assert dataset.is_series(index) and not dataset.is_series(1 - index)
    sample = dataset.load(index)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))
    assert sample.provenance.source == str(tmp_path / "heidelberg" / "scan1")
    assert sample.provenance.spacing == pytest.approx((0.2, 0.01, 0.02))
    assert sample.provenance.original_shape == (5, 12, 10)
    assert sample.provenance.domain == "heidelberg"
    assert dataset.domain_counts() == {"heidelberg": 2}


def test_series_without_instance_numbers_are_ordered_by_position_and_spaced_by_it(tmp_path):
    volume = _volume(6, shape=(4, 10, 10))
    _write_series(tmp_path / "s", volume, order=[2, 0, 3, 1], instance_numbers=False,
                  positions=True, spacing=(0.25, 0.01, 0.02))
    dataset = DicomDataset.from_location(tmp_path)
    sample = dataset.load(0)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))
    assert sample.provenance.spacing == pytest.approx((0.25, 0.01, 0.02))


def test_two_series_in_one_folder_are_two_volumes_and_a_lone_frame_stays_a_file(tmp_path):
    _write_series(tmp_path / "f", _volume(1, (3, 8, 8)), series_uid="1.2.3.1", names=["a1", "a2", "a3"])
    _write_series(tmp_path / "f", _volume(2, (2, 8, 8)), series_uid="1.2.3.2", names=["b1", "b2"])
    _write_series(tmp_path / "f", _volume(3, (1, 8, 8)), series_uid="1.2.3.3", names=["c1"])
    dataset = DicomDataset.from_location(tmp_path, extensions=("",))
    sources = [dataset.source(i) for i in range(len(dataset))]
    assert str(tmp_path / "f" / "c1") in sources
    lone = sources.index(str(tmp_path / "f" / "c1"))
    shapes = sorted(dataset.load(i).provenance.original_shape for i in range(len(dataset)) if i != lone)
    assert shapes == [(2, 8, 8), (3, 8, 8)]
    with pytest.raises(CorruptFile, match="single-frame 2D image"):  # one B-scan is no volume
        dataset.load(lone)
    assert sum(s.startswith(f"{tmp_path / 'f'}#series-") for s in sources) == 2
    assert "1.2.3" not in " ".join(sources)  # the UID itself is never part of a URL


def test_series_false_keeps_every_file_a_volume(tmp_path):
    _write_series(tmp_path / "s", _volume(1, (3, 8, 8)))
    assert len(DicomDataset.from_location(tmp_path, series=False)) == 3


def test_a_series_with_one_bad_frame_is_quarantined_by_its_folder(tmp_path):
    paths = _write_series(tmp_path / "s", _volume(1, (4, 8, 8)))
    data = paths[2].read_bytes()
    paths[2].write_bytes(data[: len(data) - 40])  # cut inside the pixel data
    dataset = DicomDataset.from_location(tmp_path)
    assert len(dataset) == 1
    with pytest.raises(CorruptFile) as info:
        dataset.load(0)
    assert info.value.url == str(tmp_path / "s")
    assert "img002.dcm" in info.value.reason and "truncated" in info.value.reason


def test_a_constant_series_and_frames_of_different_sizes_are_corrupt(tmp_path):
    _write_series(tmp_path / "flat", np.full((3, 8, 8), 7, np.uint16))
    with pytest.raises(CorruptFile, match="constant volume"):
        DicomDataset.from_location(tmp_path / "flat").load(0)
    _write_series(tmp_path / "mixed", _volume(1, (2, 8, 8)), names=["a.dcm", "b.dcm"])
    _write_series(tmp_path / "mixed", _volume(1, (1, 8, 6)), names=["c.dcm"])
    with pytest.raises(CorruptFile, match="frames differ in size"):
        DicomDataset.from_location(tmp_path / "mixed").load(0)


def test_a_manifest_row_ending_in_a_slash_is_a_series(tmp_path):
    volume = _volume(9, (3, 8, 8))
    _write_series(tmp_path / "scans" / "s1", volume, order=[1, 2, 0])
    (tmp_path / "m.csv").write_text("path,domain,label\nscans/s1/,topcon,1\n")
    dataset = DicomDataset.from_location(tmp_path / "m.csv", domain_from="manifest")
    sample = dataset.load(0)
    np.testing.assert_array_equal(sample.volume, volume.astype(np.float32))
    assert sample.provenance.source == f"{tmp_path}/scans/s1"
    assert (sample.provenance.domain, sample.provenance.label) == ("topcon", 1)


def test_domain_from_folder_names_the_folder_that_holds_the_series(tmp_path):
    _write_series(tmp_path / "zeiss" / "visit1", _volume(1, (2, 8, 8)))
    assert DicomDataset.from_location(tmp_path, domain_from="folder").domain(0) == "zeiss"
