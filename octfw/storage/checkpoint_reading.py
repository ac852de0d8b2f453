"""What a checkpoint may hold, and reading one: plain data only, its SHA-256 checked first.

**What it may hold.** A checkpoint's state holds only tensors and plain
Python data (dict, list, tuple, str, bytes, int, float, complex, bool, None,
torch dtypes and devices): loads use ``torch.load(weights_only=True)``, which
cannot run code from the file. :func:`check_plain` refuses anything else at
save time, so a state that could not be loaded back fails at its first save
rather than at resume.

**Integrity.** The checksum is computed while the checkpoint is written (no
second read) and checked before ``torch.load`` sees a byte: by
``CheckpointStorage.latest()`` (a mismatch is skipped with a warning naming
it, and the previous good checkpoint is used) and by every load, of
``latest`` or of an explicit path (``octfw.storage.checkpoints.load_checkpoint`` reads the
``.sha256`` file beside it), which raise :class:`CorruptCheckpoint`. A
checkpoint written before octfw recorded checksums has none; it is loaded
with a warning saying it is unverified.

:func:`safe_load` is also how an exported encoder or a published weight file
is read. Light at import time (stdlib only): torch and fsspec load inside the
functions.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from typing import IO, Any

from octfw.display.errors import UserError
from octfw.storage.checkpoint_names import checkpoint_step, checksum_name
from octfw.storage.files import is_local_filesystem, open_filesystem
from octfw.storage.retry import RetryPolicy

__all__ = [
    "CorruptCheckpoint", "check_plain", "sha256_of", "parse_checksum", "verify", "safe_load",
    "recorded_checksum", "read_checkpoint",
]

logger = logging.getLogger(__name__)


class CorruptCheckpoint(UserError):
    """A checkpoint whose bytes do not match the SHA-256 recorded when it was written."""


def check_plain(value: Any, where: str = "state") -> None:
    """Raise TypeError naming the first value ``torch.load(weights_only=True)`` would refuse."""
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


def _reason(exc: Exception) -> str:
    """What a ``torch.load`` error says about this file, without torch's advice to retry with
    ``weights_only=False``: that would run whatever code the file holds."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # the refused object or opcode follows this marker
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    specific = [line.split(". Please use", 1)[0] for line in lines
                if "weights_only" not in line and not line.startswith(("Please file an issue", "Check the doc"))]
    return (specific or ["not a checkpoint octfw can read"])[0]


def sha256_of(source: str | bytes) -> str:
    """SHA-256 (hex) of a local file's bytes, or of ``source`` itself when it is bytes."""
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def parse_checksum(raw: bytes) -> str | None:
    """The hex digest of a ``.sha256`` file (``sha256sum`` format); None when it holds none."""
    first = raw.decode("utf-8", "replace").strip().split(maxsplit=1)
    return first[0].lower() if first and re.fullmatch(r"[0-9a-fA-F]{64}", first[0]) else None


def verify(location: str, actual: str, expected: str | None) -> None:
    """Raise :class:`CorruptCheckpoint` unless ``actual`` is the recorded checksum; warn when a
    checkpoint (a ``step_N.pt``) has none. Other files (an exported encoder) may have none."""
    if expected is None and checkpoint_step(location.rsplit("/", 1)[-1]) is None:
        return
    if expected is None:
        logger.warning("checkpoint %s has no recorded SHA-256 (written before octfw recorded them): "
                       "loaded unverified", location)
    elif actual != expected:
        raise CorruptCheckpoint(f"checkpoint {location} is damaged: its SHA-256 is {actual[:12]}..., "
                                f"recorded {expected[:12]}... when it was written; it is not loaded")


def safe_load(source: str | IO[bytes], location: str, what: str = "checkpoint") -> dict[str, Any]:
    """``torch.load(weights_only=True)`` onto the CPU; UserError naming ``location`` if refused.

    ``source`` is a local path or a binary file object (a BytesIO of a remote
    object). weights_only cannot run code from the file: a pickled arbitrary
    object is refused, not executed.
    """
    import pickle

    import torch

    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused an object: never executed
        raise UserError(
            f"{what} {location} cannot be loaded safely ({type(exc).__name__}: {_reason(exc)}); "
            "octfw loads tensors and plain Python data only"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - re-raised with the checkpoint's name
        raise UserError(
            f"{what} {location} cannot be read ({type(exc).__name__}: {_reason(exc)}); "
            f"the file is cut short or not {_a(what)}"
        ) from exc
    if not isinstance(state, dict):
        raise UserError(f"{what} {location} holds a {type(state).__name__}, not a dict")
    return state


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "a checkpoint", "an encoder file"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def recorded_checksum(fs: Any, path: str, retry: RetryPolicy) -> str | None:
    """The SHA-256 recorded beside the checkpoint at ``path``; None when there is none."""
    try:
        raw = retry.run(f"read {path}.sha256", fs.cat_file, checksum_name(path), **retry.options(fs))
    except FileNotFoundError:
        return None
    return parse_checksum(raw)


def read_checkpoint(fs: Any, path: str, location: str, retry: RetryPolicy,
                     data: bytes | None = None) -> dict[str, Any]:
    """Verify the checkpoint at ``path`` against its recorded SHA-256, then load it.
    ``data``: its bytes, when a remote object was downloaded (and verified) already."""
    expected = recorded_checksum(fs, path, retry)
    if is_local_filesystem(fs):
        if not os.path.isfile(path):
            raise UserError(f"checkpoint {location} does not exist")
        verify(location, sha256_of(path), expected)
        return safe_load(path, location)  # torch reads the file itself: no second copy in memory
    if data is None:
        try:
            data = retry.run(f"download {location}", fs.cat_file, path, **retry.options(fs))
        except FileNotFoundError:
            raise UserError(f"checkpoint {location} does not exist") from None
    verify(location, sha256_of(data), expected)
    return safe_load(io.BytesIO(data), location)
