"""``octfw eval RUN_DIR --recipe EVAL.toml --checkpoints all|latest|STEP,STEP``.

Probes several saved checkpoints of one run with the same evaluators (the
labelled volumes are decoded, prepared and split once) and the randomly
initialised baseline once, then plots one metric against the update step: a
checkpoint can be chosen by its downstream value rather than by its loss,
which may keep falling while the representation collapses.

Choosing a checkpoint by its test-split value makes that value optimistic;
to report a number, choose on one split and measure on another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import attrs

from octfw.display.errors import UserError
from octfw.evaluation.reporting import (DIFFERENCE_LEGEND, INTERVAL_LEGEND, boundary_legend, format_difference,
                                       format_value, is_interval_key, plain_differences, format_test_split,
                                       summarise_test_split, with_interval)
from octfw.evaluation.target import (
    Counter,
    EvalRecipe,
    Progress,
    build_evaluators,
    checkpoint_model,
    eval_device,
    kept_predictions,
    main_metric,
    paired_differences,
    run_evaluators,
)
from octfw.registry import Registry
from octfw.display.tables import render_table
from octfw.display.tables import counted

__all__ = ["CheckpointsReport", "run_checkpoints", "select_checkpoints", "compare_checkpoints",
           "format_checkpoints", "plot_checkpoints"]

#: Columns of the printed table, where an evaluator reports them (every metric goes to JSON).
TABLE_METRICS = ("accuracy", "balanced_accuracy", "auroc", "auprc", "tokens_balanced_accuracy", "tokens_auroc",
                 "voxel_dice", "token_dice", "fine_tune_voxel_dice", "mean_dice", "boundary_error_um")


@attrs.frozen
class CheckpointsReport:
    run_dir: str
    seed: int
    device: str
    steps: list[int]  #: update steps of the probed checkpoints, ascending
    locations: list[str]
    pretrained: list[dict[str, float]]  #: one "<evaluator>/<metric>" -> value mapping per step
    random_init: dict[str, float]
    #: one mapping per step: that checkpoint minus the baseline for every metric both report, with
    #: paired bootstrap intervals where the evaluator keeps its test predictions
    differences: list[dict[str, float]] = attrs.field(factory=list)
    #: "<evaluator>" -> the test split's volumes and patients (:func:`.reporting.summarise_test_split`)
    test_split: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def csv_rows(self) -> list[dict[str, Any]]:
        """One row per checkpoint (its update step; ``random`` for the baseline) and metric: the
        value, its interval, and a checkpoint's difference from the baseline with its interval."""
        differences = self.differences or [{} for _ in self.steps]
        probed = [*zip(self.steps, self.pretrained, differences), ("random", self.random_init, {})]
        return [{"update_step": step, "metric": key, **with_interval(scores, key, "value"),
                 **with_interval(difference, key, "difference")}
                for step, scores, difference in probed for key in scores
                if not is_interval_key(key.partition("/")[2])]


def run_checkpoints(run_dir: Path, registry: Registry) -> tuple[Any, list[tuple[int, str]]]:
    """(checkpointer, every complete checkpoint as (update step, location), oldest first)
    of a run folder, through the checkpointer its recorded recipe names; the newest is the
    one the run stands at (:func:`octfw.runs.checkpoint.run_checkpoints`): its fallback copy, where
    the final save failed, is the run's last step and is listed."""
    from octfw.recipe import load_recipe
    from octfw.runs.checkpoint import run_checkpoints as saved

    recorded = run_dir / "recipe.toml"
    if not run_dir.is_dir() or not recorded.is_file():
        raise UserError(f"{run_dir}: not a run folder (no recipe.toml); --checkpoints compares the "
                        "checkpoints of a run folder")
    recipe = load_recipe(recorded, (), registry)
    checkpointer = recipe.checkpointer.build(recipe.build_context(registry=registry, run_dir=run_dir))
    found = saved(run_dir, checkpointer)
    if not found:
        raise UserError(f"{run_dir}: no complete checkpoint found (checkpointer {recipe.checkpointer.name!r})")
    return checkpointer, found


def select_checkpoints(available: Sequence[tuple[int, str]], spec: str) -> list[tuple[int, str]]:
    """The checkpoints ``spec`` names: ``all``, ``latest``, or update steps ``STEP,STEP``.

    Raises UserError (one line) for a malformed spec or a step with no
    saved checkpoint, listing the steps there are.
    """
    available = sorted(available)
    word = spec.strip().lower()
    if word == "all":
        return available
    if word == "latest":
        return available[-1:]
    by_step = dict(available)
    steps_text = ", ".join(str(step) for step, _ in available)
    chosen = []
    for part in spec.split(","):
        try:
            step = int(part.strip())
        except ValueError:
            raise UserError(f"--checkpoints: {part.strip()!r} is not an update step; give all, latest or "
                            f"steps such as {available[-1][0]} (saved: {steps_text})") from None
        if step not in by_step:
            raise UserError(f"--checkpoints: no saved checkpoint at update step {step} (saved: {steps_text})")
        if (step, by_step[step]) not in chosen:
            chosen.append((step, by_step[step]))
    return sorted(chosen)


def compare_checkpoints(run_dir: str | Path, recipe: EvalRecipe, registry: Registry, spec: str,
                        progress: Progress | None = None) -> CheckpointsReport:
    """Every evaluator of ``recipe`` on each chosen checkpoint and once on the random baseline."""
    run_dir = Path(run_dir)
    checkpointer, available = run_checkpoints(run_dir, registry)
    chosen = select_checkpoints(available, spec)
    device = eval_device(recipe)
    seed = recipe.run.seed

    # The newest chosen checkpoint fixes the geometry and the training recipe the evaluators use;
    # it also gives the baseline, seeded like the run.
    step, location = chosen[-1]
    newest = checkpoint_model(location, checkpointer.load(location), seed, registry)
    evaluators = build_evaluators(newest, recipe, registry)
    counter = Counter((len(chosen) + 1) * len(evaluators), progress)
    random_init = run_evaluators(newest.random_init, evaluators, device, step, counter, "random init")
    baseline = {"random_init": kept_predictions(evaluators)}
    results, differences = [], []
    for step, location in chosen:
        target = newest if location == newest.location else checkpoint_model(
            location, checkpointer.load(location), seed, registry, random_init=False)
        if (target.image_size, target.patch_size) != (newest.image_size, newest.patch_size):
            raise UserError(f"{location}: image or patch size differs from {newest.location}; "
                            "compare checkpoints of one geometry")
        results.append(run_evaluators(target.pretrained, evaluators, device, step, counter, f"step {step}"))
        paired = paired_differences(evaluators, {**baseline, "checkpoint": kept_predictions(evaluators)},
                                    "checkpoint", "random_init")
        differences.append(plain_differences(results[-1], random_init, paired))
    return CheckpointsReport(str(run_dir), seed, str(device), [s for s, _ in chosen],
                             [loc for _, loc in chosen], results, random_init, differences,
                             summarise_test_split(evaluators))


def _evaluators(report: CheckpointsReport) -> list[str]:
    keys = list(report.random_init) + [k for scores in report.pretrained for k in scores]
    return list(dict.fromkeys(k.partition("/")[0] for k in keys))


def format_checkpoints(report: CheckpointsReport) -> str:
    """One table per evaluator: a row per checkpoint and one for the random baseline; the plotted
    metric's difference from the baseline closes each checkpoint's row."""
    lines = [f"run       {report.run_dir}",
             f"baseline  same architecture, randomly initialised (seed {report.seed})",
             f"device    {report.device}", format_test_split(report.test_split, _evaluators(report)), ""]
    differences = report.differences or [{} for _ in report.steps]
    for evaluator in _evaluators(report):
        metrics = [m for m in TABLE_METRICS if f"{evaluator}/{m}" in report.random_init]
        reported = [k.partition("/")[2] for k in report.random_init if k.startswith(f"{evaluator}/")]
        gain = main_metric(reported, None)
        table = [["update step"] + metrics + [f"{gain} - random"]]
        for step, scores, difference in zip(report.steps, report.pretrained, differences):
            table.append([str(step)] + [format_value(scores, f"{evaluator}/{m}") for m in metrics]
                         + [format_difference(difference, f"{evaluator}/{gain}")])
        table.append(["random init"] + [format_value(report.random_init, f"{evaluator}/{m}") for m in metrics]
                     + [""])
        lines.append(f"{evaluator}:")
        lines += [render_table(table[0], table[1:], right=range(len(table[0])), indent=2), ""]
    if any("_ci_low" in k for k in report.random_init):
        lines.append(INTERVAL_LEGEND)
    if any(is_interval_key(k.partition("/")[2]) for d in differences for k in d):
        lines.append(DIFFERENCE_LEGEND)
    lines += boundary_legend(report.test_split, list(report.random_init))
    return "\n".join(lines).rstrip()


def plot_checkpoints(report: CheckpointsReport, png: str | Path, metric: str | None = None) -> Path:
    """``metric`` (default: AUROC where reported, else balanced accuracy) against the update step."""
    from octfw.evaluation.curves import plot_checkpoint_curves

    curves, baselines = {}, {}
    for evaluator in _evaluators(report):
        reported = [k.partition("/")[2] for k in report.random_init if k.startswith(f"{evaluator}/")]
        chosen = main_metric(reported, metric)
        key = f"{evaluator}/{chosen}"
        low_key, high_key = f"{evaluator}/{chosen}_ci_low", f"{evaluator}/{chosen}_ci_high"
        curves[evaluator] = (chosen, [(step, scores[key], scores.get(low_key), scores.get(high_key))
                                      for step, scores in zip(report.steps, report.pretrained) if key in scores])
        baselines[evaluator] = report.random_init.get(key)
    return plot_checkpoint_curves(curves, baselines, png, title=f"{Path(report.run_dir).name}: "
                                  f"{counted(len(report.steps), 'checkpoint')}")
