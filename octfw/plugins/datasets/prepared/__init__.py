"""The ``prepared`` dataset: volumes stored by ``octfw prepare``, streamed from a folder or bucket.

Registration and factory; the config lives in :mod:`octfw.plugins.datasets.prepared.config`
and the reader in :mod:`octfw.plugins.datasets.prepared.dataset`.
"""

from __future__ import annotations

from octfw.plugins.datasets.prepared.config import PreparedConfig
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext, Dataset

__all__ = ["PreparedConfig", "build"]


def build(config: PreparedConfig, ctx: BuildContext) -> Dataset:
    from octfw.plugins.datasets.prepared.dataset import PreparedDataset, cache_folder
    from octfw.fields import parse_bytes
    from octfw.storage.disk_cache import DiskCache
    from octfw.storage.reach import require_reachable

    location = str(config.path)
    require_reachable(location, "dataset.path")  # seconds, not gcsfs's minute of retries
    limit = parse_bytes(config.cache_max_bytes)
    cache = DiskCache(cache_folder(ctx.cache_dir, location), limit) if limit else None
    return PreparedDataset.open(location, split=config.split, cache=cache)


@hookimpl
def octfw_register_datasets(register: Register) -> None:
    register(
        "prepared",
        PreparedConfig,
        build,
        "Volumes stored by `octfw prepare` (zarr, local or gs://), streamed with a bounded "
        "cache.",
    )
