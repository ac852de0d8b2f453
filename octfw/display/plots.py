"""Plots of a run from its JSONL metrics log (``<run_dir>/metrics.jsonl``).

:func:`read_metrics` turns the log into one series per metric over update
steps; :func:`plot_run` draws loss (overall and per domain, the
``loss/<domain>`` keys), then, when the run logged them, the collapse signals
(``metric/target_std``, ``metric/effective_rank`` and ``metric/rankme``
each beside its maximum for the logged shapes (``metric/effective_rank_max``,
``metric/rankme_max``), and ``metric/position_share`` on its 0-1 scale, with
the ``collapse`` guard's thresholds from the run's ``recipe.toml``) and the evaluators'
held-out scores (``eval/<evaluator>/<score>``), then learning rate, gradient
norm and skipped updates, into one PNG: a loss that keeps falling while the
features collapse or the probes stall is the thing to see. A resumed run appends to the same log and may log a step again (the
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
import tomllib
from pathlib import Path
from typing import Any, Mapping

import attrs

from octfw.display.errors import UserError

__all__ = ["Panel", "read_metrics", "plan_panels", "none_skipped", "collapse_thresholds", "plot_run",
           "plain_numbers", "step_axis", "step_label"]

#: Panels of every plot: (title, metric keys; a trailing "/" means every key
#: with that prefix). A panel whose keys were not logged says so.
PANELS = (
    ("loss", ("loss", "loss/")),
    ("learning rate", ("lr",)),
    ("gradient norm (before clipping)", ("grad_norm",)),
    ("skipped updates (total)", ("skipped_updates",)),
)
#: Drawn after the loss only when logged (older runs and other models lack
#: them): (title, keys). Values near 0 and 1 mean collapse.
COLLAPSE_PANELS = (
    ("target std (collapse: towards 0)", ("metric/target_std",)),
    # With its ceiling for the logged shapes beside it: 5 of 63 directions is not 5 of 6.
    ("effective rank and its maximum (collapse: towards 1)", ("metric/effective_rank", "metric/effective_rank_max")),
    ("RankMe and its maximum (collapse: towards 1)", ("metric/rankme", "metric/rankme_max")),
    # A share: drawn on its whole 0-1 scale (see plot_run).
    ("position share of the token variance (collapse into position: towards 1)", ("metric/position_share",)),
)
#: Scores of ``eval/<evaluator>/<score>`` drawn in the evaluation panel: the
#: overall held-out scores, not per-domain values, intervals or probe settings.
EVAL_SCORES = ("accuracy", "balanced_accuracy", "auroc", "auprc")
_GUARD_OPTIONS = {"metric/target_std": "min_std", "metric/effective_rank": "min_effective_rank",
                  "metric/rankme": "min_rankme", "metric/position_share": "max_position_share"}


@attrs.frozen
class Panel:
    """One panel of :func:`plot_run`: its title and the series it draws, in order."""

    title: str
    keys: tuple[str, ...]
    thresholds: tuple[float, ...] = ()  #: dashed lines (the collapse guard's limits)


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


def _matching(series: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, ...]:
    shown = [k for k in series if k in keys or any(p.endswith("/") and k.startswith(p) for p in keys)]
    return tuple(sorted(shown, key=lambda k: (k != "loss", k)))


def _eval_keys(series: Mapping[str, Any]) -> tuple[str, ...]:
    """``eval/<evaluator>/<score>`` keys of :data:`EVAL_SCORES`, by evaluator then score."""
    keys = []
    for key in series:
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] in EVAL_SCORES:
            keys.append((parts[1], EVAL_SCORES.index(parts[2]), key))
    return tuple(key for _name, _order, key in sorted(keys))


def collapse_thresholds(run_dir: str | Path) -> dict[str, float]:
    """``{metric key: limit}`` of the ``collapse`` guards in ``run_dir/recipe.toml``.

    Empty when the run has no such guard or no recipe file (a metrics log
    copied on its own): the limits only annotate the plot.
    """
    try:
        recipe = tomllib.loads((Path(run_dir) / "recipe.toml").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{Path(run_dir) / 'recipe.toml'}: cannot be read ({exc})") from None
    out: dict[str, float] = {}
    guards = recipe.get("guard", [])
    for guard in guards if isinstance(guards, list) else []:
        if not isinstance(guard, dict) or guard.get("name") != "collapse":
            continue
        for key, option in _GUARD_OPTIONS.items():
            if isinstance(guard.get(option), (int, float)):
                out[key] = float(guard[option])
    return out


def plan_panels(series: Mapping[str, Any], thresholds: Mapping[str, float] | None = None) -> list[Panel]:
    """The panels :func:`plot_run` draws for ``series``, top to bottom.

    Loss first; then target std, effective rank and the evaluators' scores
    when the log has them; then learning rate, gradient norm and skipped
    updates (shown as "not logged" when absent; left out when none was
    skipped, which the figure's title says instead).
    """
    thresholds = thresholds or {}
    (loss_title, loss_keys), *rest = PANELS
    panels = [Panel(loss_title, _matching(series, loss_keys))]
    for title, keys in COLLAPSE_PANELS:
        shown = _matching(series, keys)
        if shown:
            limits = tuple(thresholds[k] for k in keys if k in thresholds)
            panels.append(Panel(title, shown, limits))
    scores = _eval_keys(series)
    if scores:
        panels.append(Panel("evaluation (held-out, higher is better)", scores))
    panels += [Panel(title, _matching(series, keys)) for title, keys in rest
               if not (keys == ("skipped_updates",) and none_skipped(series))]
    return panels


def none_skipped(series: Mapping[str, Any]) -> bool:
    """The log has ``skipped_updates`` and it never left 0: a panel of zeros says nothing."""
    values = series.get("skipped_updates", ((), ()))[1]
    return bool(values) and all(v == 0 or math.isnan(v) for v in values)


def _label(key: str) -> str:
    if key == "loss":
        return "overall"
    if key.startswith("eval/"):
        return key.removeprefix("eval/")  # "<evaluator>/<score>"
    return key.split("/", 1)[-1]


def step_label(step: float) -> str:
    """An update step as a tick label short enough for a narrow panel: 2,500, 24k, 1.2M."""
    if abs(step) >= 1e6:
        return f"{step / 1e6:.4g}M"
    if abs(step) >= 1e4:
        return f"{step / 1e3:.4g}k"
    return f"{step:,.0f}"


def step_axis(axis: Any) -> None:
    """Integer update steps on a matplotlib axis, a few ticks of :func:`step_label`
    (default tick labels of five-digit steps run into each other)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    axis.set_major_formatter(FuncFormatter(lambda value, _: step_label(value)))


def plain_numbers(axis: Any) -> None:
    """Tick labels of a log axis as numbers (0.3, 0.05), not powers of ten (3x10^-1)."""
    from matplotlib.ticker import FuncFormatter

    def minor(value: float, _: Any) -> str:  # 2 and 5 times a power of ten: enough, never crowded
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9) if value > 0 else 0
        return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def plot_run(metrics_path: str | Path, png_path: str | Path,
             lr_per_step: tuple[list[int], list[float]] | None = None) -> Path:
    """Draw the panels of :func:`plan_panels` for the log at ``metrics_path`` into ``png_path``.

    The collapse guard's thresholds come from ``recipe.toml`` beside the log.
    ``lr_per_step``: the schedule at every update step (the logged LR is
    sampled at log steps only, which can hide a short warmup), drawn as the
    line with the logged values as points on it.
    """
    from matplotlib.figure import Figure  # heavy imports: only when a plot is drawn

    metrics_path = Path(metrics_path)
    series = read_metrics(metrics_path)
    if "loss" not in series:
        raise UserError(f"{metrics_path}: no 'loss' in the metrics log; is it a training run's log?")
    panels = plan_panels(series, collapse_thresholds(metrics_path.parent))

    fig = Figure(figsize=(8.0, 2.25 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    for ax, panel in zip(axes, panels):
        if panel.keys == ("lr",) and lr_per_step is not None:
            ax.plot(*lr_per_step, label="schedule (every update step)", linewidth=1.2)
        for key in panel.keys:
            steps, values = series[key]
            overall = key == "loss"
            if key.startswith("loss/"):  # 0.0: no sample of that domain in the interval
                values = [math.nan if v == 0.0 else v for v in values]
            # Evaluations are few points far apart: always marked.
            marked = len(steps) < 50 or key.startswith("eval/")
            if key == "lr" and lr_per_step is not None:
                ax.plot(steps, values, ".", label="logged", markersize=4)
                continue
            ax.plot(steps, values, label=_label(key), linewidth=2.0 if overall else 1.2,
                    marker="." if marked else None)
        for limit in panel.thresholds:
            ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1.0, label=f"collapse guard {limit:g}")
        if not panel.keys:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        if len(panel.keys) + len(panel.thresholds) + (panel.keys == ("lr",) and lr_per_step is not None) > 1:
            ax.legend(fontsize="small", loc="best")
        ax.set_ylabel(panel.title.split(" (")[0])
        ax.set_title(panel.title, fontsize="medium")
        ax.grid(True, alpha=0.3)
        if panel.keys == ("metric/position_share",):
            ax.set_ylim(0.0, 1.0)  # against its maximum, 1: position explains everything
        elif panel.keys and panel.keys[0] in _GUARD_OPTIONS:
            # From 0: noise in a healthy std of 0.05 must not look like a collapse.
            ax.set_ylim(bottom=0.0)
    losses = [v for v in series["loss"][1] if not math.isnan(v)]
    if losses and min(losses) > 0 and max(losses) / min(losses) > 10:
        axes[0].set_yscale("log")  # losses that span decades (early in training); linear otherwise
        plain_numbers(axes[0].yaxis)
    axes[-1].set_xlabel("update step")
    step_axis(axes[-1].xaxis)
    run = metrics_path.parent  # runs/<recipe name>/<timestamp>
    skipped = "; no update skipped" if none_skipped(series) else ""
    fig.suptitle(f"{run.parent.name} run {run.name}: {series['loss'][0][-1]:,} update steps logged{skipped}")

    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
