"""Plots of a run from its JSONL metrics log (``<run_dir>/metrics.jsonl``).

:func:`read_metrics` turns the log into one series per metric over update
steps; :func:`plot_run` draws loss (overall and per domain, the
``loss/<domain>`` keys), learning rate, gradient norm and skipped updates into
one PNG. A resumed run appends to the same log and may log a step again (the
steps between its checkpoint and the crash): the last line of each step wins.
``null`` values (a non-finite metric, or a log step whose every update was
skipped) become NaN, drawn as gaps. So does a per-domain loss of exactly 0.0:
the engine reports 0.0 for a domain none of whose samples fell in the log
interval, and a real L1/MSE feature loss is never exactly 0. matplotlib is
imported only when drawing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from octfw.errors import UserError

__all__ = ["read_metrics", "plot_run"]

#: Panels of :func:`plot_run`: (title, metric keys; a trailing "/" means every key with that prefix).
PANELS = (
    ("loss", ("loss", "loss/")),
    ("learning rate", ("lr",)),
    ("gradient norm (before clipping)", ("grad_norm",)),
    ("skipped updates (total)", ("skipped_updates",)),
)


def read_metrics(path: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{metric: (update steps, values)}`` from a JSONL metrics log, sorted by step.

    Raises UserError for a missing, empty or unreadable file, naming it and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no metrics log here (the jsonl logger writes it; is [[logger]] "
                        "name = \"jsonl\" in the recipe?)")
    by_step: dict[int, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError) as exc:
                raise UserError(f"{path}:{number}: not a metrics line ({type(exc).__name__}: {exc})") from None
            # A resumed run logs some steps again: its line replaces the first attempt's.
            by_step.setdefault(step, {}).update(record)
    if not by_step:
        raise UserError(f"{path}: the metrics log is empty; nothing to plot")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if key in ("step", "time", "nonfinite") or isinstance(value, (str, bool)):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(math.nan if value is None else float(value))
    return series


def plot_run(metrics_path: str | Path, png_path: str | Path) -> Path:
    """Draw loss (overall and per domain), LR, gradient norm and skipped updates into ``png_path``."""
    from matplotlib.figure import Figure  # heavy imports: only when a plot is drawn
    from matplotlib.ticker import MaxNLocator

    metrics_path = Path(metrics_path)
    series = read_metrics(metrics_path)
    if "loss" not in series:
        raise UserError(f"{metrics_path}: no 'loss' in the metrics log; is it a training run's log?")

    fig = Figure(figsize=(8.0, 9.0), layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (title, keys) in zip(axes, PANELS):
        shown = [k for k in series if k in keys or any(p.endswith("/") and k.startswith(p) for p in keys)]
        for key in sorted(shown, key=lambda k: (k != "loss", k)):
            steps, values = series[key]
            overall = key == "loss"
            if key.startswith("loss/"):  # 0.0: no sample of that domain in the interval
                values = [math.nan if v == 0.0 else v for v in values]
            label = "overall" if overall else key.split("/", 1)[-1]
            ax.plot(steps, values, label=label, linewidth=2.0 if overall else 1.2,
                    marker="." if len(steps) < 50 else None)
        if not shown:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if len(shown) > 1:
            ax.legend(fontsize="small", loc="best")
        ax.set_ylabel(title.split(" (")[0])
        ax.set_title(title, fontsize="medium")
        ax.grid(True, alpha=0.3)
    if "loss" in series and all(v > 0 for v in series["loss"][1] if not math.isnan(v)):
        axes[0].set_yscale("log")  # losses span decades early in training
    axes[-1].set_xlabel("update step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"{metrics_path.parent.name}: {series['loss'][0][-1]} update steps logged")

    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
