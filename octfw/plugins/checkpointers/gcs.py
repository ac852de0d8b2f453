"""``gcs``: checkpoints in an object store (any fsspec URL), safe against partial uploads.

Layout under ``dir`` (for example ``gs://bucket/oct-run``)::

    step_00000120.pt   one checkpoint object per save
    latest             a small JSON pointer, written last

Object stores have no atomic rename (and the GCS emulator has no ``moveTo``),
so a save writes the checkpoint object in place under its final name, then
rewrites ``latest`` (the same pointer the ``local`` checkpointer writes: both
keep their folders through :class:`octfw.storage.checkpoints.CheckpointStorage`)::

    {"format": 1, "checkpoints": [{"name": "step_00000120.pt", "bytes": 10212539}, ...]}

The list holds the kept checkpoints, newest first, each with its size in
bytes. ``latest()`` returns the first entry whose object exists with exactly
that size, so it never names a checkpoint whose upload was cut short, and falls
back to an older entry when the newest is missing or truncated. An object no
pointer lists (a save that died before its pointer) is never trusted; the
next saves prune it.

Every storage operation is retried ``retries`` times with exponential backoff
(``backoff_s``, doubling) and bounded by ``timeout_s``; then the save raises,
and the engine warns, keeps training and lists the failed save in the run
summary. gcsfs adds its own retries of transient HTTP errors inside each
attempt. Only rank 0 writes; every rank may read, to resume.

``gs://`` URLs need gcsfs (``pip install 'octfw[gcs]'``); it finds credentials
the usual way (``GOOGLE_APPLICATION_CREDENTIALS``, the TPU VM's metadata
server) and honours ``STORAGE_EMULATOR_HOST``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import attrs

from octfw.recipe.fields import Location, doc, non_negative, positive
from octfw.hookspecs import Register, hookimpl
from octfw.storage.checkpointer import StoredCheckpointer
from octfw.storage.checkpoints import CheckpointStorage
from octfw.storage.files import require_driver
from octfw.storage.retry import RetryPolicy, StorageError
from octfw.types import BuildContext

__all__ = ["GcsCheckpointConfig", "GcsCheckpointer", "StorageError", "build"]

#: The config key of the folder, named in error messages.
_SETTING = "checkpointer.dir"


@attrs.frozen
class GcsCheckpointConfig:
    """Config of the ``gcs`` checkpointer."""

    dir: Location = doc("fsspec URL of the checkpoint folder, e.g. gs://bucket/oct-run (required)")
    keep_last: int = doc(
        "how many of the newest checkpoints to keep (the one just written is never deleted)",
        default=3,
        validator=positive,
    )
    retries: int = doc(
        "extra attempts of a storage operation that failed (network, server errors)",
        default=3,
        validator=non_negative,
    )
    backoff_s: float = doc(
        "seconds to wait before the first retry; the wait doubles with each retry",
        default=2.0,
        validator=non_negative,
    )
    timeout_s: float = doc(
        "seconds one storage operation may take before it counts as failed (async stores such as gcsfs)",
        default=600.0,
        validator=positive,
    )


class GcsCheckpointer(StoredCheckpointer):
    """Checkpoints under fsspec URL ``url``, each storage operation retried with exponential backoff."""

    storage: CheckpointStorage  # always a folder here, unlike a local checkpointer in `octfw check`

    def __init__(self, url: str, keep_last: int = 3, rank: int = 0, retries: int = 3,
                 backoff_s: float = 2.0, timeout_s: float = 600.0,
                 sleep: Callable[[float], None] = time.sleep):
        retry = RetryPolicy(retries=retries, backoff_s=backoff_s, timeout_s=timeout_s, sleep=sleep)
        super().__init__(CheckpointStorage(url, keep_last=keep_last, retry=retry, setting=_SETTING), rank)
        self.url = self.storage.url

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of ``dir``, opened on first use (building opens no connection)."""
        return self.storage.fs


def build(config: GcsCheckpointConfig, ctx: BuildContext) -> GcsCheckpointer:
    # Fail at build time (`octfw check`, the start of `octfw run`) rather than at the first save.
    require_driver(str(config.dir), _SETTING)
    return GcsCheckpointer(str(config.dir), keep_last=config.keep_last, rank=ctx.rank,
                           retries=config.retries, backoff_s=config.backoff_s, timeout_s=config.timeout_s)


@hookimpl
def octfw_register_checkpointers(register: Register) -> None:
    register(
        "gcs",
        GcsCheckpointConfig,
        build,
        "Checkpoints to gs:// (any fsspec URL): object first, size-checked 'latest' pointer "
        "last; retries.",
    )
