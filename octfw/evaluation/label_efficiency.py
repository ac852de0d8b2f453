"""``octfw eval SOURCE [SOURCE ...] --recipe EVAL.toml --shots 5,10,50,all``: label efficiency.

For each encoder and for one randomly initialised encoder (the first encoder's architecture,
shared by every encoder named side by side, so its fits are made once), each evaluator encodes
its splits once, then fits its classifier on ``k`` labelled volumes per class for each ``k``
(several seeded draws, the same volumes for every encoder) and measures it on the whole test
split (:mod:`octfw.evaluation.shots`).

The report (:class:`ShotsReport`):

- a summary row per (encoder, evaluator, shots, metric): mean and standard deviation over
  draws, and for each encoder its difference from random init: the mean over draws of the
  paired gain (both fitted on the same volumes in each draw) with a 95 % interval from
  resampling the test split's patients, the same resamples for every draw and both networks
  (where the evaluator keeps its test predictions; else the plain difference of the means);
- a row per draw (``draw_rows``): each fit's value with its own patient-bootstrap interval and
  its paired difference from the random encoder's fit on the same volumes.

Every labelled volume a fit used is counted beside the shots: the ``k`` drawn to train on and,
for an evaluator that chooses on a validation split (an epoch, a grid member, the decoder's
network), that whole split, labelled too and used at every shot count (``training_volumes`` and
``validation_volumes`` in every row, and the table's ``labelled`` column).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import numpy as np
import torch

from octfw.display.errors import UserError
from octfw.display.tables import render_table
from octfw.evaluation.reporting import (boundary_legend, interval_keys, is_interval_key, format_test_split,
                                       summarise_test_split)
from octfw.evaluation.shots import ALL, label_efficiency, sample_per_class, shot_label, summarise
from octfw.evaluation.target import (Counter, EvalRecipe, EvalTarget, Progress, build_evaluators, eval_device,
                                    main_metric)
from octfw.registry import Registry
from octfw.types import ComparingEvaluator, RefittingEvaluator

__all__ = ["RANDOM_INIT", "ShotsReport", "evaluate_shots", "format_shots", "write_shots"]

#: The randomly initialised encoder's name in the rows.
RANDOM_INIT = "random_init"
#: Metrics of the printed table (every metric goes to the CSV and JSON).
TABLE_METRICS = ("balanced_accuracy", "auroc", "tokens_balanced_accuracy", "tokens_auroc", "voxel_dice", "token_dice",
                 "fine_tune_voxel_dice", "mean_dice", "in_vendor_mean_dice", "cross_vendor_mean_dice")
_DIFFERENCE = ("difference", "difference_ci_low", "difference_ci_high")
CSV_COLUMNS = ("encoder", "evaluator", "shots", "volumes_per_class", "training_volumes", "validation_volumes", "metric",
               "mean", "std", "draws", *_DIFFERENCE)
#: The columns of a row per draw (``draw_rows``, the ``_draws.csv`` file and the run folder's ``eval/`` CSV).
DRAW_COLUMNS = ("encoder", "evaluator", "shots", "draw", "training_volumes", "validation_volumes", "metric", "value",
                "ci_low", "ci_high", *_DIFFERENCE)
#: The table's legend of its ``labelled`` column, where an evaluator chooses on a validation split.
LABELLED_LEGEND = ("labelled  the training volumes drawn + the validation split (val), labelled too: it chooses "
                   "the network at every shot count")
PAIRED_LEGEND = ("- random    the encoder minus random init, mean over draws (both fitted on the same labelled volumes "
                 "in each draw); [low, high]: 95 % interval over the test patients, paired (every draw and both "
                 "encoders on the same resamples; none where the evaluator keeps no test predictions); the "
                 "spread over draws is the ± beside each encoder; every draw's own row, with its intervals: "
                 "--json, the _draws.csv")
PLAIN_LEGEND = ("- random    the encoder minus random init, mean over draws (no interval: the evaluator keeps no "
                "test predictions)")


@attrs.frozen
class ShotsReport:
    location: str  #: the (first) encoder's checkpoint, export or recipe
    update_step: int | None
    seed: int
    device: str
    shots: list[str]  #: as asked, "all" for the whole train split
    draws: int
    #: one row per (encoder, evaluator, shots, metric): CSV_COLUMNS
    rows: list[dict[str, Any]]
    #: one row per (encoder, evaluator, shots, draw, metric): DRAW_COLUMNS
    draw_rows: list[dict[str, Any]] = attrs.field(factory=list)
    #: encoder name -> what it is ("pretrained" for one encoder); the random one is RANDOM_INIT
    encoders: dict[str, str] = attrs.field(factory=dict)
    #: "<evaluator>" -> the test split's volumes and patients (:func:`.reporting.summarise_test_split`)
    test_split: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def csv_rows(self) -> list[dict[str, Any]]:
        """The run folder's ``eval/`` CSV: a row per draw."""
        return self.draw_rows


def _check_shots(evaluators: Sequence[tuple[str, Any]], shots: Sequence[int | None]) -> None:
    """Refuse an evaluator that cannot refit on a subset, or a count larger than a class,
    before any volume is encoded."""
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


#: One fit: (shot count, draw, its metrics, its kept test predictions or None).
_Fit = tuple["int | None", int, dict[str, float], Any]


def evaluate_shots(targets: Mapping[str, EvalTarget], recipe: EvalRecipe, registry: Registry,
                   shots: Sequence[int | None], draws: int, progress: Progress | None = None) -> ShotsReport:
    """Label efficiency of each of ``targets`` (name -> target; ``{"pretrained": target}`` for one)
    and of the first one's randomly initialised network, with every evaluator of ``recipe``.

    The draws of evaluator ``e`` are seeded with its ``split_seed``: every encoder is fitted on the
    same volumes. The random network is fitted once per draw whatever the number of encoders.
    """
    if draws < 1:
        raise UserError(f"--draws {draws}: give 1 or more")
    first = next(iter(targets.values()))
    device = eval_device(recipe)
    evaluators = build_evaluators(first, recipe, registry)
    _check_shots(evaluators, shots)
    models = [*((name, target.pretrained) for name, target in targets.items()), (RANDOM_INIT, first.random_init)]
    fits = sum(1 if count is ALL else draws for count in shots)
    counter = Counter(len(models) * len(evaluators) * (1 + fits), progress)

    found: dict[tuple[str, str], list[_Fit]] = {}
    for encoder, model in models:
        model = model.to(device)
        try:
            for name, evaluator in evaluators:
                where = f"{encoder.replace('_', ' ')}: {name}"
                kept = found.setdefault((encoder, name), [])

                def keep(count: int | None, draw: int, metrics: dict[str, float], evaluator: Any = evaluator,
                         kept: list[_Fit] = kept) -> None:
                    predictions = (evaluator.last_test_probabilities if isinstance(evaluator, ComparingEvaluator)
                                   else None)
                    kept.append((count, draw, metrics, predictions))

                with torch.no_grad(), counter.running(where):
                    encoded = evaluator.encode(model, device)
                    counter.finished(f"{where}: encoded")
                    label_efficiency(evaluator, encoded, shots, draws, int(evaluator.split_seed),
                                     on_fit=lambda text, where=where: counter.finished(f"{where}: {text}"), name=name,
                                     on_draw=keep)
                del encoded  # one encoding at a time on the device
        finally:
            model.to("cpu")
    rows, draw_rows = _rows(evaluators, found, [e for e, _ in models], shots)
    encoders = {name: target.location + ("" if target.update_step is None else f" (update step {target.update_step})")
                for name, target in targets.items()}
    return ShotsReport(first.location, first.update_step, recipe.run.seed, str(device),
                       [shot_label(c) for c in shots], draws, rows, draw_rows, encoders,
                       summarise_test_split(evaluators))


def _stacked(predictions: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Several fits' kept test predictions as one mapping of ``[fits, ...]`` arrays."""
    return {key: np.stack([np.asarray(p[key]) for p in predictions]) for key in predictions[0]}


def _difference(evaluator: Any, mine: Sequence[_Fit], baseline: Sequence[_Fit]) -> dict[str, float]:
    """``mine`` minus ``baseline`` (fits paired by draw): the mean over the fits of each metric's
    difference, with the evaluator's paired interval where both kept their test predictions."""
    out: dict[str, float] = {}
    for metric in mine[0][2]:
        if not is_interval_key(metric) and all(metric in fit[2] for fit in (*mine, *baseline)):
            out[metric] = float(np.mean([a[2][metric] - b[2][metric] for a, b in zip(mine, baseline)]))
    if all(fit[3] is not None for fit in (*mine, *baseline)):
        out.update(evaluator.difference(_stacked([f[3] for f in mine]), _stacked([f[3] for f in baseline])))
    return out


def _interval(values: Mapping[str, float], metric: str, column: str) -> dict[str, Any]:
    low, high = interval_keys(metric)
    return {column: values.get(metric, ""), f"{column}_ci_low": values.get(low, ""),
            f"{column}_ci_high": values.get(high, "")}


def _rows(evaluators: Sequence[tuple[str, Any]], found: Mapping[tuple[str, str], list[_Fit]], encoders: Sequence[str],
          shots: Sequence[int | None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(summary rows, rows per draw) of every fit in ``found``."""
    rows: list[dict[str, Any]] = []
    draw_rows: list[dict[str, Any]] = []
    for name, evaluator in evaluators:
        pool = len(evaluator.fit_positions())
        classes = len(set(evaluator.split()[0].labels.tolist()))
        fit_val = getattr(evaluator, "fit_val_positions", None)
        validation = 0.0 if fit_val is None else float(len(fit_val()[1]))
        for count in shots:
            counted = {"volumes_per_class": pool / classes if count is ALL else float(count),
                       "training_volumes": float(pool) if count is ALL else float(count * classes),
                       "validation_volumes": validation}
            baseline = [fit for fit in found[(RANDOM_INIT, name)] if fit[0] == count]
            for encoder in encoders:
                mine = [fit for fit in found[(encoder, name)] if fit[0] == count]
                summary = {} if encoder == RANDOM_INIT else _difference(evaluator, mine, baseline)
                where = {"encoder": encoder, "evaluator": name, "shots": shot_label(count)}
                for metric, (mean, std) in summarise([fit[2] for fit in mine]).items():
                    if not is_interval_key(metric):  # each draw's interval is in its own row
                        rows.append({**where, **counted, "metric": metric, "mean": mean, "std": std,
                                     "draws": len(mine), **_interval(summary, metric, "difference")})
                for fit, paired in zip(mine, baseline):
                    gain = {} if encoder == RANDOM_INIT else _difference(evaluator, [fit], [paired])
                    draw_rows += [{**where, "draw": fit[1] + 1, "training_volumes": counted["training_volumes"],
                                   "validation_volumes": validation, "metric": metric,
                                   **_interval(fit[2], metric, "value"), **_interval(gain, metric, "difference")}
                                  for metric in fit[2] if not is_interval_key(metric)]
    for row in draw_rows:  # "value_ci_low" -> "ci_low": a draw row has one value
        row["ci_low"], row["ci_high"] = row.pop("value_ci_low"), row.pop("value_ci_high")
    return rows, draw_rows


def _labelled(row: Mapping[str, Any]) -> str:
    """``5 + 12 val``: the training volumes a fit drew and the validation volumes it chose on."""
    validation = row["validation_volumes"]
    return f"{row['training_volumes']:g}" + (f" + {validation:g} val" if validation else "")


def _mean_spread(row: Mapping[str, Any] | None) -> str:
    """``0.812 ± 0.031`` over several draws; ``0.812`` for one (a spread of one draw is not 0)."""
    if row is None:
        return "-"
    return f"{row['mean']:.3f}" if row["draws"] < 2 else f"{row['mean']:.3f} ± {row['std']:.3f}"


def _difference_cell(row: Mapping[str, Any] | None) -> str:
    """``+0.112 [+0.03, +0.20]``: the mean difference over draws and its paired interval (where known)."""
    if row is None or row["difference"] == "":
        return "-"
    text, low, high = f"{row['difference']:+.3f}", row["difference_ci_low"], row["difference_ci_high"]
    return text if low == "" or high == "" else f"{text} [{low:+.2f}, {high:+.2f}]"


def _shown(encoder: str) -> str:
    return encoder.replace("_", " ")


def _one_class(report: ShotsReport, evaluator: str) -> bool:
    """True where ``k`` counts labelled volumes, not volumes per class (layer segmentation)."""
    return all(r["volumes_per_class"] == r["training_volumes"] for r in report.rows if r["evaluator"] == evaluator)


def format_shots(report: ShotsReport) -> str:
    """One table per evaluator and metric (balanced accuracy and AUROC; a dense evaluator's Dice):
    rows = shot counts; columns = the labelled volumes used (training, and validation where the
    evaluator chooses on it), each encoder's and random init's mean ± std over draws, then each
    encoder's difference from random init with its paired interval."""
    encoders = list(report.encoders) or ["pretrained"]
    width = len("baseline") if encoders == ["pretrained"] else max(len(e) for e in [*encoders, "baseline"])
    if encoders == ["pretrained"]:
        step = "" if report.update_step is None else f" (update step {report.update_step})"
        lines = [f"{'encoder'.ljust(width)}  {report.location}{step}",
                 f"{'baseline'.ljust(width)}  same architecture, randomly initialised (seed {report.seed})"]
    else:
        lines = [f"{e.ljust(width)}  {report.encoders[e]}" for e in encoders]
        lines.append(f"{'baseline'.ljust(width)}  the first encoder's architecture, randomly initialised "
                     f"(seed {report.seed}), fitted once per draw for all")
    evaluators = list(dict.fromkeys(r["evaluator"] for r in report.rows))
    lines += [f"{'device'.ljust(width)}  {report.device}",
              f"{'draws'.ljust(width)}  {report.draws} per shot count ('all': 1); mean ± std over draws (a single "
              "draw: its value)", format_test_split(report.test_split, evaluators, width), ""]
    rows = {(r["encoder"], r["evaluator"], r["shots"], r["metric"]): r for r in report.rows}
    for evaluator in evaluators:
        per_class = not _one_class(report, evaluator)
        for metric in (m for m in TABLE_METRICS if (encoders[0], evaluator, report.shots[0], m) in rows):
            header = ["shots", *(["per class"] if per_class else []), "labelled",
                      *(_shown(e) for e in [*encoders, RANDOM_INIT]), *(f"{_shown(e)} - random" for e in encoders)]
            table = []
            for shots in report.shots:
                first = rows[(encoders[0], evaluator, shots, metric)]
                cells = [shots, *([f"{first['volumes_per_class']:g}"] if per_class else []), _labelled(first)]
                cells += [_mean_spread(rows.get((e, evaluator, shots, metric))) for e in [*encoders, RANDOM_INIT]]
                cells += [_difference_cell(rows.get((e, evaluator, shots, metric))) for e in encoders]
                table.append(cells)
            lines.append(f"{evaluator} {metric}:")
            lines += [render_table(header, table, right=range(len(header)), indent=2), ""]
    if any(r["validation_volumes"] for r in report.rows):
        lines.append(LABELLED_LEGEND)
    paired = any(r["difference_ci_low"] != "" for r in report.rows)
    lines.append(PAIRED_LEGEND if paired else PLAIN_LEGEND)
    lines += boundary_legend(report.test_split, [f"{r['evaluator']}/{r['metric']}" for r in report.rows])
    return "\n".join(lines).rstrip()


def write_shots(report: ShotsReport, png: str | Path, metric: str | None = None) -> dict[str, str]:
    """The PNG (``metric`` of every evaluator against labelled volumes) and, beside it, a CSV of
    every metric's summary (same name, ``.csv``) and one of every draw (``_draws.csv``).
    Returns ``{"png": ..., "csv": ..., "draws_csv": ...}``."""
    from octfw.evaluation.curves import plot_label_efficiency

    png = Path(png)
    tables = {"csv": (png.with_suffix(".csv"), CSV_COLUMNS, report.rows),
              "draws_csv": (png.with_name(f"{png.stem}_draws.csv"), DRAW_COLUMNS, report.draw_rows)}
    png.parent.mkdir(parents=True, exist_ok=True)
    for path, columns, rows in tables.values():
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)

    found = {(r["encoder"], r["evaluator"], r["shots"], r["metric"]): r for r in report.rows}
    encoders = list(dict.fromkeys(r["encoder"] for r in report.rows))
    curves: dict[str, tuple[str, dict[str, list[tuple[str, float, float, float]]]]] = {}
    xlabels = {}
    for evaluator in dict.fromkeys(r["evaluator"] for r in report.rows):
        chosen = main_metric([r["metric"] for r in report.rows if r["evaluator"] == evaluator], metric)
        lines = {}
        for encoder in encoders:
            points = [found[(encoder, evaluator, shots, chosen)] for shots in report.shots]
            lines[encoder] = [(r["shots"], r["volumes_per_class"], r["mean"], r["std"]) for r in points]
        curves[evaluator] = (chosen, lines)
        xlabels[evaluator] = "labelled volumes" if _one_class(report, evaluator) else "labelled volumes per class"
    step = "" if report.update_step is None else f", update step {report.update_step}"
    plot_label_efficiency(curves, png, title=f"label efficiency: {Path(report.location).name}{step}", xlabels=xlabels)
    return {"png": str(png), **{key: str(path) for key, (path, _, _) in tables.items()}}
