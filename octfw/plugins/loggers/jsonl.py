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

from octfw.recipe.fields import doc
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
        self.last_step: int | None = None  #: the last update step written; restored on resume
        self._resumed = False
        self._file: IO[str] | None = None

    # --- checkpointed state: one line per log step across crashes and resumes ---------------

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_step, self._resumed = state.get("last_step"), True

    def start(self, total_update_steps: int, run_dir: Path, recipe: Mapping[str, Any]) -> None:
        self.path = Path(run_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._resumed and self.path.exists():  # drop what a killed attempt wrote after the checkpoint
            _truncate_after(self.path, self.last_step)
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
        self.last_step = int(update_step)

    def finish(self, summary: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _truncate_after(path: Path, last_step: int | None) -> None:
    """Keep the lines of steps up to ``last_step`` (None: the checkpoint came before the first
    log step, keep none) and drop a last line a kill cut short; written atomically."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # the half line of a process killed while writing it
        if last_step is not None and step <= last_step:
            kept.append(line)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    temp.replace(path)


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
