"""``console``: a progress bar on a terminal, one plain line per log step elsewhere.

Shown at each log step (whichever of these keys the engine sends; others,
such as ``loss/<domain>``, are left to the file and W&B loggers):
``loss``, ``lr``, ``grad_norm``, ``skipped_updates``, ``samples_per_s``.
The plain line reads::

    step 10/60 loss 0.1234 lr 1.00e-04 grad_norm 0.53 skipped 0 samples/s 12.3

``update_step`` is printed as the engine passes it, against the run's total:
pass the number of updates done so the last line reads ``60/60``.

``finish(summary)`` prints a summary block from whichever of these keys it
finds: ``update_steps``, ``total_update_steps``, ``first_loss``,
``last_loss``, ``skipped_updates``, ``samples_per_s``, ``elapsed_s``,
``checkpoint``, ``failed_saves``, ``skipped_saves`` (shown when > 0), ``quarantined``,
``stopped`` (with the resume hint when ``preempted``). Other keys
with a plain value (number, string, bool) follow under their own name; None
values are left out.

Why this component prints instead of logging: its lines and the summary are
what ``octfw run`` produces, its result on stdout like ``octfw show``'s TOML,
not diagnostics about the run. Users choose this component in the recipe;
its output must not depend on the log level or be duplicated into
``octfw.log`` (``metrics.jsonl`` is the file record of the same values), and
the progress bar needs the terminal itself. Warnings and notes from the rest
of octfw go through :mod:`octfw.display.logs` to stderr, which the bar shows above
itself while it runs.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import IO, Any, Mapping

import attrs

from octfw.recipe.fields import choices, doc
from octfw.hookspecs import Register, hookimpl
from octfw.types import BuildContext

__all__ = ["ConsoleConfig", "ConsoleLogger", "build", "format_metrics", "format_summary"]

#: How many items of a list (failed saves, quarantined files) the summary shows.
MAX_LISTED = 5
#: A data wait at least this share of the run hints at more loader workers...
DATA_WAIT_HINT_SHARE = 0.2
#: ...in a run at least this long (seconds). In a shorter one (the quickstart's few seconds)
#: the wait is seconds at most, and workers, which take seconds to start, would not save them.
DATA_WAIT_HINT_MIN_S = 60.0


@attrs.frozen
class ConsoleConfig:
    """Config of the ``console`` logger."""

    mode: str = doc(
        "'bar': a rich progress bar with live metrics; 'plain': one line per log step; "
        "'auto': the bar when stdout is a terminal or a Jupyter notebook, else plain",
        default="auto",
        validator=choices("auto", "bar", "plain"),
    )


def _loss(value: float) -> str:
    # Four decimals read well for the usual 0.01..100; a loss collapsing towards
    # 0 must not print as 0.0000, so small and huge values switch to exponent.
    if value == 0 or (math.isfinite(value) and 1e-3 <= abs(value) < 1e5):
        return f"{value:.4f}"
    return f"{value:.3e}"


def _count(value: float) -> str:
    return str(int(value)) if math.isfinite(value) else str(value)


#: metric key -> (label, formatter), in display order
_SHOWN = (
    ("loss", "loss", _loss),
    ("lr", "lr", lambda v: f"{v:.2e}"),
    ("grad_norm", "grad_norm", lambda v: f"{v:.3g}"),
    ("skipped_updates", "skipped", _count),
    ("samples_per_s", "samples/s", lambda v: f"{v:.1f}"),
)


def format_metrics(metrics: Mapping[str, float]) -> str:
    """The main metrics as ``loss 0.1234 lr 1.00e-04 ...``; absent and unknown keys are left out."""
    parts = []
    for key, label, fmt in _SHOWN:
        value = metrics.get(key)
        if value is not None:
            parts.append(f"{label} {fmt(float(value))}")
    return " ".join(parts)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def _listing(value: Any, noun: str) -> list[str]:
    """A count, then up to MAX_LISTED items, for a list (or a count, or a report path)."""
    if isinstance(value, (list, tuple)):
        lines = [f"{len(value)} {noun}"]
        lines += [f"  - {item}" for item in value[:MAX_LISTED]]
        if len(value) > MAX_LISTED:
            lines.append(f"  ... and {len(value) - MAX_LISTED} more")
        return lines
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [f"{int(value)} {noun}"]
    return [str(value)]


def format_summary(summary: Mapping[str, Any], total_update_steps: int | None = None) -> str:
    """The end-of-run block; keys the summary lacks (or holds as None) are skipped."""
    rows: list[tuple[str, list[str]]] = []
    get = summary.get
    total = get("total_update_steps", total_update_steps)
    if get("update_steps") is not None:
        steps = str(int(get("update_steps")))
        rows.append(("steps", [f"{steps}/{int(total)}" if total else steps]))
    first, last = get("first_loss"), get("last_loss")
    if first is not None and last is not None:
        rows.append(("loss", [f"{_loss(float(first))} -> {_loss(float(last))} (first -> last)"]))
    elif first is not None or last is not None:
        key = "first loss" if first is not None else "last loss"
        rows.append((key, [_loss(float(first if first is not None else last))]))
    if get("skipped_updates") is not None:
        rows.append(("skipped updates", [_count(float(get("skipped_updates")))]))
    if get("samples_per_s") is not None:
        rows.append(("throughput", [f"{float(get('samples_per_s')):.1f} samples/s"]))
    if get("data_wait_share") is not None:
        share = float(get("data_wait_share"))
        worth_it = share >= DATA_WAIT_HINT_SHARE and float(get("elapsed_s") or 0.0) >= DATA_WAIT_HINT_MIN_S
        hint = " (the loader limits training: more engine.num_workers; octfw bench --data-only sizes them)" \
            if worth_it else ""
        rows.append(("data wait", [f"{share:.0%} of the run{hint}"]))
    if get("elapsed_s") is not None:
        rows.append(("elapsed", [_duration(float(get("elapsed_s")))]))
    if get("checkpoint") is not None:
        rows.append(("checkpoint", [str(get("checkpoint"))]))
    if get("failed_saves") is not None:
        rows.append(("failed saves", _listing(get("failed_saves"), "failed")))
    if get("skipped_saves"):  # only when a save came due while another was being written
        rows.append(("skipped saves", [f"{int(get('skipped_saves'))} (the previous save was still being written)"]))
    if get("quarantined") is not None:
        rows.append(("quarantined", _listing(get("quarantined"), "files")))
    if get("stopped") is not None:
        resume = "; resume with --resume auto" if get("preempted") else ""
        at_once = " (at once: no final save)" if get("interrupted") else ""
        rows.append(("stopped", [str(get("stopped")) + at_once + resume]))
    if get("finished_early") is not None:
        rows.append(("finished early", [str(get("finished_early"))]))
    if get("final_save_failed"):  # said only when it happened: the run failed, its state is here
        rows.append(("final save", [f"FAILED; the final state is in {get('fallback_checkpoint')}"
                                    if get("fallback_checkpoint") else "FAILED; no fallback copy could be written"]))

    known = {"update_steps", "total_update_steps", "first_loss", "last_loss", "skipped_updates",
             "samples_per_s", "elapsed_s", "checkpoint", "failed_saves", "skipped_saves", "quarantined",
             "stopped", "finished_early", "preempted", "interrupted", "final_save_failed", "fallback_checkpoint",
             "data_wait_share"}
    for key, value in summary.items():
        if key not in known and isinstance(value, (int, float, str, bool)):
            rows.append((str(key), [str(value)]))

    # A fixed label column (wider only for a long extra key) keeps summaries comparable.
    width = max([len("skipped updates")] + [len(label) for label, _ in rows]) + 2
    lines = ["training summary"]
    for label, values in rows:
        lines.append(f"  {label:<{width}}{values[0]}")
        lines += [f"  {'':<{width}}{more}" for more in values[1:]]
    return "\n".join(lines)


class ConsoleLogger:
    """Prints log steps to stdout (or ``stream``); rank 0 only, like every logger."""

    def __init__(self, mode: str = "auto", stream: IO[str] | None = None):
        self.mode = mode
        self._stream = stream
        self._total = 0
        self._progress: Any = None  # rich.progress.Progress in bar mode
        self._task: Any = None

    @property
    def stream(self) -> IO[str]:
        # Resolved late so that a redirected sys.stdout (pytest, a launcher) is honoured.
        return self._stream if self._stream is not None else sys.stdout

    def _use_bar(self) -> bool:
        if self.mode == "auto":
            from octfw.display.progress import watched

            return watched(self.stream)
        return self.mode == "bar"

    def start(self, total_update_steps: int, run_dir: Path, recipe: Mapping[str, Any]) -> None:
        self._total = int(total_update_steps)
        if not self._use_bar():
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.table import Column

        # The metrics column takes the width left and is cut with an ellipsis on
        # a narrow terminal, so the step count, bar and times always show.
        metrics_column = Column(ratio=1, no_wrap=True, overflow="ellipsis")
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=20),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}", markup=False, table_column=metrics_column),
            console=Console(file=self.stream),
            expand=True,
        )
        self._task = self._progress.add_task("train", total=self._total, metrics="")
        self._progress.start()

    def on_step(self, update_step: int) -> None:
        """Every update step (a host int, no device value): moves the bar and its ETA."""
        if self._progress is not None:
            self._progress.update(self._task, completed=update_step)

    def log(self, update_step: int, metrics: Mapping[str, float]) -> None:
        evaluation = {k: v for k, v in metrics.items() if k.startswith("eval/")}
        if evaluation:  # evaluator results arrive on their own and get their own line
            shown = " ".join(f"{k[len('eval/'):]} {v:.4g}" for k, v in sorted(evaluation.items()))
            target = self._progress.console if self._progress is not None else None
            if target is not None:
                target.print(f"eval at step {update_step}: {shown}", markup=False, highlight=False)
            else:
                print(f"eval at step {update_step}: {shown}", file=self.stream, flush=True)
            if len(evaluation) == len(metrics):
                return
        text = format_metrics(metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=update_step, metrics=text)
        else:
            line = f"step {update_step}/{self._total}"
            print(f"{line} {text}" if text else line, file=self.stream, flush=True)

    def finish(self, summary: Mapping[str, Any]) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        print(format_summary(summary, self._total), file=self.stream, flush=True)


def build(config: ConsoleConfig, ctx: BuildContext) -> ConsoleLogger:
    return ConsoleLogger(mode=config.mode)


@hookimpl
def octfw_register_loggers(register: Register) -> None:
    register(
        "console",
        ConsoleConfig,
        build,
        "Progress bar with live loss/lr/grad_norm on a terminal, plain lines elsewhere; end "
        "summary.",
    )
