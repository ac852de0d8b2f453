"""The ``synthetic-oct`` dataset: a generated multi-vendor cohort.

The cohort is written once as Ophthalmic Tomography DICOM files (and reused
while its options are unchanged), then read back by the same
:class:`~octfw.dicom.dataset.DicomDataset` as the ``dicom`` dataset, so
a quickstart on synthetic data exercises the real DICOM path end to end.

Registration and factory; the config lives in :mod:`octfw.plugins.datasets.synthetic.config`.
The implementation, one concern a module, which ``build`` alone imports (numpy, pydicom):

- :mod:`.cohort`: the options, and writing (or reusing) a cohort's folder;
- :mod:`.vendors`: the device profiles (size, spacing, gain, speckle, bits);
- :mod:`.retina`: the drawn geometry (layers, fovea, findings) of one volume;
- :mod:`.rendering`: that geometry as stored voxels (reflectivity, speckle, noise);
- :mod:`.labels`: the classification tasks and every voxel's layer label;
- :mod:`.corruption`: which files are broken, and how.
"""

from __future__ import annotations

from octfw.plugins.datasets.synthetic.config import SyntheticOctConfig
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Dataset

__all__ = ['SyntheticOctConfig', 'build']


def build(config: SyntheticOctConfig, ctx: BuildContext) -> Dataset:
    from octfw.dicom.dataset import DicomDataset
    from octfw.plugins.datasets.synthetic.cohort import MANIFEST_FILE, cohort_key, cohort_options, write_synthetic_cohort

    seed = ctx.seed if config.seed is None else config.seed
    options = dict(
        seed=seed,
        corrupt_fraction=config.corrupt_fraction,
        with_labels=config.labels,
        task=config.task,
        finding_scale=config.finding_scale,
        sizes=config.sizes,
    )
    if config.folder is not None:
        from octfw.storage.reach import require_reachable

        folder = str(config.folder)
        require_reachable(folder, "dataset.folder")  # seconds, not gcsfs's minute of retries
    else:
        key = cohort_key(cohort_options(config.n_volumes, config.domains, **options))
        folder = str(ctx.cache_dir / "synthetic-oct" / key)
    write_synthetic_cohort(folder, config.n_volumes, config.domains, **options)
    return DicomDataset.from_location(f"{folder.rstrip('/')}/{MANIFEST_FILE}", domain_from="header")


@hookimpl
def octfw_register_datasets(register: Register) -> None:
    register(
        "synthetic-oct",
        SyntheticOctConfig,
        build,
        "A synthetic multi-vendor OCT cohort, written as DICOM and read like `dicom`.",
    )
