"""``gcs``: checkpoints in an object store (any fsspec URL), safe against partial uploads.

Layout under ``dir`` (for example ``gs://bucket/oct-run``)::

    step_00000120.pt   one checkpoint object per save
    latest             a small JSON pointer, written last

Object stores have no atomic rename (and the GCS emulator has no ``moveTo``),
so a save writes the checkpoint object in place under its final name, then
rewrites ``latest``::

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

import io
import json
import sys
import time
from typing import Any, Callable, Mapping

import attrs

from octfw.errors import UserError
from octfw.fields import Location, doc, non_negative, positive
from octfw.plugins.checkpointers.common import (
    LATEST, check_plain, checkpoint_name, checkpoint_step, prunable, safe_load,
)
from octfw.types import BuildContext

__all__ = ["GcsCheckpointConfig", "GcsCheckpointer", "StorageError", "build", "open_filesystem", "require_driver"]

POINTER_FORMAT = 1
_GCS_PROTOCOLS = ("gs", "gcs")


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


class StorageError(OSError):
    """A storage operation that still failed after every retry."""


def require_driver(url: str) -> None:
    """UserError naming the ``gcs`` extra when ``url`` is on GCS and gcsfs is not installed."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in _GCS_PROTOCOLS:
        try:
            import gcsfs  # noqa: F401 - only to learn whether it is installed
        except ImportError:
            raise UserError(
                f"checkpointer.dir = {url!r} needs gcsfs: pip install 'octfw[gcs]'"
            ) from None


def open_filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for ``url``; UserError naming the extra it lacks."""
    import fsspec

    require_driver(url)
    try:
        # No instance cache: a cached client keeps the endpoint and credentials
        # it was made with, which must not leak between runs (or tests).
        return fsspec.core.url_to_fs(url, skip_instance_cache=True)
    except ImportError as exc:
        raise UserError(f"checkpointer.dir = {url!r}: {exc}") from None
    except ValueError as exc:  # unknown protocol
        raise UserError(f"checkpointer.dir = {url!r}: {exc}") from None


def _permanent(exc: BaseException) -> bool:
    """Errors that another attempt cannot fix (a missing object, a refused state, a bad request)."""
    return isinstance(exc, (FileNotFoundError, PermissionError, TypeError, ValueError, UserError))


class GcsCheckpointer:
    """Saves on rank 0 only; every rank may ask for ``latest()`` and ``load()`` to resume."""

    def __init__(self, url: str, keep_last: int = 3, rank: int = 0, retries: int = 3,
                 backoff_s: float = 2.0, timeout_s: float = 600.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.rank = rank
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._sleep = sleep
        self._fs: Any = None
        self._root = ""

    # --- storage operations, each retried --------------------------------

    @property
    def fs(self) -> Any:
        # Made on first use: building the component (``octfw check``) must not
        # open a connection.
        if self._fs is None:
            self._fs, self._root = open_filesystem(self.url)
        return self._fs

    @property
    def root(self) -> str:
        """Path of ``dir`` inside the filesystem (``bucket/oct-run`` for ``gs://bucket/oct-run``)."""
        self.fs  # noqa: B018 - opening the filesystem also sets the root
        return self._root

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def _call(self, what: str, operation: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<operation>(*args)`` with a deadline and retries with exponential backoff."""
        fs = self.fs
        if getattr(fs, "async_impl", False):
            kwargs["timeout"] = self.timeout_s  # fsspec cancels the request when it expires
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                self._sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return getattr(fs, operation)(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - transient ones are retried, the rest re-raised
                if _permanent(exc):
                    raise
                last = exc
        raise StorageError(
            f"{what} failed after {self.retries + 1} attempts: {type(last).__name__}: {last}"
        ) from last

    def _size(self, name: str) -> int | None:
        """Size in bytes of object ``name``; None if absent."""
        try:
            return int(self._call(f"stat {self.url}/{name}", "info", self._path(name))["size"])
        except FileNotFoundError:
            return None

    def _names(self) -> list[str]:
        """Names of the checkpoint objects under ``dir``."""
        try:
            entries = self._call(f"list {self.url}", "ls", self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]
        return [name for name in names if checkpoint_step(name) is not None]

    def _pointer(self) -> list[dict[str, Any]]:
        """Entries of the ``latest`` pointer, newest first; [] when there is none yet."""
        try:
            raw = self._call(f"read {self.url}/{LATEST}", "cat_file", self._path(LATEST))
        except FileNotFoundError:
            return []
        try:
            entries = json.loads(raw)["checkpoints"]
            # Only bare checkpoint names are followed: never a path out of the folder.
            return [{"name": str(e["name"]), "bytes": int(e["bytes"])} for e in entries
                    if checkpoint_step(str(e["name"])) is not None]
        except (ValueError, KeyError, TypeError):
            return []  # a pointer from elsewhere, or damaged: trust no entry of it

    # --- the Checkpointer protocol ----------------------------------------

    def save(self, update_step: int, state: Mapping[str, Any]) -> str:
        """Upload ``state`` for ``update_step``, then the pointer; returns its URL ("" off rank 0)."""
        if self.rank != 0:
            return ""
        import torch

        check_plain(state, "state")
        buffer = io.BytesIO()
        torch.save(dict(state), buffer)
        data = buffer.getvalue()
        name = checkpoint_name(update_step)
        url = f"{self.url}/{name}"

        # Read the old pointer first: if that fails, nothing has changed yet.
        previous = self._pointer()
        if not getattr(self.fs, "async_impl", False):
            self._call(f"create {self.url}", "makedirs", self.root, exist_ok=True)
        self._call(f"upload {url}", "pipe_file", self._path(name), data)

        doomed = set(prunable(self._names(), self.keep_last, protected={name}))
        kept = [{"name": name, "bytes": len(data)}]
        kept += [e for e in previous if e["name"] != name and e["name"] not in doomed]
        pointer = json.dumps({"format": POINTER_FORMAT, "checkpoints": kept[: self.keep_last]})
        # The pointer goes last: until it is written, `latest` names the previous checkpoint.
        self._call(f"upload {self.url}/{LATEST}", "pipe_file", self._path(LATEST), pointer.encode("utf-8"))

        for old in sorted(doomed):
            try:
                self._call(f"delete {self.url}/{old}", "rm_file", self._path(old))
            except Exception as exc:  # noqa: BLE001 - the checkpoint is safe; the next save prunes again
                print(f"octfw: warning: could not delete old checkpoint {self.url}/{old}: {exc}",
                      file=sys.stderr)
        return url

    def latest(self) -> str | None:
        """URL of the newest checkpoint the pointer lists whose object is complete; else None."""
        for entry in self._pointer():
            if self._size(entry["name"]) == entry["bytes"]:
                return f"{self.url}/{entry['name']}"
        return None

    def checkpoints(self) -> list[tuple[int, str]]:
        """Complete checkpoints the pointer lists, as (update step, URL), oldest first."""
        found = [(checkpoint_step(e["name"]), f"{self.url}/{e['name']}") for e in self._pointer()
                 if self._size(e["name"]) == e["bytes"]]
        return sorted(found)

    def load(self, location: str) -> dict[str, Any]:
        """Download a checkpoint and read it with ``torch.load(weights_only=True)``."""
        if not location.startswith(self.url + "/"):
            # `--resume URL` of a checkpoint elsewhere: same retries, its own folder.
            if "/" not in location:
                location = f"./{location}"
            folder = location.rsplit("/", 1)[0]
            other = GcsCheckpointer(folder, self.keep_last, self.rank, self.retries, self.backoff_s,
                                    self.timeout_s, self._sleep)
            return other.load(location)
        path = self._path(location[len(self.url) + 1:])
        try:
            data = self._call(f"download {location}", "cat_file", path)
        except FileNotFoundError:
            raise UserError(f"checkpoint {location} does not exist") from None
        return safe_load(io.BytesIO(data), location)


def build(config: GcsCheckpointConfig, ctx: BuildContext) -> GcsCheckpointer:
    # Fail at build time (`octfw check`, the start of `octfw run`) rather than at the first save.
    require_driver(str(config.dir))
    return GcsCheckpointer(str(config.dir), keep_last=config.keep_last, rank=ctx.rank,
                           retries=config.retries, backoff_s=config.backoff_s, timeout_s=config.timeout_s)
