"""Dataset components: OCT DICOM volumes from a folder, glob or manifest,
a synthetic multi-vendor cohort written as real DICOM files, and raw vendor
files read through oct-converter."""

from __future__ import annotations

from octfw.hookspecs import hookimpl
from octfw.plugins.datasets import dicom, oct_vendor, synthetic_oct


@hookimpl
def octfw_register_datasets(register):
    register(
        "dicom",
        dicom.DicomConfig,
        "octfw.plugins.datasets.dicom:build",
        "OCT DICOM volumes from a folder, glob or manifest (local or fsspec URL).",
    )
    register(
        "synthetic-oct",
        synthetic_oct.SyntheticOctConfig,
        "octfw.plugins.datasets.synthetic_oct:build",
        "A synthetic multi-vendor OCT cohort, written as DICOM and read like `dicom`.",
    )
    register(
        "oct-vendor",
        oct_vendor.OctVendorConfig,
        "octfw.plugins.datasets.oct_vendor:build",
        "Raw vendor OCT files (.e2e, .fds, .fda, .img, .OCT) through oct-converter (extra 'vendor').",
    )
