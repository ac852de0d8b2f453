"""PNG plots of evaluation results: label efficiency and a metric over checkpoints.

Both take plain data (what ``octfw eval`` computed), draw one panel per
evaluator and write one PNG. matplotlib is imported only when drawing, with
its object API (no pyplot state), as :mod:`octfw.display.plots` does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

from octfw.display.plots import step_axis

__all__ = ["plot_label_efficiency", "plot_checkpoint_curves"]

#: One point of a label-efficiency curve: (shot label, volumes per class, mean, std over draws).
ShotPoint = tuple[str, float, float, float]
#: One point of a checkpoint curve: (update step, value, 95 % interval low or None, high or None).
StepPoint = tuple[int, float, "float | None", "float | None"]


def _panels(count: int, width: float = 5.0, height: float = 3.6):
    from matplotlib.figure import Figure

    columns = min(count, 3)
    rows = math.ceil(count / columns)
    fig = Figure(figsize=(width * columns, height * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel().tolist()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def _label(ax, xlabel: str, metric: str, evaluator: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(metric)
    ax.set_title(evaluator, fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")


def _save(fig, png: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    path = Path(png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_label_efficiency(curves: Mapping[str, tuple[str, Mapping[str, Sequence[ShotPoint]]]],
                          png: str | Path, title: str = "", xlabels: Mapping[str, str] | None = None) -> Path:
    """``curves[evaluator] = (metric, {encoder: points})`` -> one panel per evaluator,
    one line per encoder (``random_init`` dashed).

    x: labelled volumes per class (log scale; ``all`` at the train split's
    mean per class, labelled "all"), or what ``xlabels[evaluator]`` says; y: the
    metric's mean over draws, with the standard deviation as error bars.
    """
    fig, axes = _panels(len(curves))
    for ax, (evaluator, (metric, by_encoder)) in zip(axes, curves.items()):
        ticks: dict[float, str] = {}
        for encoder, points in by_encoder.items():
            xs = [p[1] for p in points]
            ax.errorbar(xs, [p[2] for p in points], yerr=[p[3] for p in points], marker="o", capsize=3,
                        linestyle="--" if encoder == "random_init" else "-", label=encoder.replace("_", " "))
            ticks.update({p[1]: p[0] for p in points})
        ax.set_xscale("log")
        ax.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)])
        ax.minorticks_off()
        _label(ax, (xlabels or {}).get(evaluator, "labelled volumes per class"), metric, evaluator)
    return _save(fig, png, title)


def plot_checkpoint_curves(curves: Mapping[str, tuple[str, Sequence[StepPoint]]],
                           baselines: Mapping[str, float | None], png: str | Path, title: str = "") -> Path:
    """``curves[evaluator] = (metric, points)`` -> one panel per evaluator: the metric over
    update steps, its 95 % interval shaded where known, the randomly initialised encoder
    (``baselines[evaluator]``) dashed."""
    fig, axes = _panels(len(curves))
    for ax, (evaluator, (metric, points)) in zip(axes, curves.items()):
        steps = [p[0] for p in points]
        ax.plot(steps, [p[1] for p in points], marker="o", label="pretrained")
        bounded = [p for p in points if p[2] is not None and p[3] is not None]
        if bounded:
            ax.fill_between([p[0] for p in bounded], [p[2] for p in bounded], [p[3] for p in bounded],
                            alpha=0.2, label="95 % interval")
        baseline = baselines.get(evaluator)
        if baseline is not None:
            ax.axhline(baseline, linestyle="--", color="grey", label="random init")
        step_axis(ax.xaxis)
        _label(ax, "update step", metric, evaluator)
    return _save(fig, png, title)
