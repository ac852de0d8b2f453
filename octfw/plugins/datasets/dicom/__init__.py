"""The ``dicom`` dataset: OCT volumes from a folder, a glob or a manifest.

Multi-frame files are volumes; single-frame files of one series in one
folder are read as one volume (see :mod:`octfw.dicom.dataset`).

Registration and factory; the config lives in :mod:`octfw.plugins.datasets.dicom.config`,
the reading in the core's :mod:`octfw.dicom`, which ``synthetic-oct``, ``phantom-oct``,
``oct-vendor`` and a third-party dataset share.
"""

from __future__ import annotations

from octfw.plugins.datasets.dicom.config import DicomConfig
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Dataset

__all__ = ['DicomConfig', 'build']


def build(config: DicomConfig, ctx: BuildContext) -> Dataset:
    from octfw.dicom.dataset import DicomDataset
    from octfw.storage.reach import require_reachable

    require_reachable(str(config.path), "dataset.path")  # seconds, not gcsfs's minute of retries
    return DicomDataset.from_location(
        config.path,
        split=config.split,
        domain_from=config.domain_from,
        extensions=config.extensions,
        series=config.series,
    )


@hookimpl
def octfw_register_datasets(register: Register) -> None:
    register(
        "dicom",
        DicomConfig,
        build,
        "OCT DICOM volumes from a folder, glob or manifest (local or fsspec URL).",
    )
