"""The files of a checkpoint folder: their names, retention, and the ``latest`` pointer's format.

Layout of the folder::

    step_00000120.pt         one checkpoint per save; names sort by update step
    step_00000120.dcp/       or, from a sharded run, a folder of every process's slices
                             (:mod:`octfw.storage.sharded_checkpoints`)
    step_00000120.pt.sha256  its SHA-256, in ``sha256sum`` format (``sha256sum -c`` checks it)
    step_00000120.pt.tmp     a local save in progress, or one that was interrupted
    latest                   the pointer, written after the checkpoint and its checksum

The pointer (format 1) lists the kept checkpoints, newest first, each with
its size in bytes::

    {"format": 1, "checkpoints": [{"name": "step_00000120.pt", "bytes": 10212539}, ...]}

A pointer in the older local format (the bare name of one checkpoint) is
still read, as one entry whose size is unknown; the next save rewrites it in
format 1. Only bare checkpoint names are ever followed, never a path out of
the folder.

Pure functions of names and bytes, so the rules are tested without a
filesystem; :mod:`octfw.storage.checkpoints` applies them to a folder.
Light at import time (stdlib and attrs only).
"""

from __future__ import annotations

import json
import re
from typing import Iterable

import attrs

__all__ = [
    "LATEST", "POINTER_FORMAT", "PointerEntry", "checkpoint_name", "is_sharded_checkpoint", "checksum_name",
    "checkpoint_step",
    "is_leftover", "checksummed_checkpoint", "prunable", "parse_pointer", "format_pointer",
]

#: Name of the pointer to the newest complete checkpoint, next to the checkpoints.
LATEST = "latest"
#: Version of the pointer's JSON layout.
POINTER_FORMAT = 1

_COMPLETE = re.compile(r"^step_(\d{8,})\.(pt|dcp)$")
_SHARDED = ".dcp"
# What an interrupted local write leaves: a checkpoint's, its checksum's or the pointer's temporary file.
_LEFTOVER = re.compile(r"^(step_\d{8,}\.pt(\.sha256)?|latest)\.tmp$")
_CHECKSUM = re.compile(r"^(step_\d{8,}\.pt)\.sha256$")


# --- names and retention ------------------------------------------------------


def checkpoint_name(update_step: int, sharded: bool = False) -> str:
    """Name of the checkpoint taken at ``update_step``: a file, or the folder of a sharded save."""
    return f"step_{update_step:08d}{_SHARDED if sharded else '.pt'}"


def is_sharded_checkpoint(name: str) -> bool:
    """Whether ``name`` (a checkpoint's name, path or URL) is the folder of a sharded save."""
    return name.rstrip("/").endswith(_SHARDED)


def checksum_name(name: str) -> str:
    """Name of the file holding the SHA-256 of checkpoint ``name``."""
    return f"{name}.sha256"


def checkpoint_step(name: str) -> int | None:
    """The update step of a checkpoint name; None for any other name (``.tmp``, ``latest``, paths)."""
    match = _COMPLETE.match(name)
    return int(match.group(1)) if match else None


def is_leftover(name: str) -> bool:
    """Whether ``name`` is the temporary file of an interrupted local write (a checkpoint's,
    its checksum's or the pointer's)."""
    return bool(_LEFTOVER.match(name))


def checksummed_checkpoint(name: str) -> str | None:
    """The checkpoint whose checksum file is ``name``; None when ``name`` is no checksum file."""
    match = _CHECKSUM.match(name)
    return match.group(1) if match else None


def prunable(names: Iterable[str], keep_last: int, protected: Iterable[str] = ()) -> list[str]:
    """Checkpoint names to delete so that the newest ``keep_last`` (by update step) remain.

    Names in ``protected`` (the one just written) are never returned, even
    when older: a run that restarted its numbering below an earlier run's
    must not lose the checkpoint its pointer names.
    """
    keep = set(protected)
    ordered = sorted((step, name) for name in names if (step := checkpoint_step(name)) is not None)
    return [name for _, name in ordered[: max(0, len(ordered) - keep_last)] if name not in keep]


# --- the pointer ----------------------------------------------------------------


@attrs.frozen
class PointerEntry:
    """One checkpoint the pointer lists; ``bytes`` is None for an old-format pointer."""

    name: str
    bytes: int | None


def parse_pointer(raw: bytes) -> list[PointerEntry]:
    """Entries of a ``latest`` pointer, newest first; [] for a damaged or foreign one.

    Reads format 1 (JSON, with sizes) and the older local format (one bare
    checkpoint name). Only bare checkpoint names are followed, never a path
    out of the folder.
    """
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return []
    if checkpoint_step(text) is not None:
        return [PointerEntry(text, None)]  # written by octfw before pointer format 1
    try:
        record = json.loads(text)
        if record["format"] != POINTER_FORMAT:
            return []  # a newer layout: trust none of it rather than misread it
        entries = [PointerEntry(str(e["name"]), int(e["bytes"])) for e in record["checkpoints"]]
    except (ValueError, KeyError, TypeError):
        return []  # damaged, or not octfw's: trust no entry of it
    return [e for e in entries if checkpoint_step(e.name) is not None]


def format_pointer(entries: Iterable[PointerEntry]) -> bytes:
    """The ``latest`` pointer (format 1) listing ``entries``, newest first."""
    listed = [{"name": e.name, "bytes": e.bytes} for e in entries]
    return json.dumps({"format": POINTER_FORMAT, "checkpoints": listed}).encode("utf-8")
