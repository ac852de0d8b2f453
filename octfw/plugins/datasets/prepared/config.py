"""Config of the ``prepared`` dataset (light: attrs only).

Validating a recipe imports it and nothing heavier; the implementation
reads it, and the package's ``__init__`` (:mod:`octfw.plugins.datasets.prepared`) registers it
and holds the factory.
"""

from __future__ import annotations

from typing import Any

import attrs

from octfw.recipe.fields import Location, byte_size, doc

__all__ = ["PreparedConfig"]


@attrs.frozen
class PreparedConfig:
    path: Location = doc(
        "Where `octfw prepare` wrote the dataset: a local folder or URL (gs://...). "
        "Building the dataset reads its index only."
    )
    split: str | None = doc(
        "Keep only volumes of this manifest split (the source manifest's split column); unset: all.",
        default=None,
    )
    cache_max_bytes: int | str = doc(
        "Local disk cache, per host, of the compressed volumes read from a remote path, "
        "under <run.cache_dir>/prepared-volumes/; least-recently-used volumes are evicted "
        "beyond this size (bytes, or a size such as \"20GiB\"); 0: no cache, every read "
        "goes to the store. A local path is read in place, never cached.",
        default="20GiB",
        validator=byte_size,
    )

    @classmethod
    def recognises(cls, fs: Any, path: str) -> bool:
        """A folder holding the header ``octfw prepare`` writes (:class:`octfw.types.RecognisingDatasetConfig`)."""
        from octfw.plugins.datasets.prepared.store import HEADER_FILE

        return fs.exists(f"{path.rstrip('/')}/{HEADER_FILE}")
