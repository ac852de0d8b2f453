"""``octfw eval A B C --recipe EVAL.toml``: several encoders side by side, with one baseline.

Each source is what :func:`octfw.evaluation.target.load_target` reads (a run folder, a
checkpoint, an export, or a training recipe: the model it starts from, e.g. published
weights as they are). All must share one input geometry, so that the evaluators prepare
the same volumes for each; the randomly initialised baseline is the first source's
architecture. Each encoder's difference from the baseline carries a paired bootstrap
interval where the evaluator keeps its test predictions. A typical use (issue #50): the
published weights as they are, the same continued on OCT, and random initialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import attrs

from octfw.display.errors import UserError
from octfw.evaluation.reporting import (DIFFERENCE_LEGEND, INTERVAL_LEGEND, boundary_legend, format_difference,
                                       format_value, is_interval_key, plain_differences, format_test_split,
                                       summarise_test_split, with_interval)
from octfw.evaluation.target import (EvalRecipe, EvalTarget, Progress, build_evaluators, eval_device, load_target,
                                     paired_differences, score_models)
from octfw.registry import Registry
from octfw.display.tables import render_table

__all__ = ["ComparisonReport", "source_labels", "load_targets", "compare_sources", "format_comparison"]

#: The baseline's column.
RANDOM = "random init"


@attrs.frozen
class ComparisonReport:
    seed: int
    device: str
    locations: dict[str, str]  #: label -> the checkpoint, export or recipe evaluated
    scores: dict[str, dict[str, float]]  #: label -> "<evaluator>/<metric>" -> value; RANDOM included
    #: label -> that encoder minus the baseline for every metric both report, with paired bootstrap
    #: intervals where the evaluator keeps its test predictions
    differences: dict[str, dict[str, float]]
    #: "<evaluator>" -> the test split's volumes and patients (:func:`.reporting.summarise_test_split`)
    test_split: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def metrics(self) -> list[str]:
        keys = [k for scores in self.scores.values() for k in scores]
        return [k for k in dict.fromkeys(keys) if not is_interval_key(k.partition("/")[2])]

    def csv_rows(self) -> list[dict[str, Any]]:
        """One row per metric: each encoder's value and interval, then each one's difference."""
        rows = []
        for key in self.metrics():
            row: dict[str, Any] = {"metric": key}
            for label, scores in self.scores.items():
                row.update(with_interval(scores, key, label))
            for label, difference in self.differences.items():
                row.update(with_interval(difference, key, f"{label} - {RANDOM}"))
            rows.append(row)
        return rows


def source_labels(sources: Sequence[str], names: Sequence[str] | None) -> list[str]:
    """The column of each source: ``names`` (as many as sources), else each path's stem
    (a run folder's recipe and run where its name alone is a date)."""
    if names is not None:
        if len(names) != len(sources):
            raise UserError(f"--names: {len(names)} names for {len(sources)} encoders; give one per encoder")
        labels = list(names)
    else:
        labels = []
        for source in sources:
            path = Path(source)
            labels.append(f"{path.parent.name}/{path.name}" if path.is_dir() else path.stem)
    if len(set(labels)) != len(labels) or RANDOM in labels:
        raise UserError(f"encoder names {labels} repeat one another (or {RANDOM!r}); name them with --names")
    return labels


def load_targets(sources: Sequence[str], labels: Sequence[str], seed: int,
                 registry: Registry) -> dict[str, EvalTarget]:
    """``{label: target}`` of each source, refused unless all share the first one's input geometry
    (the evaluators prepare the volumes once, for all of them)."""
    targets = {label: load_target(source, seed, registry) for label, source in zip(labels, sources)}
    first_label, first = next(iter(targets.items()))
    for label, target in targets.items():
        if (target.image_size, target.patch_size) != (first.image_size, first.patch_size):
            raise UserError(f"{label} ({target.location}) sees image_size {list(target.image_size or ())}, "
                            f"patch_size {list(target.patch_size or ())}; {first_label} sees "
                            f"{list(first.image_size or ())}, {list(first.patch_size or ())}: encoders compared "
                            "side by side share one input geometry")
    return targets


def compare_sources(sources: Sequence[str], labels: Sequence[str], recipe: EvalRecipe, registry: Registry,
                    progress: Progress | None = None) -> ComparisonReport:
    """Every evaluator of ``recipe`` on each source and on one randomly initialised baseline."""
    targets = load_targets(sources, labels, recipe.run.seed, registry)
    first = next(iter(targets.values()))
    device = eval_device(recipe)
    evaluators = build_evaluators(first, recipe, registry)
    models = [*((label, t.pretrained) for label, t in targets.items()), (RANDOM, first.random_init)]
    scores, predictions = score_models(models, evaluators, device, 0, progress)
    differences = {label: plain_differences(scores[label], scores[RANDOM],
                                            paired_differences(evaluators, predictions, label, RANDOM))
                   for label in labels}
    locations = {label: t.location + ("" if t.update_step is None else f" (update step {t.update_step})")
                 for label, t in targets.items()}
    return ComparisonReport(recipe.run.seed, str(device), locations, scores, differences,
                            summarise_test_split(evaluators))


def format_comparison(report: ComparisonReport) -> str:
    """A table: one row per metric, a column per encoder and the baseline, then each
    encoder's difference from the baseline."""
    width = max(len(label) for label in report.locations)
    lines = [f"{label.ljust(width)}  {location}" for label, location in report.locations.items()]
    lines += [f"{RANDOM.ljust(width)}  the first encoder's architecture, randomly initialised (seed {report.seed})",
              f"{'device'.ljust(width)}  {report.device}"]
    labels = list(report.locations)
    lines += [format_test_split(report.test_split, list(dict.fromkeys(k.partition("/")[0] for k in report.metrics()))),
              ""]
    lines.append(render_table(
        ["metric", *labels, RANDOM, *(f"{label} - random" for label in labels)],
        [[key, *(format_value(report.scores[label], key) for label in [*labels, RANDOM]),
          *(format_difference(report.differences[label], key) for label in labels)] for key in report.metrics()],
        right=tuple(range(1, 2 * len(labels) + 2))))
    lines.append("")
    if any(is_interval_key(k.partition("/")[2]) for scores in report.scores.values() for k in scores):
        lines.append(INTERVAL_LEGEND)
    if any(is_interval_key(k.partition("/")[2]) for d in report.differences.values() for k in d):
        lines.append(DIFFERENCE_LEGEND)
    lines += boundary_legend(report.test_split, report.metrics())
    return "\n".join(lines).rstrip()
