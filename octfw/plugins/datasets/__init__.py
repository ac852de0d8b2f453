"""Dataset components: OCT DICOM volumes from a folder, glob or manifest,
a synthetic multi-vendor cohort written as real DICOM files, and raw vendor
files read through oct-converter, and volumes stored by ``octfw prepare``."""

from __future__ import annotations

from octfw.hookspecs import Register, hookimpl
from octfw.plugins.datasets import dicom, oct_vendor, prepared, synthetic_oct


@hookimpl
def octfw_register_datasets(register: Register) -> None:
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
    register(
        "prepared",
        prepared.PreparedConfig,
        "octfw.plugins.datasets.prepared:build",
        "Volumes stored by `octfw prepare` (zarr, local or gs://), streamed with a bounded cache.",
    )
