"""Retinal layer labels from the generators (issue #51 item 1).

``synthetic-oct`` and every ``phantom-oct`` family write, beside each volume, the uint8
label of its layers, computed from the boundaries the intensities are drawn at; the
manifest names the file, ``oct-standard`` brings it to the prepared geometry by nearest
label, and ``octfw prepare`` stores it beside the volume. Small volumes throughout.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import attrs
import numpy as np
import pytest

from octfw.dicom.dataset import DicomDataset
from octfw.dicom.manifest import ManifestRow, read_manifest, write_manifest
from octfw.dicom.writing import write_oct_dicom
from octfw.plugins.datasets.phantom import cohort as phantom_cohort
from octfw.plugins.datasets.phantom.cohort import family_module, write_phantom_cohort
from octfw.plugins.datasets.phantom.devices import Vendor
from octfw.plugins.datasets.synthetic import retina as synthetic_retina
from octfw.plugins.datasets.synthetic.cohort import LAYERS_VERSION, read_cohort, write_synthetic_cohort
from octfw.plugins.datasets.synthetic.labels import LAYER_NAMES
from octfw.plugins.datasets.synthetic.retina import synthetic_volume, synthetic_volume_and_layers
from octfw.plugins.datasets.synthetic.vendors import DEVICE_PROFILES, PROFILES
from octfw.registry import load_registry
from octfw.types import BuildContext, LabelPreparingTransform, LayeredDataset

FAMILIES = ("tuning", "held-out", "context")


def _sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]


def _transform(image=(8, 16, 16), **options):
    registry = load_registry(entry_points=[])
    component = registry.get("transform", "oct-standard")
    ctx = BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0, patch_size=(2, 4, 4))
    return component.build(component.config(image_size=list(image), **options), ctx)


# --- the volumes stay what they were -------------------------------------------------------------

#: Checksums of volumes (and phantom finding masks) computed before layer labels existed.
SYNTHETIC_BEFORE = {None: "84e1e00607feab7e", "lesion": "ba521b24dc68fd82", "fluid": "df7ed62e65085e32",
                    "thinning": "1d88dddf2c6df6cc"}
PHANTOM_BEFORE = {
    ("tuning", False): ("7397a7fe190bc5d6", "dd493585bde88d53"),
    ("tuning", True): ("965248e12cb6011c", "f259cd3b07e55bed"),
    ("held-out", False): ("ae0c040879d6c19f", "d8f9bd8c98a6078a"),
    ("held-out", True): ("d5a3316c098718f6", "75ae49f9d1bf488c"),
    ("context", False): ("41627016e6991bb8", "e530cdbfee69c043"),
    ("context", True): ("4d4d9e75656c88d8", "87405444ddc7e38c"),
}


def test_volumes_are_bit_identical_to_those_drawn_before_layer_labels():
    for finding, expected in SYNTHETIC_BEFORE.items():
        rng = lambda: np.random.default_rng([3, 1])  # noqa: E731
        assert _sha(synthetic_volume(rng(), (6, 48, 20), PROFILES["topcon"], finding=finding)) == expected
        volume, labels = synthetic_volume_and_layers(rng(), (6, 48, 20), PROFILES["topcon"], finding=finding)
        assert _sha(volume) == expected and labels.shape == volume.shape
    eight_bit = synthetic_volume(np.random.default_rng([3, 1]), (3, 40, 24), DEVICE_PROFILES["zeiss"],
                                 finding="thinning")
    assert _sha(eight_bit) == "f91817aa5e3105e9"
    for (family, positive), (volume_sha, mask_sha) in PHANTOM_BEFORE.items():
        module = family_module(family)
        anatomy = module.draw_patient(np.random.default_rng([5, 1]))
        volume, mask, labels = module.render_labelled(np.random.default_rng([5, 1, 2]), anatomy, module.VENDORS[1],
                                                      mirrored=True, positive=positive, finding_scale=1.0)
        assert (_sha(volume), _sha(mask)) == (volume_sha, mask_sha)
        assert labels.dtype == np.uint8 and labels.shape == volume.shape


# --- the labels' conventions -----------------------------------------------------------------------


def _all_labelled():
    """(names, labels) of a volume of each generator and finding."""
    for finding in (None, "lesion", "fluid", "thinning"):
        _volume, labels = synthetic_volume_and_layers(np.random.default_rng([1, 2]), (5, 64, 24),
                                                      PROFILES["heidelberg"], finding=finding)
        yield f"synthetic {finding}", LAYER_NAMES, labels
    for family in FAMILIES:
        module = family_module(family)
        for vendor in module.VENDORS:
            for positive in (False, True):
                anatomy = module.draw_patient(np.random.default_rng([2, 3]))
                _v, _m, labels = module.render_labelled(np.random.default_rng([2, 3, 1]), anatomy, vendor,
                                                        mirrored=positive, positive=positive, finding_scale=1.0)
                yield f"{family} {vendor.name} {positive}", module.LAYER_NAMES, labels


def test_labels_run_top_to_bottom_down_every_a_scan_from_the_vitreous():
    for what, names, labels in _all_labelled():
        assert labels.dtype == np.uint8, what
        assert names[0] == "vitreous" and names[-1] == "choroid" and len(set(names)) == len(names), what
        assert int(labels.max()) < len(names), what
        assert (labels[:, 0, :] == 0).all(), what  # the vitreous on top of every A-scan
        assert (np.diff(labels.astype(np.int16), axis=1) >= 0).all(), what  # never back up an A-scan
        assert (labels[:, -1, :] == len(names) - 1).all(), what  # the choroid at the bottom


def _adjacent_means(volume: np.ndarray, labels: np.ndarray, levels: list[float]):
    """(label above, mean intensity difference below - above, drawn difference) of each pair of
    present labels next to each other."""
    present = [k for k in range(len(levels)) if (labels == k).sum() > 50]
    means = {k: float(volume[labels == k].mean()) for k in present}
    return [(a, means[b] - means[a], levels[b] - levels[a]) for a, b in zip(present, present[1:])]


def test_each_labelled_boundary_is_where_the_drawn_intensity_steps():
    # synthetic-oct: a profile with little speckle and noise, and enough voxels per layer.
    profile = attrs.evolve(PROFILES["heidelberg"], looks=200.0, noise=0.0)
    volume, labels = synthetic_volume_and_layers(np.random.default_rng(4), (4, 320, 24), profile)
    reflectivity = [0.0] + [r for _n, _t, r in synthetic_retina._LAYERS[:7]] + [0.0, 1.0, 0.3]  # SRF 0; choroid < 0.45
    pairs = _adjacent_means(volume.astype(float), labels, reflectivity)
    assert len(pairs) == len(LAYER_NAMES) - 2  # every label present but SRF (no fluid)
    for above, measured, drawn in pairs:
        assert np.sign(measured) == np.sign(drawn), (LAYER_NAMES[above], measured, drawn)
    # phantom families: each layer's level as drawn, on a fine axial grid.
    for family, window in (("held-out", 300), ("context", 400)):
        module = family_module(family)
        vendor = Vendor("fine", "fine", (4, window, 24), (0.25, 0.004, 0.25), gain=20000.0, speckle=200.0)
        anatomy = module.draw_patient(np.random.default_rng(7))
        volume, _mask, labels = module.render_labelled(np.random.default_rng(8), anatomy, vendor, mirrored=False,
                                                       positive=False, finding_scale=1.0)
        choroid = 0.3 if family == "held-out" else module.CHOROID_LEVEL
        levels = [0.0, *anatomy["levels"], choroid]
        pairs = _adjacent_means(volume.astype(float), labels, levels)
        assert len(pairs) == len(module.LAYER_NAMES) - 1, family
        for above, measured, drawn in pairs:
            assert np.sign(measured) == np.sign(drawn), (family, module.LAYER_NAMES[above], measured, drawn)


def test_fluid_is_labelled_between_the_photoreceptors_and_the_epithelium():
    _v, labels = synthetic_volume_and_layers(np.random.default_rng(11), (12, 96, 48), PROFILES["heidelberg"],
                                             finding="fluid")
    srf = LAYER_NAMES.index("SRF")
    assert (labels == srf).sum() > 20
    _v, healthy = synthetic_volume_and_layers(np.random.default_rng(11), (12, 96, 48), PROFILES["heidelberg"])
    assert not (healthy == srf).any()


def test_a_thinning_finding_thins_the_onl_label_by_the_drawn_amount():
    shape, seed = (8, 400, 40), 21
    _v, healthy = synthetic_volume_and_layers(np.random.default_rng(seed), shape, PROFILES["zeiss"])
    _v, thinned = synthetic_volume_and_layers(np.random.default_rng(seed), shape, PROFILES["zeiss"],
                                              finding="thinning")
    # The draw of the thinned region, replayed: the healthy retina's draws come first.
    rng = np.random.default_rng(seed)
    rng.uniform(size=4), rng.uniform(size=2), rng.uniform()
    z = np.linspace(-1.0, 1.0, shape[0])[:, None, None]
    x = np.linspace(-1.0, 1.0, shape[2])[None, None, :]
    lost = (synthetic_retina._THINNING_DEPTH
            * np.exp(-synthetic_retina._footprint(rng, z, x, synthetic_retina._THINNING_RADII, 1.0) ** 2))[:, 0, :]
    onl = LAYER_NAMES.index("ONL")
    before, after = (healthy == onl).sum(axis=1), (thinned == onl).sum(axis=1)
    # Voxel counts of a layer are its thickness x (H - 1) within a voxel at each end.
    assert np.abs(after - before * (1 - lost)).max() <= 2.0
    assert (before - after).max() >= 0.6 * before.max() * synthetic_retina._THINNING_DEPTH
    for other in range(len(LAYER_NAMES)):  # the other layers keep their thickness
        if other not in (onl, 0):
            assert np.abs((healthy == other).sum(axis=1) - (thinned == other).sum(axis=1)).max() <= 2, other


# --- the transform: nearest labels -----------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"fit": "crop_pad"}, {"target_spacing": [0.1, 0.05, 0.05]},
                                     {"target_spacing": [0.5, 0.01, 0.2], "fit": "crop_pad"}])
def test_labels_resampled_to_another_spacing_stay_labels_of_the_same_anatomy(tmp_path, options):
    transform = _transform(**options)
    assert isinstance(transform, LabelPreparingTransform)
    profile = PROFILES["topcon"]
    volume, labels = synthetic_volume_and_layers(np.random.default_rng(2), (10, 60, 30), profile)
    write_oct_dicom(tmp_path / "v.dcm", volume, profile.spacing, "acme", "x")
    sample = DicomDataset.from_location(str(tmp_path / "v.dcm")).load(0)
    prepared, prepared_labels = transform.prepare(sample), transform.prepare_labels(labels, sample)
    assert prepared_labels.dtype == np.uint8 and prepared_labels.shape == prepared.shape == (8, 16, 16)
    padding = {0} if options.get("fit") == "crop_pad" else set()
    assert set(np.unique(prepared_labels)) <= set(np.unique(labels)) | padding  # nearest: no new values
    # The same anatomy: the brightest layer (RPE) is bright in the prepared volume too.
    rpe = prepared_labels == LAYER_NAMES.index("RPE")
    if rpe.any():
        assert prepared[rpe].mean() > prepared[prepared_labels == 0].mean()
    with pytest.raises(Exception, match="layer labels of shape"):
        transform.prepare_labels(labels[:, :-1], sample)


def test_labels_at_the_same_geometry_come_back_unchanged(tmp_path):
    profile = PROFILES["topcon"]
    volume, labels = synthetic_volume_and_layers(np.random.default_rng(2), (8, 16, 16), profile)
    write_oct_dicom(tmp_path / "v.dcm", volume, profile.spacing, "acme", "x")
    sample = DicomDataset.from_location(str(tmp_path / "v.dcm")).load(0)
    np.testing.assert_array_equal(_transform().prepare_labels(labels, sample), labels)


# --- cohorts and manifests -------------------------------------------------------------------------

SHAPES = {"heidelberg": (4, 32, 16), "topcon": (3, 28, 20), "zeiss": (5, 24, 18)}


def test_a_synthetic_cohort_names_its_layer_labels_in_the_manifest(tmp_path):
    files = write_synthetic_cohort(tmp_path, 4, shapes=SHAPES, seed=1, with_labels=True, task="thinning")
    dataset = DicomDataset.from_location(str(tmp_path / "manifest.jsonl"), domain_from="header")
    assert isinstance(dataset, LayeredDataset) and len(dataset) == len(files) == 4
    for index in range(len(dataset)):
        assert dataset.layer_names(index) == LAYER_NAMES
        assert dataset.layers_source(index).endswith(f"{index:05d}.layers.npy")
        labels, volume = dataset.layers(index), dataset.load(index).volume
        assert labels.dtype == np.uint8 and labels.shape == volume.shape
    assert read_cohort(tmp_path)["layer_names"] == list(LAYER_NAMES)


def test_a_cohort_written_before_layer_labels_is_written_again_with_the_same_volumes(tmp_path):
    files = write_synthetic_cohort(tmp_path, 3, shapes=SHAPES, seed=2)
    before = [Path(f).read_bytes() for f in files]
    record = read_cohort(tmp_path)
    for key in ("layers_version", "layer_names", "layer_files"):
        del record[key]
    for item in [*json.loads((tmp_path / "cohort.json").read_text())["layer_files"]]:
        (tmp_path / item["path"]).unlink()
    (tmp_path / "cohort.json").write_text(json.dumps(record))
    (tmp_path / "manifest.jsonl").write_text("".join(
        json.dumps({"path": Path(f).relative_to(tmp_path).as_posix(), "domain": None, "split": None, "label": None})
        + "\n" for f in files))
    assert write_synthetic_cohort(tmp_path, 3, shapes=SHAPES, seed=2) == files  # same cache folder, same files
    assert [Path(f).read_bytes() for f in files] == before
    dataset = DicomDataset.from_location(str(tmp_path / "manifest.jsonl"))
    assert all(dataset.layers(i) is not None for i in range(3))
    assert read_cohort(tmp_path)["layers_version"] == LAYERS_VERSION


@pytest.mark.parametrize("family", FAMILIES)
def test_every_phantom_family_writes_its_layer_labels_beside_its_finding_masks(tmp_path, family):
    manifest = write_phantom_cohort(str(tmp_path), family, 2, seed=1, labels=True)
    dataset = DicomDataset.from_location(manifest, domain_from="header")
    names = family_module(family).LAYER_NAMES
    for index in range(len(dataset)):
        volume = dataset.load(index).volume
        assert dataset.mask(index).shape == volume.shape  # the finding masks as before
        assert dataset.layer_names(index) == names and dataset.layers(index).shape == volume.shape
    # A cohort of the same options without the labels' version is written again.
    record = json.loads((tmp_path / "cohort.json").read_text())
    del record["layers_version"]
    (tmp_path / "cohort.json").write_text(json.dumps(record))
    assert not phantom_cohort._is_complete(str(tmp_path), record["options"])


def test_a_manifest_without_layer_labels_still_reads_for_classification(tmp_path):
    volume = synthetic_volume(np.random.default_rng(0), (3, 20, 12), PROFILES["zeiss"])
    write_oct_dicom(tmp_path / "a.dcm", volume, (0.3, 0.03, 0.06), "acme", "x")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"path": "a.dcm", "domain": "acme", "label": 1}) + "\n")
    dataset = DicomDataset.from_location(str(tmp_path / "plain.jsonl"))
    assert dataset.label(0) == 1 and dataset.load(0).volume.shape == (3, 20, 12)
    assert dataset.layers_source(0) is None and dataset.layer_names(0) is None and dataset.layers(0) is None
    # Written again, a row without layers keeps the bytes it had.
    write_manifest(str(tmp_path / "again.jsonl"), read_manifest(str(tmp_path / "plain.jsonl")))
    assert "layers" not in (tmp_path / "again.jsonl").read_text()


def test_a_manifest_row_with_layers_needs_their_names(tmp_path):
    from octfw.display.errors import UserError

    (tmp_path / "m.jsonl").write_text(json.dumps({"path": "a.dcm", "layers": "a.layers.npy"}) + "\n")
    with pytest.raises(UserError, match="layer_names"):
        read_manifest(str(tmp_path / "m.jsonl"))
    (tmp_path / "m.csv").write_text("path,layers,layer_names\na.dcm,a.layers.npy,vitreous|NFL|choroid\n")
    [row] = read_manifest(str(tmp_path / "m.csv"))
    assert row.layer_names == ("vitreous", "NFL", "choroid") and row.layers == f"{tmp_path}/a.layers.npy"
    write_manifest(str(tmp_path / "w.jsonl"), [ManifestRow(path=str(tmp_path / "a.dcm"), layers=row.layers,
                                                           layer_names=row.layer_names)])
    assert read_manifest(str(tmp_path / "w.jsonl"))[0] == row


# --- octfw prepare ---------------------------------------------------------------------------------


def test_the_prepared_store_round_trips_the_layer_labels_bit_exactly(tmp_path, write_recipe):
    from octfw.plugins.datasets.prepared.dataset import PreparedDataset
    from test_prepared_dataset import dicom_recipe, prepare, transform_for

    write_synthetic_cohort(tmp_path / "cohort", 3, shapes=SHAPES, seed=4)
    source = DicomDataset.from_location(str(tmp_path / "cohort" / "manifest.jsonl"))
    location = tmp_path / "prepared"
    assert prepare(dicom_recipe(write_recipe, tmp_path / "cohort" / "manifest.jsonl"), location, workers=1).volumes == 3
    prepared = PreparedDataset.open(str(location))
    assert isinstance(prepared, LayeredDataset)
    transform = transform_for()
    by_source = {source.source(i): i for i in range(len(source))}
    for index in range(len(prepared)):
        original = by_source[prepared.source(index)]
        expected = transform.prepare_labels(source.layers(original), source.load(original))
        stored = prepared.layers(index)
        assert stored.dtype == np.uint8 and stored.shape == tuple(transform.image_size)
        np.testing.assert_array_equal(stored, expected)
        assert prepared.layer_names(index) == LAYER_NAMES
        # A consumer reads both datasets the same way: prepared labels come back as they are.
        np.testing.assert_array_equal(transform.prepare_labels(stored, prepared.load(index)), expected)
