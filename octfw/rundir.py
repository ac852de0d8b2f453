"""The run directory: what a run writes at start and at the end.

At start: ``recipe.toml`` (resolved, every default filled in),
``run.json`` (the run's id and its place among the runs of its recipe),
``versions.json`` (octfw, every plugin distribution, torch, torch_xla if
loaded, Python) and ``git.json`` (the commit of the recipe's repository, if
any). At the end: ``summary.json``.

**No clock decides which run is newest.** Hosts of a pod, or a job moved
between regions, share neither a clock nor a time zone. Each run records a
``sequence``: one more than the largest of the runs already under its
recipe's folder. ``--resume auto`` reads the runs in that order
(:func:`run_dirs`). Folder names are UTC (``20261126-095317Z``), for people.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata as metadata
import json
import platform
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping

from octfw.errors import UserError
from octfw.recipe import Recipe, to_toml
from octfw.registry import Registry
from octfw.storage.failures import storage_cause

__all__ = ["create_run_dir", "run_dirs", "run_sequence", "versions", "write_summary", "START_FILES", "RUN_FILE"]

#: The run's identity: ``{"id": ..., "sequence": N, "started_utc": ...}``.
RUN_FILE = "run.json"
#: What a run folder holds before its first update step: a folder with nothing else
#: trained nothing, and a start that failed removes it (see octfw.engine.launch).
START_FILES = frozenset({"recipe.toml", RUN_FILE, "versions.json", "git.json", "octfw.log", "owner.lock"})


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions(registry: Registry | None = None) -> dict[str, Any]:
    from octfw.version import __version__

    out: dict[str, Any] = {"octfw": __version__, "python": platform.python_version()}
    for dist in ("torch", "numpy", "monai", "pydicom"):
        out[dist] = _version(dist)
    if "torch_xla" in sys.modules:
        out["torch_xla"] = _version("torch_xla")
    if registry is not None:
        out["plugins"] = dict(sorted(registry.distributions.items()))
    return out


def git_info(folder: Path) -> dict[str, Any] | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True,
                                text=True, timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=folder, capture_output=True,
                               text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _runs_root(recipe: Recipe) -> Path:
    output = recipe.run.output_dir
    if output.is_remote:
        raise UserError(f"run.output_dir: {output!r} must be a local folder (checkpoints may go to gs://)")
    return Path(output.local_path) / recipe.name


def create_run_dir(recipe: Recipe, registry: Registry) -> Path:
    root = _runs_root(recipe)
    now = dt.datetime.now(dt.timezone.utc)
    stamp = now.strftime("%Y%m%d-%H%M%SZ")
    run_dir = root / stamp
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = root / f"{stamp}-{suffix}"
    sequence = max((run_sequence(p) for p in _run_folders(root)), default=0) + 1
    try:
        run_dir.mkdir(parents=True)
        _write_json(run_dir / RUN_FILE, {"id": uuid.uuid4().hex, "sequence": sequence,
                                         "started_utc": now.isoformat(timespec="seconds")})
        (run_dir / "recipe.toml").write_text(to_toml(recipe.to_dict()), encoding="utf-8")
        _write_json(run_dir / "versions.json", versions(registry))
        _write_json(run_dir / "git.json", git_info(recipe.folder))
    except OSError as exc:  # a full disk, a read-only folder: said before anything is trained
        shutil.rmtree(run_dir, ignore_errors=True)
        cause = storage_cause(exc, str(run_dir)) or f"{type(exc).__name__}: {exc}"
        raise UserError(f"run.output_dir: cannot write the run folder: {cause}") from None
    except BaseException:  # a stop signal while the folder is written: nothing half-made is left
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def run_sequence(run_dir: Path) -> int:
    """The run's place among its recipe's runs (0: a folder from before octfw recorded it)."""
    try:
        return int(json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))["sequence"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _run_folders(root: Path) -> list[Path]:
    return [p for p in root.glob("*") if (p / "recipe.toml").exists()] if root.exists() else []


def run_dirs(recipe: Recipe) -> list[Path]:
    """The run directories of this recipe's name, the last started first (for ``--resume auto``):
    by recorded sequence, never by folder name or clock; a folder name breaks only a tie (two
    runs started at once) and orders the folders of older octfw versions, which come last."""
    return sorted(_run_folders(_runs_root(recipe)), key=lambda p: (run_sequence(p), p.name), reverse=True)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_summary(run_dir: Path, summary: Mapping[str, Any], quarantine: Any) -> None:
    _write_json(run_dir / "summary.json", {**summary, "quarantined_files": dict(quarantine.seen)})
