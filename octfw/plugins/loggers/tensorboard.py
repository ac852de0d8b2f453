"""``tensorboard``: event files TensorBoard reads, in ``<run_dir>/tensorboard`` by default.

- Every metric the engine hands over at a log step becomes a scalar at
  ``step = update_step`` (``loss/<domain>`` and ``eval/<evaluator>/<metric>``
  group under their prefix in TensorBoard's scalar tab).
- At start, the resolved recipe is written as text (``recipe``); at the end,
  the run summary (``summary``), then the file is closed.
- A resumed run continues the same folder. The last step written travels in
  the checkpoint (:meth:`TensorBoardLogger.state_dict`), and the writer of the
  resumed run purges what an interrupted attempt wrote after it, so each step
  is shown once.

``tensorboard --logdir RUN/tensorboard`` shows it. Needs the ``tensorboard``
extra: ``pip install 'octfw[tensorboard]'``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import attrs

from octfw.display.errors import UserError
from octfw.recipe.fields import Location, doc, positive
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext

__all__ = ["TensorBoardConfig", "TensorBoardLogger", "build"]


@attrs.frozen
class TensorBoardConfig:
    """Config of the ``tensorboard`` logger."""

    dir: Location | None = doc(
        "local folder that receives the event files; leave out for <run folder>/tensorboard", default=None
    )
    flush_secs: float = doc("seconds between writes of pending events to disk", default=10.0, validator=positive)


def summary_writer() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or a UserError naming the extra that installs it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("the 'tensorboard' logger needs the tensorboard package: "
                        "pip install 'octfw[tensorboard]'") from None
    return SummaryWriter


class TensorBoardLogger:
    """Writes scalars, the recipe and the summary to one TensorBoard log folder."""

    def __init__(self, config: TensorBoardConfig):
        self.config = config
        self.last_step: int | None = None  #: the last update step written; restored on resume
        self._writer: Any = None

    # --- checkpointed state ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_step = state["last_step"]

    # --- the Logger protocol ------------------------------------------------

    def start(self, total_update_steps: int, run_dir: Path, recipe: Mapping[str, Any]) -> None:
        folder = Path(self.config.dir.local_path) if self.config.dir is not None else Path(run_dir) / "tensorboard"
        folder.mkdir(parents=True, exist_ok=True)
        # On resume: hide what an interrupted attempt wrote after the checkpoint's last step.
        purge_step = None if self.last_step is None else self.last_step + 1
        self._writer = summary_writer()(str(folder), purge_step=purge_step, flush_secs=self.config.flush_secs)
        if purge_step is None:
            self._writer.add_text("recipe", _code_block(recipe), 0)

    def log(self, update_step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, update_step)
        self.last_step = int(update_step)

    def finish(self, summary: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        step = int(summary.get("update_steps") or 0)
        self._writer.add_text("summary", _code_block({k: v for k, v in summary.items() if v is not None}), step)
        self._writer.close()
        self._writer = None


def _code_block(value: Mapping[str, Any]) -> str:
    # TensorBoard renders text as Markdown: a fenced block keeps the indentation.
    return "```\n" + json.dumps(dict(value), indent=2, default=str) + "\n```"


def build(config: TensorBoardConfig, ctx: BuildContext) -> TensorBoardLogger:
    if config.dir is not None and config.dir.is_remote:
        raise UserError(f"logger tensorboard: dir = {str(config.dir)!r} must be a local folder")
    if ctx.is_main_process:
        summary_writer()  # a missing package fails at build time, before training starts
    return TensorBoardLogger(config)


@hookimpl
def octfw_register_loggers(register: Register) -> None:
    register(
        "tensorboard",
        TensorBoardConfig,
        build,
        "TensorBoard event files in the run folder: every metric as a scalar, the recipe and the summary "
        "as text; a resume continues them without repeated steps.",
    )
