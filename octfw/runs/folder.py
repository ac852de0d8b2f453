"""A run's folder: what a run writes at start and at the end, and the order of a recipe's runs.

At start: ``recipe.toml`` (resolved, every default filled in),
``run.json`` (the run's id, its place among the runs of its recipe and, once
it starts training, the global batch it trains at),
``versions.json`` (octfw, every plugin distribution, torch, torch_xla if
loaded, Python) and ``git.json`` (the commit of the recipe's repository, if
any). At the end: ``summary.json``.

**No clock decides which run is newest.** Hosts of a pod, or a job moved
between regions, share neither a clock nor a time zone. Each run records a
``sequence``: one more than the largest of the runs already under its
recipe's folder. ``--resume auto`` reads the runs in that order
(:func:`recipe_runs`). Folder names are UTC (``20261126-095317Z``), for people.

**Runs started at the same moment get their own folder and number.** The
sequence is read and recorded while the start holds an exclusive lock on the
recipe's folder (``flock``, held for a few milliseconds: the largest recorded
number, the new folder and its ``run.json``), so two starts never record the
same number. The folder is made with an exclusive ``mkdir``: a name taken in
the same second gets the next suffix (``20261126-095317Z-2``). A start that
fails while it writes its folder removes that folder, never one another start
made.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import importlib.metadata as metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs

from octfw.display.errors import UserError
from octfw.recipe import Recipe, to_toml
from octfw.registry import Registry
from octfw.storage.failures import storage_cause
from octfw.storage.files import write_atomically

__all__ = ["create_run_dir", "run_dirs", "recipe_runs", "run_record", "RunRecord", "run_sequence", "versions",
           "write_summary", "START_FILES", "RUN_FILE", "record_global_batch"]

#: The run's identity: ``{"id": ..., "sequence": N, "started_utc": ...}``.
RUN_FILE = "run.json"
#: What a run folder holds before its first update step: a folder with nothing else
#: trained nothing, and a start that failed removes it (see octfw.engine.launch).
START_FILES = frozenset({"recipe.toml", RUN_FILE, "versions.json", "git.json", "octfw.log", "owner.lock"})
#: At most this long a start waits for another start of the same recipe to record its sequence.
SEQUENCE_LOCK_TIMEOUT_S = 60.0

logger = logging.getLogger(__name__)


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
    """A new run folder of ``recipe``, made by this call alone, with its start files (see the
    module docstring); a start that fails while writing them removes the folder it made."""
    root = _runs_root(recipe)
    now = dt.datetime.now(dt.timezone.utc)
    run_dir: Path | None = None  # set once this call has made the folder: the only one it may remove
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _sequence_lock(root):  # the largest number, the folder and its run.json: one start at a time
            sequence = max((run_sequence(p) for p in root.iterdir() if p.is_dir()), default=0) + 1
            run_dir = _make_folder(root, now.strftime("%Y%m%d-%H%M%SZ"))
            _write_json(run_dir / RUN_FILE, {"id": uuid.uuid4().hex, "sequence": sequence,
                                             "started_utc": now.isoformat(timespec="seconds")})
        (run_dir / "recipe.toml").write_text(to_toml(recipe.to_dict()), encoding="utf-8")
        _write_json(run_dir / "versions.json", versions(registry))
        _write_json(run_dir / "git.json", git_info(recipe.folder))
    except OSError as exc:  # a full disk, a read-only folder: said before anything is trained
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        where = run_dir or root
        cause = storage_cause(exc, str(where)) or f"{type(exc).__name__}: {exc}"
        raise UserError(f"run.output_dir: cannot write the run folder: {cause}") from None
    except BaseException:  # a stop signal while the folder is written: nothing half-made is left
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def _make_folder(root: Path, stamp: str) -> Path:
    """``root/stamp``, or ``root/stamp-2``, ``-3``, ... when that name is taken: made here, by an
    exclusive mkdir (an existing folder is never reused, whoever made it)."""
    suffix = 1
    while True:
        run_dir = root / (stamp if suffix == 1 else f"{stamp}-{suffix}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            suffix += 1


@contextmanager
def _sequence_lock(root: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the recipe's runs folder itself (no lock file among the runs),
    released when the block ends or the process dies. Waits at most
    :data:`SEQUENCE_LOCK_TIMEOUT_S`; on a file system without locks, goes on without one."""
    fd = os.open(root, os.O_RDONLY)
    try:
        deadline = time.monotonic() + SEQUENCE_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(f"run.output_dir: another start of this recipe has held {root} for "
                                    f"{SEQUENCE_LOCK_TIMEOUT_S:g} s while choosing its run folder; "
                                    "is a start of it stopped (SIGSTOP)?") from None
                time.sleep(0.01)
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                logger.warning("run.output_dir: %s cannot be locked (%s); runs of this recipe started at the "
                               "same moment may record the same sequence", root, exc.strerror)
                break
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@attrs.frozen
class RunRecord:
    """What a run's ``run.json`` says of it: its folder, its place among its recipe's runs (0: a
    folder from before octfw recorded it) and the global batch it trains at (None: not recorded
    yet, or by an older octfw)."""

    folder: Path
    sequence: int = 0
    global_batch: int | None = None


def run_record(run_dir: Path) -> RunRecord:
    """``run_dir``'s :class:`RunRecord`, read once."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return RunRecord(run_dir)
    sequence, batch = record.get("sequence"), record.get("global_batch")
    return RunRecord(run_dir, sequence if isinstance(sequence, int) else 0, batch if isinstance(batch, int) else None)


def run_sequence(run_dir: Path) -> int:
    """The run's place among its recipe's runs (0: a folder from before octfw recorded it)."""
    return run_record(run_dir).sequence


def _run_folders(root: Path) -> list[Path]:
    return [p for p in root.glob("*") if (p / "recipe.toml").exists()] if root.exists() else []


def recipe_runs(recipe: Recipe) -> list[RunRecord]:
    """The runs of this recipe's name, the last started first (for ``--resume auto``): by
    recorded sequence, never by folder name or clock; a folder name breaks only a tie (two runs
    started at once) and orders the folders of older octfw versions, which come last."""
    records = [run_record(folder) for folder in _run_folders(_runs_root(recipe))]
    return sorted(records, key=lambda r: (r.sequence, r.folder.name), reverse=True)


def run_dirs(recipe: Recipe) -> list[Path]:
    """The run directories of this recipe's name, the last started first (:func:`recipe_runs`)."""
    return [record.folder for record in recipe_runs(recipe)]


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_summary(run_dir: Path, summary: Mapping[str, Any], quarantine: Any) -> None:
    _write_json(run_dir / "summary.json", {**summary, "quarantined_files": dict(quarantine.seen)})


def record_global_batch(run_dir: Path, global_batch: int) -> None:
    """Record in ``run.json`` the global batch the run trains at, once: a resume on other devices
    keeps it (the schedule and the data order count in it). Replaced whole, never half-written."""
    path = run_dir / RUN_FILE
    record = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if record.get("global_batch") is not None:
        return
    text = json.dumps({**record, "global_batch": global_batch}, indent=2, sort_keys=True) + "\n"
    write_atomically(path, text.encode("utf-8"))
