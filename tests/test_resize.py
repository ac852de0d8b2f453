"""oct-standard's separable resize computes what MONAI's anti-aliased trilinear Resize computes.

The oracle is MONAI itself: the Resize the transform called before (Gaussian
smoothing, then F.interpolate) and the preparation built on it, on real DICOM
files of every vendor the synthetic cohort writes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from monai.transforms import Resize

from octfw.dicom.decoding import read_oct_volume
from octfw.plugins.transforms.oct_standard.config import OCTStandardConfig
from octfw.plugins.transforms.oct_standard.resize import resize
from octfw.plugins.transforms.oct_standard.transform import OCTStandardTransform
from octfw.plugins.datasets.synthetic.cohort import write_synthetic_cohort
from octfw.plugins.datasets.synthetic.vendors import PROFILES
from octfw.types import Sample

#: float32 rounding, relative to the largest value: the two differ in the order of the sums only.
RELATIVE = 2e-6


@pytest.mark.parametrize("anti_aliasing", [True, False])
@pytest.mark.parametrize("shape, size", [
    ((24, 96, 64), (57, 19, 55)),     # heidelberg-like: deeper, 5x smaller in H, about the same in W
    ((32, 256, 128), (30, 25, 75)),   # strong shrinking on one axis, a little on the others
    ((30, 25, 75), (16, 64, 64)),     # the fit after resampling: up on two axes, down on one
    ((5, 7, 9), (5, 7, 9)),           # unchanged
    ((1, 40, 3), (4, 8, 12)),         # a single slice
])
def test_resize_matches_monai(shape, size, anti_aliasing):
    volume = torch.from_numpy(np.random.default_rng(0).gamma(2.0, 30.0, size=shape).astype(np.float32))
    expected = Resize(size, mode="trilinear", anti_aliasing=anti_aliasing)(volume[None])
    expected = (expected.as_tensor() if hasattr(expected, "as_tensor") else expected)[0]
    out = resize(volume, size, anti_aliasing)
    assert tuple(out.shape) == size and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=RELATIVE * float(expected.abs().max()))


def monai_prepare(config: OCTStandardConfig, sample: Sample) -> np.ndarray:
    """The preparation as it was computed with MONAI's Resize: resample, percentiles, fit, clip."""
    image = torch.tensor(np.asarray(sample.volume, dtype=np.float32))[None]
    if config.target_spacing is not None:
        shape = tuple(max(1, int(round(n * s / t))) for n, s, t in
                      zip(image.shape[1:], sample.provenance.spacing, config.target_spacing))
        if shape != tuple(image.shape[1:]):
            image = Resize(shape, mode="trilinear", anti_aliasing=config.anti_aliasing)(image)
    plain = image.as_tensor() if hasattr(image, "as_tensor") else image
    low, high = np.percentile(plain.numpy(), config.percentiles)
    image = ((plain - float(low)) / float(high - low)).clamp_(0.0, 1.0)
    image = Resize(config.image_size, mode="trilinear", anti_aliasing=config.anti_aliasing)(image)
    prepared = (image.as_tensor() if hasattr(image, "as_tensor") else image)[0].numpy().copy()
    return np.clip(prepared, 0.0, 1.0)


@pytest.mark.parametrize("anti_aliasing", [True, False])
def test_prepared_volumes_of_every_vendor_equal_the_monai_preparation(tmp_path, anti_aliasing):
    """On real DICOM files of every vendor, at the seeds' target spacing: within 1e-5 on [0, 1]."""
    write_synthetic_cohort(tmp_path, 6, seed=3)
    rows = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    config = OCTStandardConfig(image_size=(16, 64, 64), target_spacing=(0.05, 0.02, 0.02),
                               anti_aliasing=anti_aliasing)
    transform = OCTStandardTransform(config, (4, 16, 16))
    seen = set()
    for row in rows:
        sample = read_oct_volume(str(tmp_path / row["path"]))
        out = transform.prepare(sample)
        np.testing.assert_allclose(out, monai_prepare(config, sample), rtol=0, atol=1e-5)
        seen.add(sample.provenance.domain)
    assert seen == set(PROFILES)
