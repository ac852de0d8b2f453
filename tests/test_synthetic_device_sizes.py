"""Synthetic cohorts at device sizes: 8-bit volumes of the sizes devices
export, written and read back as DICOM; the small cohorts left as they were."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import numpy as np
import pydicom
import pytest

from octfw.dicom.decoding import read_oct_volume
from octfw.dicom.header import read_header
from octfw.dicom.writing import encode_oct_dicom
from octfw.plugins.datasets.synthetic.cohort import cohort_key, cohort_options, read_cohort, write_synthetic_cohort
from octfw.plugins.datasets.synthetic.corruption import CORRUPTION_KINDS
from octfw.plugins.datasets.synthetic.rendering import _LOG_FLOOR
from octfw.plugins.datasets.synthetic.retina import synthetic_volume
from octfw.plugins.datasets.synthetic.vendors import DEVICE_PROFILES, PROFILES, VendorProfile
from octfw.plugins.datasets.synthetic.config import SyntheticOctConfig
from octfw.display.errors import CorruptFile, UserError
from octfw.recipe import load_recipe

from conftest import TINY_RECIPE

DEVICE_SHAPES = {"heidelberg": (49, 496, 512), "topcon": (128, 885, 512), "zeiss": (128, 1024, 512)}
TINY = {"heidelberg": (3, 20, 16), "topcon": (2, 18, 14), "zeiss": (4, 22, 12)}


@pytest.fixture(scope="module")
def device_cohort(tmp_path_factory):
    """One volume of each vendor at its device size (about 3 s to write)."""
    folder = tmp_path_factory.mktemp("device")
    return write_synthetic_cohort(folder, 3, seed=4, sizes="device")


# --- "small" stays as it was ----------------------------------------------


def test_small_options_and_cache_keys_are_those_before_sizes_existed():
    # Options and keys taken before the sizes option was added.
    options = cohort_options(32)
    assert options == {
        "version": 2, "n_volumes": 32, "domains": ["heidelberg", "topcon", "zeiss"],
        "shapes": {"heidelberg": [24, 96, 64], "topcon": [16, 80, 80], "zeiss": [20, 64, 96]},
        "seed": 0, "corrupt_fraction": 0.0, "with_labels": False,
    }
    assert cohort_key(options) == "faa6acfa9644"
    assert cohort_key(cohort_options(32, with_labels=True)) == "e3866edbf060"
    assert cohort_key(cohort_options(32, with_labels=True, task="finding", finding_scale=1.5)) == "516e8ef3d4d9"
    assert cohort_options(32, sizes="small") == options
    assert SyntheticOctConfig().sizes == "small"
    assert all(profile.bits == 16 for profile in PROFILES.values())


def test_device_sizes_have_their_own_options_and_key():
    options = cohort_options(3, sizes="device")
    assert options["sizes"] == "device"
    assert options["shapes"] == {domain: list(shape) for domain, shape in DEVICE_SHAPES.items()}
    assert cohort_key(options) != cohort_key(cohort_options(3))
    with pytest.raises(ValueError, match="unknown synthetic sizes 'huge'"):
        cohort_options(3, sizes="huge")


# --- 8-bit DICOM ----------------------------------------------------------


def test_uint8_volumes_round_trip_through_dicom_exactly(tmp_path):
    # An odd number of bytes: the pixel data is padded to even length.
    volume = np.random.default_rng(1).integers(0, 256, size=(3, 5, 7), dtype=np.uint8)
    path = tmp_path / "eight.dcm"
    path.write_bytes(encode_oct_dicom(volume, (0.1, 0.01, 0.02), "Carl Zeiss Meditec", "Cirrus"))
    header = pydicom.dcmread(path, stop_before_pixels=True)
    assert (header.BitsAllocated, header.BitsStored, header.HighBit) == (8, 8, 7)
    sample = read_oct_volume(path)
    assert sample.volume.dtype == np.float32
    assert np.array_equal(sample.volume, volume.astype(np.float32))
    assert sample.provenance.spacing == pytest.approx((0.1, 0.01, 0.02))


def test_other_dtypes_are_refused():
    for dtype in (np.int16, np.float32, np.uint32):
        with pytest.raises(ValueError, match="uint16 or uint8"):
            encode_oct_dicom(np.ones((2, 4, 4), dtype=dtype), (1.0, 1.0, 1.0), "x", "y")


# --- device cohorts -------------------------------------------------------


def test_device_files_have_device_shapes_8_bits_and_spacing(device_cohort):
    for path, domain in zip(device_cohort, ("heidelberg", "topcon", "zeiss")):
        header = read_header(path)
        assert header["domain"] == domain
        assert (header["number_of_frames"], header["rows"], header["columns"]) == DEVICE_SHAPES[domain]
        dataset = pydicom.dcmread(path, stop_before_pixels=True)
        assert (dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit) == (8, 8, 7)
        assert Path(path).stat().st_size > math.prod(DEVICE_SHAPES[domain])  # 8 bits a voxel, and a header
    # Heidelberg's is the smallest (12 M voxels): read it whole.
    sample = read_oct_volume(device_cohort[0])
    assert sample.provenance.spacing == pytest.approx(DEVICE_PROFILES["heidelberg"].spacing)
    assert sample.provenance.spacing == pytest.approx((0.12, 0.0039, 0.0113))


def test_reading_back_gives_the_voxels_generated(device_cohort):
    # Volume 0 is drawn from a generator seeded (seed, 0); unlabelled, nothing else is drawn first.
    profile = DEVICE_PROFILES["heidelberg"]
    volume = synthetic_volume(np.random.default_rng([4, 0]), profile.shape, profile)
    assert volume.dtype == np.uint8 and volume.shape == DEVICE_SHAPES["heidelberg"]
    assert np.array_equal(read_oct_volume(device_cohort[0]).volume, volume.astype(np.float32))


def test_device_cohorts_are_deterministic_and_break_as_asked(tmp_path):
    first = write_synthetic_cohort(tmp_path / "a", 4, seed=2, sizes="device", shapes=TINY, corrupt_fraction=1.0)
    second = write_synthetic_cohort(tmp_path / "b", 4, seed=2, sizes="device", shapes=TINY, corrupt_fraction=1.0)
    assert [Path(p).read_bytes() for p in first] == [Path(p).read_bytes() for p in second]
    reasons = {}
    for path, item in zip(first, read_cohort(tmp_path / "a")["files"]):
        with pytest.raises(CorruptFile) as info:
            read_oct_volume(path)
        reasons[item["corrupt"]] = info.value.reason
    assert sorted(reasons) == sorted(CORRUPTION_KINDS)
    assert reasons["no-pixel-data"] == "no PixelData element"  # 8-bit pixels are OB, not OW
    assert reasons["truncated"].startswith("truncated pixel data")
    assert reasons["constant"].startswith("constant volume")


def test_device_files_do_not_share_the_small_files_uids(tmp_path):
    small = write_synthetic_cohort(tmp_path / "small", 1, seed=2, shapes=TINY)
    device = write_synthetic_cohort(tmp_path / "device", 1, seed=2, shapes=TINY, sizes="device")
    uid = lambda path: pydicom.dcmread(path, stop_before_pixels=True).SOPInstanceUID  # noqa: E731
    assert uid(small[0]) != uid(device[0])


# --- the 8-bit rendering ----------------------------------------------------

# Speckle-free, noise-free, no offset: the 16-bit volume is the signal x 20000.
CLEAN = VendorProfile("test", "clean", (5, 160, 48), (0.3, 0.0125, 0.125), gain=1.0, offset=0.0,
                      looks=1e9, noise=0.0)


@pytest.mark.parametrize("finding", [None, "lesion", "fluid", "thinning"])
def test_8_bit_volumes_are_the_16_bit_retina_log_compressed(finding):
    # The fast float32 rendering draws the same retina, finding included:
    # mapping the exact 16-bit one to 8 bits gives it within one level.
    exact = synthetic_volume(np.random.default_rng(3), CLEAN.shape, CLEAN, finding=finding).astype(np.float64)
    fast = synthetic_volume(np.random.default_rng(3), CLEAN.shape, attrs.evolve(CLEAN, bits=8), finding=finding)
    assert fast.dtype == np.uint8
    expected = 255 * np.log(np.maximum(exact, _LOG_FLOOR) / _LOG_FLOOR) / math.log(65535 / _LOG_FLOOR)
    assert np.abs(fast - np.clip(expected, 0, 255)).max() <= 1.0
    assert fast.max() > 200 and fast.min() == 0  # bright layers, empty vitreous


def _blocks(volume):
    """Means over blocks of 7 x 16 x 32 voxels: the speckle averages out."""
    d, h, w = volume.shape
    trimmed = volume[: d // 7 * 7, : h // 16 * 16, : w // 32 * 32].astype(np.float32)
    return trimmed.reshape(d // 7, 7, h // 16, 16, w // 32, 32).mean(axis=(1, 3, 5))


@pytest.mark.parametrize("finding", ["lesion", "fluid", "thinning"])
def test_findings_show_in_device_sized_volumes(finding):
    profile = DEVICE_PROFILES["heidelberg"]
    healthy = _blocks(synthetic_volume(np.random.default_rng(5), profile.shape, profile))
    ill = _blocks(synthetic_volume(np.random.default_rng(5), profile.shape, profile, finding=finding))
    changed = np.abs(ill - healthy) > 10  # grey levels, over 3584 voxels
    assert 0.005 < changed.mean() < 0.2  # a region of the scan, not all of it
    assert np.median(np.abs(ill - healthy)) < 1  # elsewhere the same retina
    if finding == "lesion":
        assert (ill - healthy).max() > 40 and (ill - healthy).min() > -5  # brighter only
    if finding == "fluid":
        assert (ill - healthy).min() < -60  # an optically empty pocket


# --- the recipe -------------------------------------------------------------


def _recipe_with(write_recipe, line):
    old = 'name = "synthetic-oct"\nn_volumes = 8\n'
    assert old in TINY_RECIPE
    return write_recipe(TINY_RECIPE.replace(old, old + line + "\n", 1))


def test_the_recipe_accepts_device_sizes(write_recipe, registry):
    recipe = load_recipe(_recipe_with(write_recipe, 'sizes = "device"'), (), registry)
    assert recipe.dataset.config.sizes == "device"


def test_the_recipe_refuses_unknown_sizes_naming_the_key(write_recipe, registry):
    with pytest.raises(UserError) as info:
        load_recipe(_recipe_with(write_recipe, 'sizes = "huge"'), (), registry)
    assert "dataset.sizes: must be one of 'small', 'device', got 'huge'" in str(info.value)
