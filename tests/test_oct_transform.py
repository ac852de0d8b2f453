"""The oct-standard transform: contract, preparation, augmentation, determinism, caching."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import attrs
import numpy as np
import pytest

from octfw.plugins.transforms.oct_standard import MaskConfig, OCTStandardConfig, build
from octfw.models.masks import validate_indices
from octfw.display.errors import ContractError, CorruptFile, UserError
from octfw.registry import load_registry
from octfw.types import BATCH_KEYS, BatchKey, BuildContext, Provenance, Sample, mask_keys

IMAGE = (8, 32, 32)
PATCH = (4, 8, 8)  # grid (2, 4, 4): 32 patches


def make_ctx(patch_size=PATCH, in_channels=1) -> BuildContext:
    return BuildContext(recipe_dir=Path("."), cache_dir=Path("."), run_dir=None, seed=0,
                        image_size=IMAGE, patch_size=patch_size, in_channels=in_channels)


def make_transform(**options):
    return build(OCTStandardConfig(image_size=IMAGE, **options), make_ctx())


def make_sample(shape=(6, 40, 24), spacing=(0.1, 0.01, 0.02), seed=0) -> Sample:
    volume = np.random.default_rng(seed).uniform(0.0, 200.0, shape).astype(np.float32)
    return Sample(volume, Provenance("mem://vol", "test", spacing, shape))


ALL_AUGMENTATIONS = dict(flip_prob=0.5, affine_prob=0.5, intensity_jitter=0.2,
                         augment_target=True)


# --- registration and factory ---------------------------------------------------


def test_registered_and_listing_does_not_import_torch_or_monai():
    assert load_registry(["octfw.plugins.transforms.oct_standard"], entry_points=[]).get(
        "transform", "oct-standard").config is OCTStandardConfig
    code = ("import sys, octfw.plugins.transforms.oct_standard as t; "
            "print('torch' in sys.modules, 'monai' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_build_needs_the_model_patch_size():
    with pytest.raises(UserError, match="patch_size.*transform.image_size"):
        build(OCTStandardConfig(image_size=IMAGE), make_ctx(patch_size=None))


def test_build_refuses_image_size_not_divisible_by_patch_size():
    with pytest.raises(UserError) as info:
        build(OCTStandardConfig(image_size=(8, 30, 32)), make_ctx())
    message = str(info.value)
    assert "transform.image_size [8, 30, 32]" in message and "[4, 8, 8]" in message


def test_build_refuses_a_multichannel_model():
    with pytest.raises(UserError, match="in_channels=3"):
        build(OCTStandardConfig(image_size=IMAGE), make_ctx(in_channels=3))


def test_config_refuses_bad_values():
    with pytest.raises(ValueError):
        OCTStandardConfig(percentiles=(99.0, 1.0))
    with pytest.raises(ValueError):
        OCTStandardConfig(image_size=(16, 64))
    with pytest.raises(ValueError):
        OCTStandardConfig(target_spacing=(0.05, 0.0, 0.02))
    with pytest.raises(ValueError, match="must be one of"):
        OCTStandardConfig(fit="pad")


# --- output contract ------------------------------------------------------------


@pytest.mark.parametrize("generator", ["random", "multiblock3d"])
def test_output_has_the_keys_shapes_and_dtypes_its_batch_spec_declares(generator):
    transform = make_transform(target_spacing=(0.2, 0.02, 0.02), mask=MaskConfig(generator=generator),
                               **ALL_AUGMENTATIONS)
    spec = transform.batch_spec()
    pairs = MaskConfig(generator=generator).pair_names()
    keys = ("context", "target", *(key for pair in pairs for key in mask_keys(pair)))
    assert tuple(spec) == keys
    assert keys == (BATCH_KEYS if generator == "random" else
                    ("context", "target", "context_idx_short", "target_idx_short", "context_idx_long",
                     "target_idx_long"))
    assert spec["context"] == BatchKey((1, *IMAGE), "float32", view=True)
    for seed in range(4):
        out = transform(make_sample(seed=seed), np.random.default_rng(seed))
        assert tuple(out) == keys
        for key, field in spec.items():
            assert type(out[key]) is np.ndarray  # plain arrays, no MetaTensor or tensor
            assert out[key].shape == field.shape and str(out[key].dtype) == field.dtype
        for pair in pairs:
            validate_indices(*(out[key] for key in mask_keys(pair)), 32)


def test_random_mask_counts_follow_the_ratio():
    spec = make_transform(mask=MaskConfig(ratio=0.75)).batch_spec()
    assert spec["target_idx"] == BatchKey((24,), "int64") and spec["context_idx"] == BatchKey((8,), "int64")


# --- prepare: resample, normalise, fit ---------------------------------------------


def test_resampled_shape_follows_spacing_ratios():
    transform = make_transform(target_spacing=(0.2, 0.02, 0.01))
    assert transform.resampled_shape((6, 40, 24), (0.1, 0.01, 0.02)) == (3, 20, 48)
    assert make_transform().resampled_shape((6, 40, 24), (0.1, 0.01, 0.02)) == (6, 40, 24)


def test_resampling_happens_before_crop_pad_fit():
    # crop_pad keeps the resampled size, so the non-zero block shows it.
    transform = build(
        OCTStandardConfig(image_size=(8, 24, 32), target_spacing=(0.2, 0.02, 0.04),
                          percentiles=(0.0, 100.0), fit="crop_pad", anti_aliasing=False),
        make_ctx(),
    )
    volume = np.random.default_rng(0).uniform(1.0, 2.0, (6, 40, 24)).astype(np.float32)
    sample = Sample(volume, Provenance("mem://vol", "test", (0.1, 0.01, 0.02), volume.shape))
    prepared = transform.prepare(sample)
    assert prepared.shape == (8, 24, 32)
    extent = []
    for axis in range(3):
        others = tuple(a for a in range(3) if a != axis)
        filled = np.flatnonzero(prepared.any(axis=others))
        extent.append(int(filled[-1] - filled[0]) + 1)
    assert extent == [3, 20, 12]  # (6 * 0.1/0.2, 40 * 0.01/0.02, 24 * 0.02/0.04)


def test_resize_fit_reaches_image_size_from_any_shape():
    transform = make_transform(target_spacing=(0.05, 0.02, 0.02))
    for shape in [(3, 50, 20), (12, 10, 70)]:
        assert transform.prepare(make_sample(shape=shape)).shape == IMAGE


def test_percentile_normalisation_maps_to_unit_range_and_clips_outliers():
    transform = build(OCTStandardConfig(image_size=(4, 16, 16), percentiles=(1.0, 99.0)),
                      make_ctx())
    volume = np.random.default_rng(0).uniform(0.0, 100.0, (4, 16, 16)).astype(np.float32)
    volume[0, 0, :4] = 1e6  # speckle outliers must not squash the rest
    sample = Sample(volume, Provenance("mem://vol", "test", (0.1, 0.01, 0.01), volume.shape))
    prepared = transform.prepare(sample)
    assert prepared.dtype == np.float32
    assert prepared.min() == 0.0 and prepared.max() == 1.0
    assert np.median(prepared) == pytest.approx(0.5, abs=0.05)
    assert (prepared == 1.0).sum() >= 4  # the outliers were clipped, not kept apart


def test_constant_volume_normalises_to_zeros_without_warning():
    transform = make_transform()
    sample = Sample(np.full((4, 8, 8), 7.0, np.float32), Provenance("mem://c", "t", (1, 1, 1), (4, 8, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = transform.prepare(sample)
    assert prepared.shape == IMAGE and not prepared.any()


def test_prepare_refuses_unusable_volumes_as_corrupt_files():
    transform = make_transform(target_spacing=(0.1, 0.02, 0.02))
    nan_volume = make_sample().volume.copy()
    nan_volume[0, 0, 0] = np.nan
    with pytest.raises(CorruptFile, match="non-finite"):
        transform.prepare(Sample(nan_volume, make_sample().provenance))
    with pytest.raises(CorruptFile, match="spacing"):
        transform.prepare(make_sample(spacing=(0.1, 0.0, 0.02)))


# --- augmentation, masks, determinism ------------------------------------------------


def test_same_rng_seed_gives_identical_output_and_seeds_differ():
    transform = make_transform(target_spacing=(0.2, 0.02, 0.02), **ALL_AUGMENTATIONS)
    sample = make_sample()
    first = transform(sample, np.random.default_rng(3))
    again = transform(sample, np.random.default_rng(3))
    for key in BATCH_KEYS:
        np.testing.assert_array_equal(first[key], again[key])
    other = transform(sample, np.random.default_rng(4))
    assert any(not np.array_equal(first[k], other[k]) for k in BATCH_KEYS)


def test_target_view_is_the_prepared_volume_unless_augment_target():
    transform = make_transform(flip_prob=1.0, intensity_jitter=0.3)
    prepared = transform.prepare(make_sample())
    out = transform.augment_and_mask(prepared, np.random.default_rng(0))
    np.testing.assert_array_equal(out["target"][0], prepared)
    assert not np.array_equal(out["context"][0], prepared)
    both = make_transform(flip_prob=1.0, augment_target=True)
    out = both.augment_and_mask(prepared, np.random.default_rng(0))
    np.testing.assert_array_equal(out["target"][0], prepared[:, :, ::-1])


def test_flip_is_along_width():
    transform = make_transform(flip_prob=1.0)
    prepared = transform.prepare(make_sample())
    out = transform.augment_and_mask(prepared, np.random.default_rng(0))
    np.testing.assert_array_equal(out["context"][0], prepared[:, :, ::-1])


def test_affine_and_jitter_change_the_view_and_stay_in_unit_range():
    transform = make_transform(affine_prob=1.0, intensity_jitter=0.5)
    prepared = transform.prepare(make_sample())
    context = transform.augment_and_mask(prepared, np.random.default_rng(1))["context"]
    assert context.shape == (1, *IMAGE) and context.dtype == np.float32
    assert not np.allclose(context[0], prepared)
    assert context.min() >= 0.0 and context.max() <= 1.0


def test_mask_does_not_depend_on_augmentation_options():
    prepared = make_transform().prepare(make_sample())
    plain = make_transform().augment_and_mask(prepared, np.random.default_rng(5))
    augmented = make_transform(**ALL_AUGMENTATIONS).augment_and_mask(prepared, np.random.default_rng(5))
    np.testing.assert_array_equal(plain["target_idx"], augmented["target_idx"])


def test_augment_and_mask_refuses_a_volume_of_the_wrong_shape():
    with pytest.raises(ContractError, match=r"transform.image_size"):
        make_transform().augment_and_mask(np.zeros((8, 32, 30), np.float32), np.random.default_rng(0))


# --- cache key -----------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    dict(image_size=(8, 32, 64)),
    dict(target_spacing=(0.05, 0.02, 0.02)),
    dict(percentiles=(0.5, 99.5)),
    dict(fit="crop_pad"),
    dict(anti_aliasing=False),
])
def test_cache_key_changes_with_prepare_options(change):
    base = OCTStandardConfig(image_size=IMAGE)
    assert build(attrs.evolve(base, **change), make_ctx()).cache_key() != build(base, make_ctx()).cache_key()


def test_cache_key_ignores_augmentation_and_mask_options():
    base = make_transform().cache_key()
    assert make_transform(**ALL_AUGMENTATIONS, rotate_degrees=3.0, scale_range=0.2,
                          mask=MaskConfig(generator="multiblock3d")).cache_key() == base
