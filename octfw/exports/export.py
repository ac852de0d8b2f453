"""``octfw export``: the target encoder of a run's checkpoint, written to ``--out`` in one
of :data:`~octfw.exports.formats.EXPORT_FORMATS`, where an export may be written."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from octfw.display.errors import UserError
from octfw.exports.checkpoint import checkpoint_encoder
from octfw.exports.formats import (CONFIG_FILE, DEFAULT_LICENSE, EXPORT_FORMATS, FOLDER_FORMATS, is_export_folder,
                                   is_new_or_empty)
from octfw.exports.writing import write_export
from octfw.registry import Registry

__all__ = ["export_encoder", "check_output"]


def export_encoder(source: str | Path, out: str | Path, registry: Registry, export_format: str = "octfw", *,
                   force: bool = False, license: str = DEFAULT_LICENSE, datasets: Sequence[str] | None = None,
                   ) -> dict[str, Any]:
    """Write the target encoder of the checkpoint ``source`` names to ``out``.

    ``export_format``: one of :data:`octfw.exports.formats.EXPORT_FORMATS`, whose
    module says what each writes. An existing ``out`` is replaced only with
    ``force`` (a folder only if it holds an export). ``license`` and
    ``datasets`` go to the model card (datasets default to the recipe's
    ``[dataset]``); its metrics are the run's evaluator results up to the
    checkpoint, when the run logged them to ``metrics.jsonl``. Returns a
    summary: ``out``, ``format``, ``checkpoint``, ``update_step``, ``config``,
    ``parameters`` and ``metrics`` (how many results the card lists).
    """
    if export_format not in EXPORT_FORMATS:
        raise UserError(f"--format {export_format!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    check_output(out, export_format, force)
    location, encoder, info = checkpoint_encoder(source, registry, license=license, datasets=datasets)
    write_export(export_format, out, encoder, info)
    return {
        "out": str(out),
        "format": export_format,
        "checkpoint": location,
        "update_step": info["update_step"],
        "config": info["config"],
        "parameters": sum(p.numel() for p in encoder.parameters()),
        "metrics": len(info["metrics"]),
    }


def check_output(out: Path, export_format: str, force: bool) -> None:
    """Refuse an ``--out`` the export cannot or, without ``force``, may not replace:
    every format refuses to overwrite silently."""
    if export_format in FOLDER_FORMATS:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out}: is a file; give a folder name for a {export_format} export")
        if not is_new_or_empty(out):
            if not force:
                raise UserError(f"--out {out}: already exists; give --force to replace it")
            if not is_export_folder(out):  # --force on a folder of other files would delete them
                raise UserError(f"--out {out}: --force replaces an earlier export only, and this folder "
                                f"holds none ({CONFIG_FILE} or configs/metadata.json)")
    elif out.is_dir():
        raise UserError(f"--out {out}: is a folder; give a file name such as encoder.pt")
    elif out.exists() and not force:
        raise UserError(f"--out {out}: already exists; give --force to replace it")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist")
