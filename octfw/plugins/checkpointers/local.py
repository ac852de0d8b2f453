"""``local``: atomic checkpoints in a local folder, the newest ``keep_last`` kept.

Layout of the folder (``<run_dir>/checkpoints`` unless ``dir`` is given)::

    step_00000120.pt     one complete checkpoint per save
    step_00000120.pt.tmp a save in progress (or one that was interrupted)
    latest               a JSON pointer to the newest complete checkpoints, with their sizes

A save writes ``step_N.pt.tmp``, fsyncs it, renames it to ``step_N.pt``
(``os.replace`` is atomic on one filesystem), then rewrites ``latest`` the
same way. A crash at any point leaves ``latest`` naming a complete file. The
folder, pointer and retention are :class:`octfw.storage.checkpoints.CheckpointStorage`'s,
shared with the ``gcs`` checkpointer; a ``latest`` written by an older octfw
(a bare file name) is still followed.

The state must hold only tensors and plain Python data (dict, list, tuple,
str, bytes, int, float, bool, None, torch dtypes and devices): ``load`` uses
``torch.load(weights_only=True)``, which cannot run code from the file and
refuses anything else. ``save`` checks this first, so a state that could not
be loaded back fails at its first save rather than at resume. Convert numpy
arrays and RNG states to tensors or lists before saving.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from octfw.display.errors import UserError
from octfw.recipe.fields import Location, doc, positive
from octfw.hookspecs import Register, hookimpl
from octfw.storage.checkpoint_names import LATEST, checkpoint_name
from octfw.storage.checkpointer import StoredCheckpointer
from octfw.storage.checkpoints import CheckpointStorage
from octfw.types import BuildContext

__all__ = ["LocalCheckpointConfig", "LocalCheckpointer", "build", "checkpoint_name", "LATEST"]


@attrs.frozen
class LocalCheckpointConfig:
    """Config of the ``local`` checkpointer."""

    dir: Location | None = doc(
        "folder for checkpoints on a local disk; leave out for <run_dir>/checkpoints",
        default=None,
    )
    keep_last: int = doc(
        "how many of the newest checkpoints to keep (the one 'latest' names is never deleted)",
        default=3,
        validator=positive,
    )


class LocalCheckpointer(StoredCheckpointer):
    """Checkpoints in ``folder`` (None: nowhere to save, as in ``octfw check``)."""

    def __init__(self, folder: Path | None, keep_last: int = 3, rank: int = 0):
        self.folder = folder
        storage = CheckpointStorage(str(folder), keep_last=keep_last) if folder is not None else None
        super().__init__(storage, rank)


def build(config: LocalCheckpointConfig, ctx: BuildContext) -> LocalCheckpointer:
    if config.dir is not None:
        if config.dir.is_remote:
            raise UserError(
                f"checkpointer.dir = {str(config.dir)!r} is not a local folder; "
                "use the 'gcs' checkpointer for remote locations"
            )
        folder: Path | None = Path(config.dir.local_path)
    elif ctx.run_dir is not None:
        folder = Path(ctx.run_dir) / "checkpoints"
    else:
        folder = None  # `octfw check`: nothing will be saved
    return LocalCheckpointer(folder, keep_last=config.keep_last, rank=ctx.rank)


@hookimpl
def octfw_register_checkpointers(register: Register) -> None:
    register(
        "local",
        LocalCheckpointConfig,
        build,
        "Atomic torch.save to a local folder with a 'latest' pointer; keeps the newest "
        "keep_last.",
    )
