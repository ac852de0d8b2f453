"""``jsonl``: one JSON object per log step, appended to ``<run_dir>/metrics.jsonl``.

Each line is ``{"step": n, <metric>: value, ..., "time": <unix seconds>}``.
JSON has no NaN or infinity, so a non-finite metric is written as ``null``
and its key is listed in ``"nonfinite"`` (present only on lines that have
one): every line stays standard JSON that any parser reads, and a NaN loss is
still told apart from a metric that was not sent. The file is opened
line-buffered and appended to, so a crash loses at most the line being
written and a resumed run continues the same file.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import IO, Any, Mapping

import attrs

from octfw.fields import doc
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext

__all__ = ["JsonlConfig", "JsonlLogger", "build", "RESERVED_KEYS"]

#: Keys the logger writes itself; a metric may not use them.
RESERVED_KEYS = ("step", "time", "nonfinite")


def _plain_filename(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if not value or "/" in value or "\\" in value or value in (".", ".."):
        raise ValueError(f"must be a file name inside the run folder, got {value!r}")


@attrs.frozen
class JsonlConfig:
    """Config of the ``jsonl`` logger."""

    filename: str = doc(
        "file in the run folder that receives one JSON line per log step",
        default="metrics.jsonl",
        validator=_plain_filename,
    )


class JsonlLogger:
    """Appends metrics as JSON lines; rank 0 only, like every logger."""

    def __init__(self, filename: str = "metrics.jsonl"):
        self.filename = filename
        self.path: Path | None = None
        self._file: IO[str] | None = None

    def start(self, total_update_steps: int, run_dir: Path, recipe: Mapping[str, Any]) -> None:
        self.path = Path(run_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # buffering=1: line-buffered, each record reaches the OS when its newline is written.
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")

    def log(self, update_step: int, metrics: Mapping[str, float]) -> None:
        if self._file is None:
            raise RuntimeError("jsonl logger: log() called before start()")
        record: dict[str, Any] = {"step": int(update_step)}
        nonfinite: list[str] = []
        for key, value in metrics.items():
            if key in RESERVED_KEYS:
                raise ValueError(f"jsonl logger: metric name {key!r} is reserved ({', '.join(RESERVED_KEYS)})")
            if isinstance(value, (bool, int, str)):
                record[key] = value
                continue
            number = float(value)  # numpy and torch scalars included
            if math.isfinite(number):
                record[key] = number
            else:
                record[key] = None
                nonfinite.append(key)
        if nonfinite:
            record["nonfinite"] = nonfinite
        record["time"] = time.time()
        # allow_nan=False: a non-finite value that slipped through fails here, not in a reader.
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def finish(self, summary: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def build(config: JsonlConfig, ctx: BuildContext) -> JsonlLogger:
    return JsonlLogger(filename=config.filename)


@hookimpl
def octfw_register_loggers(register: Register) -> None:
    register(
        "jsonl",
        JsonlConfig,
        build,
        "One JSON line per log step in <run_dir>/metrics.jsonl (non-finite values as null).",
    )
