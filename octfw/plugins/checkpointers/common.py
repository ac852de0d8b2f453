"""What the ``local`` and ``gcs`` checkpointers share: naming, pruning, state checks, safe loading.

- :func:`checkpoint_name` / :func:`checkpoint_step`: one checkpoint per update
  step, named ``step_00000120.pt`` so that names sort by step;
- :func:`prunable`: which checkpoints ``keep_last`` lets go;
- :func:`check_plain`: refuse at save time a state that
  ``torch.load(weights_only=True)`` could not read back;
- :func:`safe_load`: read a checkpoint without running code from the file.

Light at import time (stdlib only): torch is imported inside the functions.
"""

from __future__ import annotations

import re
from typing import IO, Any, Iterable

from octfw.errors import UserError

__all__ = ["LATEST", "checkpoint_name", "checkpoint_step", "prunable", "check_plain", "safe_load"]

#: Name of the pointer to the newest complete checkpoint, next to the checkpoints.
LATEST = "latest"

_COMPLETE = re.compile(r"^step_(\d{8,})\.pt$")


def checkpoint_name(update_step: int) -> str:
    """Name of the checkpoint taken at ``update_step``."""
    return f"step_{update_step:08d}.pt"


def checkpoint_step(name: str) -> int | None:
    """The update step of a checkpoint name; None for any other name (``.tmp``, ``latest``, paths)."""
    match = _COMPLETE.match(name)
    return int(match.group(1)) if match else None


def prunable(names: Iterable[str], keep_last: int, protected: Iterable[str] = ()) -> list[str]:
    """Checkpoint names to delete so that the newest ``keep_last`` (by update step) remain.

    Names in ``protected`` (the one just written, the one ``latest`` names) are
    never returned, even when older: a run that restarted its numbering below
    an earlier run's must not lose the checkpoint its pointer names.
    """
    keep = set(protected)
    ordered = sorted((step, name) for name in names if (step := checkpoint_step(name)) is not None)
    return [name for _, name in ordered[: max(0, len(ordered) - keep_last)] if name not in keep]


def check_plain(value: Any, where: str = "state") -> None:
    """Raise TypeError naming the first value ``torch.load(weights_only=True)`` would refuse.

    Allowed: tensors, dict, list, tuple, str, bytes, int, float, complex, bool,
    None, torch dtypes and devices.
    """
    import torch

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor,
                                           torch.dtype, torch.device)):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds only "
        "tensors and plain Python data (convert it to a tensor or a list)"
    )


# Lines of torch's weights_only message that say nothing about this file.
_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _reason(exc: Exception) -> str:
    """The line of a ``torch.load`` error that names what was refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    specific = [line for line in lines if not line.startswith(_BOILERPLATE)]
    return (specific or lines or [""])[0]


def safe_load(source: str | IO[bytes], location: str) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` onto the CPU; UserError naming ``location`` if refused.

    ``source`` is a local path or a binary file object (a BytesIO of a remote
    object). weights_only cannot run code from the file: a pickled arbitrary
    object is refused, not executed.
    """
    import torch

    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the checkpoint's name
        raise UserError(
            f"checkpoint {location} cannot be loaded safely ({type(exc).__name__}: {_reason(exc)}); "
            "octfw loads tensors and plain Python data only"
        ) from exc
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {location} holds a {type(state).__name__}, not a dict")
    return state
