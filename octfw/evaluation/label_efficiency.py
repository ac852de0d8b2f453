"""``octfw eval SOURCE --recipe EVAL.toml --shots 5,10,50,all``: label efficiency.

For the pretrained and the randomly initialised encoder, each evaluator
encodes its splits once, then fits its classifier on ``k`` labelled volumes
per class for each ``k`` (several seeded draws, the same volumes for both
encoders) and measures it on the whole test split
(:mod:`octfw.evaluation.shots`). The result is a table of mean ± standard
deviation over draws, a CSV of every metric and a PNG of one metric against
the number of labelled volumes.

Every labelled volume a fit used is counted beside the shots: the ``k`` drawn
to train on and, for an evaluator that chooses on a validation split (an
epoch, a grid member, the decoder's network), that whole split, labelled too
and used at every shot count (``training_volumes`` and ``validation_volumes``
in every row, and the table's ``labelled`` column).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import torch

from octfw.display.errors import UserError
from octfw.evaluation.shots import ALL, label_efficiency, sample_per_class, shot_label, summarise
from octfw.evaluation.target import (
    EvalRecipe,
    EvalTarget,
    Progress,
    build_evaluators,
    eval_device,
    is_interval_key,
    main_metric,
)
from octfw.registry import Registry
from octfw.display.tables import render_table
from octfw.types import RefittingEvaluator

__all__ = ["ShotsReport", "evaluate_shots", "format_shots", "write_shots"]

#: Metrics of the printed table (every metric goes to the CSV and JSON).
TABLE_METRICS = ("balanced_accuracy", "auroc", "tokens_balanced_accuracy", "tokens_auroc", "voxel_dice", "token_dice",
                 "fine_tune_voxel_dice", "mean_dice", "in_vendor_mean_dice", "cross_vendor_mean_dice")
CSV_COLUMNS = ("encoder", "evaluator", "shots", "volumes_per_class", "training_volumes", "validation_volumes", "metric",
               "mean", "std", "draws")
#: The table's legend of its ``labelled`` column, where an evaluator chooses on a validation split.
LABELLED_LEGEND = ("labelled  the training volumes drawn + the validation split (val), labelled too: it chooses "
                   "the network at every shot count")


@attrs.frozen
class ShotsReport:
    location: str
    update_step: int | None
    seed: int
    device: str
    shots: list[str]  #: as asked, "all" for the whole train split
    draws: int
    #: one row per (encoder, evaluator, shots, metric): CSV_COLUMNS
    rows: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _check_shots(evaluators: Sequence[tuple[str, Any]], shots: Sequence[int | None]) -> None:
    """Refuse an evaluator that cannot refit on a subset, or a count larger than a class,
    before any volume is encoded."""
    import numpy as np

    for name, evaluator in evaluators:
        if not isinstance(evaluator, RefittingEvaluator):
            raise UserError(f"--shots: evaluator {name} cannot refit on a subset of its train split "
                            "(the built-in linear-probe, knn, attentive-probe, fine-tune, dense-probe and "
                            "layer-segmentation can)")
        labels = evaluator.split()[0].labels
        pool = np.asarray(evaluator.fit_positions(), dtype=np.int64)
        for count in shots:
            if count is not ALL:
                sample_per_class(labels, pool, count, np.random.default_rng(0), f"evaluator {name}: ")


def evaluate_shots(target: EvalTarget, recipe: EvalRecipe, registry: Registry, shots: Sequence[int | None],
                   draws: int, progress: Progress | None = None) -> ShotsReport:
    """Label efficiency of ``target``'s pretrained and random networks with every evaluator of ``recipe``.

    The draws of evaluator ``e`` are seeded with its ``split_seed``: the
    pretrained and the random encoder are fitted on the same volumes.
    """
    if draws < 1:
        raise UserError(f"--draws {draws}: give 1 or more")
    device = eval_device(recipe)
    evaluators = build_evaluators(target, recipe, registry)
    _check_shots(evaluators, shots)
    fits = sum(1 if count is ALL else draws for count in shots)
    total, done = 2 * len(evaluators) * (1 + fits), 0

    def advance(text: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, text)

    rows: list[dict[str, Any]] = []
    for encoder, model in (("pretrained", target.pretrained), ("random_init", target.random_init)):
        model = model.to(device)
        try:
            for name, evaluator in evaluators:
                where = f"{encoder.replace('_', ' ')}: {name}"
                with torch.no_grad():
                    encoded = evaluator.encode(model, device)
                    advance(f"{where}: encoded")
                    results = label_efficiency(evaluator, encoded, shots, draws, int(evaluator.split_seed),
                                               on_fit=lambda text, where=where: advance(f"{where}: {text}"),
                                               name=name)
                pool = len(evaluator.fit_positions())
                classes = len(set(evaluator.split()[0].labels.tolist()))
                validation = _validation_volumes(evaluator)
                for count, runs in results:
                    per_class = pool / classes if count is ALL else float(count)
                    training = float(pool) if count is ALL else float(count * classes)
                    for metric, (mean, std) in summarise(runs).items():
                        if is_interval_key(metric):
                            continue  # one interval per draw; the spread over draws is the std
                        rows.append({"encoder": encoder, "evaluator": name, "shots": shot_label(count),
                                     "volumes_per_class": per_class, "training_volumes": training,
                                     "validation_volumes": validation, "metric": metric, "mean": mean,
                                     "std": std, "draws": len(runs)})
        finally:
            model.to("cpu")
    return ShotsReport(target.location, target.update_step, recipe.run.seed, str(device),
                       [shot_label(c) for c in shots], draws, rows)


def _validation_volumes(evaluator: Any) -> float:
    """The volumes of the validation split an evaluator chooses on at every shot count (0: none)."""
    fit_val = getattr(evaluator, "fit_val_positions", None)
    return 0.0 if fit_val is None else float(len(fit_val()[1]))


def _labelled(row: Mapping[str, Any]) -> str:
    """``5 + 12 val``: the training volumes a fit drew and the validation volumes it chose on."""
    validation = row["validation_volumes"]
    return f"{row['training_volumes']:g}" + (f" + {validation:g} val" if validation else "")


def _lookup(report: ShotsReport) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    return {(r["encoder"], r["evaluator"], r["shots"], r["metric"]): r for r in report.rows}


def _mean_spread(row: Mapping[str, Any]) -> str:
    """``0.812 ± 0.031`` over several draws; ``0.812`` for one (a spread of one draw is not 0)."""
    return f"{row['mean']:.3f}" if row["draws"] < 2 else f"{row['mean']:.3f} ± {row['std']:.3f}"


def format_shots(report: ShotsReport) -> str:
    """One table per evaluator: rows = shot counts, columns = the labelled volumes used (training,
    and validation where the evaluator chooses on it), balanced accuracy and AUROC (a dense
    evaluator: voxel and token Dice) (mean ± std over draws) of the pretrained and the random encoder."""
    step = "" if report.update_step is None else f" (update step {report.update_step})"
    lines = [f"encoder   {report.location}{step}",
             f"baseline  same architecture, randomly initialised (seed {report.seed})",
             f"device    {report.device}",
             f"draws     {report.draws} per shot count ('all': 1); mean ± std over draws (a single "
             "draw: its value)", ""]
    rows = _lookup(report)
    for evaluator in dict.fromkeys(r["evaluator"] for r in report.rows):
        metrics = [m for m in TABLE_METRICS if ("pretrained", evaluator, report.shots[0], m) in rows]
        header = ["shots", "per class", "labelled"] + [f"{m} {e}" for m in metrics
                                                      for e in ("pretrained", "random init")]
        table = [header]
        for shots in report.shots:
            first = next(r for r in report.rows if (r["encoder"], r["evaluator"], r["shots"]) ==
                         ("pretrained", evaluator, shots))
            cells = [shots, f"{first['volumes_per_class']:g}", _labelled(first)]
            for metric in metrics:
                for encoder in ("pretrained", "random_init"):
                    row = rows.get((encoder, evaluator, shots, metric))
                    cells.append("-" if row is None else _mean_spread(row))
            table.append(cells)
        lines.append(f"{evaluator}:")
        lines += [render_table(header, table[1:], right=range(len(header)), indent=2), ""]
    if any(r["validation_volumes"] for r in report.rows):
        lines.append(LABELLED_LEGEND)
    return "\n".join(lines).rstrip()


def write_shots(report: ShotsReport, png: str | Path, metric: str | None = None) -> tuple[Path, Path]:
    """The PNG (``metric`` of every evaluator against labelled volumes per class) and,
    beside it, a CSV of every metric (same name, ``.csv``). Returns both paths."""
    from octfw.evaluation.curves import plot_label_efficiency

    png = Path(png)
    table = png.with_suffix(".csv")
    table.parent.mkdir(parents=True, exist_ok=True)
    with table.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(report.rows)

    rows = _lookup(report)
    curves: dict[str, tuple[str, dict[str, list[tuple[str, float, float, float]]]]] = {}
    for evaluator in dict.fromkeys(r["evaluator"] for r in report.rows):
        chosen = main_metric([r["metric"] for r in report.rows if r["evaluator"] == evaluator], metric)
        lines = {}
        for encoder in ("pretrained", "random_init"):
            found = [rows[(encoder, evaluator, shots, chosen)] for shots in report.shots]
            lines[encoder] = [(r["shots"], r["volumes_per_class"], r["mean"], r["std"]) for r in found]
        curves[evaluator] = (chosen, lines)
    step = "" if report.update_step is None else f", update step {report.update_step}"
    plot_label_efficiency(curves, png, title=f"label efficiency: {Path(report.location).name}{step}")
    return png, table
