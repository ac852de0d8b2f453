"""The ``prepared`` dataset: volumes stored by ``octfw prepare``, streamed from a folder or bucket.

Registration and factory of the dataset, and of its command ``octfw prepare``; the config
lives in :mod:`octfw.plugins.datasets.prepared.config`, the reader in
:mod:`octfw.plugins.datasets.prepared.dataset`, the command's arguments in
:mod:`octfw.plugins.datasets.prepared.command` and the writer in
:mod:`octfw.plugins.datasets.prepared.prepare`.
"""

from __future__ import annotations

from octfw.hookspecs import Register, RegisterCommand, hookimpl
from octfw.plugins.datasets.prepared import command
from octfw.plugins.datasets.prepared.config import PreparedConfig
from octfw.types import BuildContext, Dataset

__all__ = ["PreparedConfig", "build"]


def build(config: PreparedConfig, ctx: BuildContext) -> Dataset:
    from octfw.plugins.datasets.prepared.dataset import PreparedDataset, cache_folder
    from octfw.recipe.fields import parse_bytes
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


@hookimpl
def octfw_register_commands(register: RegisterCommand) -> None:
    register(command.NAME, command.add_arguments, command.run, command.HELP)
