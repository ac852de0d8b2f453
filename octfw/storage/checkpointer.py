"""The checkpointer of one checkpoint folder (:class:`StoredCheckpointer`): the ``local`` and
``gcs`` checkpointers are this with their own config; the folder's rules are
:class:`octfw.storage.checkpoints.CheckpointStorage`'s.

Light at import time (stdlib only).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from octfw.display.errors import UserError
from octfw.storage.checkpoints import CheckpointStorage, load_checkpoint

__all__ = ["StoredCheckpointer"]


class StoredCheckpointer:
    """The :class:`~octfw.types.Checkpointer` of one :class:`CheckpointStorage` folder: the
    ``local`` and ``gcs`` checkpointers are this with their own config, and a new backend
    (any fsspec URL: ``s3://``, ``az://``, ``memory://``) is this and a ``build`` (see
    docs/architecture.md, "How to add a checkpoint backend").

    Saves on rank 0 only; every rank may ask for ``latest()`` and ``load()`` to resume.

    ``storage`` is None when there is no folder (``octfw check`` without a run
    folder): nothing is listed, and a save raises UserError.
    """

    def __init__(self, storage: CheckpointStorage | None, rank: int = 0):
        self.storage = storage
        self.rank = rank
        self._cancelled = threading.Event()

    @property
    def location(self) -> str | None:
        """The checkpoint folder (a path or URL), for messages; None when there is none."""
        return self.storage.url if self.storage is not None else None

    def save(self, update_step: int, state: Mapping[str, Any]) -> str:
        """Write ``state`` for ``update_step`` and return its location; "" on ranks other than 0."""
        if self.rank != 0:
            return ""
        if self.storage is None:
            raise UserError("checkpointer: no folder to save into (no run folder and no checkpointer.dir)")
        return self.storage.save(update_step, state, cancelled=self._cancelled)

    def save_sharded(self, update_step: int, shards: Mapping[str, Any], plain: Mapping[str, Any] | None,
                     group: Any = None) -> str:
        """Every process writes its slices of ``shards``, rank 0 also ``plain``; returns the
        location (see :meth:`CheckpointStorage.save_sharded`)."""
        if self.storage is None:
            raise UserError("checkpointer: no folder to save into (no run folder and no checkpointer.dir)")
        return self.storage.save_sharded(update_step, shards, plain if self.rank == 0 else None, group)

    def load_sharded(self, location: str, shards: dict[str, Any],
                     check: Callable[[dict[str, Any]], None] = lambda plain: None,
                     optional: tuple[str, ...] = ()) -> dict[str, Any]:
        """Fill ``shards`` in place from a sharded checkpoint, each process its own slices."""
        if self.storage is None:
            raise UserError("checkpointer: no folder to load from (no run folder and no checkpointer.dir)")
        return self.storage.load_sharded(location, shards, check, optional)

    def cancel(self) -> None:
        """Abort the save being written, and any later one (a second Ctrl-C: stop now). Its
        temporary file is removed; the pointer still names the last complete checkpoint."""
        self._cancelled.set()

    def claim(self, needed_bytes: int) -> None:
        """Before training (rank 0): hold the folder for this run and check that it can take a
        checkpoint of ``needed_bytes``; UserError naming the owner or the cause otherwise."""
        if self.rank == 0 and self.storage is not None:
            self.storage.claim(needed_bytes)

    def release(self) -> None:
        """Give the folder up at the end of the run."""
        if self.storage is not None:
            self.storage.release()

    def latest(self) -> str | None:
        """The newest complete checkpoint (see ``CheckpointStorage.latest``); None if there is none."""
        return self.storage.latest() if self.storage is not None else None

    def checkpoints(self) -> list[tuple[int, str]]:
        """Every complete checkpoint as (update step, location), oldest first (for ``octfw replay``)."""
        return self.storage.checkpoints() if self.storage is not None else []

    def load(self, location: str) -> dict[str, Any]:
        """Read a checkpoint onto the CPU; raises UserError for a missing or refused file."""
        if self.storage is not None:
            return self.storage.load(location)
        return load_checkpoint(location)
