"""The ``oct-vendor`` dataset: raw Heidelberg, Topcon, Zeiss and Bioptigen files.

Config and factory only; reading goes through the ``oct-converter`` package
(the ``vendor`` extra) in :mod:`octfw.plugins.datasets.vendor.reader`, imported when the
dataset is built.

Registration and factory; the config lives in :mod:`octfw.plugins.datasets.vendor.config`.
"""

from __future__ import annotations

from octfw.plugins.datasets.vendor.config import OctVendorConfig
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Dataset

__all__ = ['OctVendorConfig', 'build']


def build(config: OctVendorConfig, ctx: BuildContext) -> Dataset:
    from octfw.plugins.datasets.vendor.reader import VendorDataset, require_oct_converter
    from octfw.storage.reach import require_reachable

    require_oct_converter()  # fail at build time, naming the extra, not in a loader worker
    require_reachable(str(config.path), "dataset.path")  # seconds, not gcsfs's minute of retries
    return VendorDataset.from_location(
        config.path,
        split=config.split,
        domain_from=config.domain_from,
        extensions=config.extensions,
        img_shape=config.img_shape,
        img_interlaced=config.img_interlaced,
        default_spacing=config.default_spacing,
    )


@hookimpl
def octfw_register_datasets(register: Register) -> None:
    register(
        "oct-vendor",
        OctVendorConfig,
        build,
        "Raw vendor OCT files (.e2e, .fds, .fda, .img, .OCT) through oct-converter (extra 'vendor').",
    )
