"""``octfw eval``: evaluate a checkpoint or an exported encoder against a random one.

The evaluation recipe is a TOML file with ``[[evaluator]]`` tables and
optionally ``[run]`` ``seed`` / ``device`` / ``cache_dir``. A training recipe
with ``[[evaluator]]`` tables works as it is: its other tables are not used,
because the encoder must see volumes prepared as *its* training prepared them
(the ``[transform]`` recorded in the checkpoint or the export).

The baseline is the same architecture, randomly initialised with the
recipe's seed: a metric is only informative next to it.

Beside this module, :mod:`octfw.evaluation.label_efficiency` (``--shots``: label
efficiency) and :mod:`octfw.evaluation.checkpoints` (``--checkpoints``:
every saved checkpoint of a run) reuse its recipe, targets and evaluators.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs
import torch

from octfw.display.errors import RecipeError, UserError
from octfw.recipe.fields import Location, choices, doc, non_negative
from octfw.recipe import cache_dir_for
from octfw.evaluation.reporting import (DIFFERENCE_LEGEND, INTERVAL_LEGEND, boundary_legend, format_difference,
                                       format_value, is_interval_key, plain_differences, format_test_split,
                                       summarise_test_split, with_interval)
from octfw.registry import Registry
from octfw.display.tables import render_table
from octfw.types import BuildContext, ComparingEvaluator

__all__ = ["EvalRunConfig", "EvalRecipe", "EvalTarget", "EvalReport", "Progress", "Counter", "load_eval_recipe",
           "load_target", "recipe_model", "checkpoint_model", "eval_device", "build_evaluators", "kept_predictions",
           "score_models", "paired_differences", "evaluate_target", "run_evaluators", "format_report", "main_metric"]

#: ``progress(done, total, text)``: called as units of work finish (a progress bar's update).
Progress = Callable[[int, int, str], None]


@attrs.frozen
class EvalRunConfig:
    """The ``[run]`` keys ``octfw eval`` uses; the other ``[run]`` keys are accepted and ignored."""

    seed: int = doc("seed of the randomly initialised baseline encoder and of synthetic datasets",
                    default=0, validator=non_negative)
    device: str = doc("auto, cpu, cuda or xla", default="auto", validator=choices("auto", "cpu", "cuda", "xla"))
    cache_dir: Location | None = doc("cache for synthetic cohorts; default $OCTFW_CACHE_DIR or ~/.cache/octfw",
                                     default=None)


@attrs.frozen
class EvalRecipe:
    source: Path
    run: EvalRunConfig
    evaluators: tuple[Any, ...]  #: octfw.recipe.StageSpec, one per [[evaluator]]


def load_eval_recipe(path: str | Path, overrides: Sequence[str], registry: Registry) -> EvalRecipe:
    """Read and validate an evaluation recipe; every problem is reported at once."""
    from octfw.recipe.config import RunConfig
    from octfw.recipe import TOP_LEVEL_KEYS, apply_overrides, read_with_extends, structure_config
    from octfw.recipe.structuring import structure_stage_array
    from octfw.registry import did_you_mean

    source = Path(path)
    if source.is_dir():
        raise UserError(f"{source}: is a folder; give an evaluation recipe file (.toml)")
    data = apply_overrides(read_with_extends(source), overrides)
    problems: list[tuple[str, str]] = []
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            problems.append((key, f"unknown table{did_you_mean(key, TOP_LEVEL_KEYS)}; "
                                  "octfw eval reads [run] and [[evaluator]]"))

    run_table = data.get("run", {})
    run = None
    if not isinstance(run_table, dict):
        problems.append(("run", "expected a table"))
    else:
        known = [f.name for f in attrs.fields(RunConfig)]
        for key in run_table:
            if key not in known:
                problems.append((f"run.{key}", f"unknown key{did_you_mean(key, known)}; "
                                               f"valid keys: {', '.join(known)}"))
        used = {k: v for k, v in run_table.items() if k in attrs.fields_dict(EvalRunConfig)}
        run, found = structure_config(EvalRunConfig, used, "run", registry)
        problems += found

    specs: tuple[Any, ...] = ()
    raw = data.get("evaluator")
    if not raw or not isinstance(raw, (list, dict)):
        choices_ = ", ".join(registry.names("evaluator")) or "none installed"
        problems.append(("evaluator", f"add one or more [[evaluator]] tables ({choices_})"))
    else:
        specs, found = structure_stage_array(registry, "evaluator", raw, "evaluator")
        problems += found
    if problems:
        raise RecipeError(str(source), problems)
    return EvalRecipe(source.resolve(), run, specs)


# --------------------------------------------------------------------------
# what is evaluated


@attrs.frozen(eq=False)
class EvalTarget:
    """A pretrained network, a randomly initialised one of the same architecture,
    and the training recipe data they need (``transform`` at least)."""

    location: str  #: the checkpoint or encoder file
    update_step: int | None
    pretrained: torch.nn.Module  #: ``.embed(volume)`` or ``module(volume)`` -> ``[B, N, E]``
    random_init: torch.nn.Module | None  #: None when not asked for (another checkpoint of a compared run)
    recipe: Mapping[str, Any]  #: the training recipe as plain data (``transform``, ``model``, ...)
    image_size: tuple[int, int, int] | None
    patch_size: tuple[int, int, int] | None


def _geometry(recipe: Mapping[str, Any], model_config: Any = None) -> dict[str, Any]:
    # The engine's convention (octfw.engine.build): the transform's image_size
    # and the model's patch_size fix the patch grid.
    image_size = recipe.get("transform", {}).get("image_size")
    patch_size = getattr(model_config, "patch_size", None)
    return {"image_size": tuple(image_size) if image_size is not None else None,
            "patch_size": tuple(patch_size) if patch_size is not None else None}


def checkpoint_model(location: str, state: Mapping[str, Any], seed: int, registry: Registry,
                     random_init: bool = True) -> EvalTarget:
    """The network a checkpoint's ``state`` holds, and (``random_init``) the seeded baseline."""
    from octfw.exports.checkpoint import rebuild_model, recorded_recipe

    recipe = recorded_recipe(state, location, registry)
    pretrained = rebuild_model(state, location, registry)
    baseline = None
    if random_init:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            baseline = recipe.model.build(recipe.build_context(registry=registry, apply_init=False))
    geometry = _geometry(state["recipe"], recipe.model.config)
    return EvalTarget(location, int(state.get("update_step", 0)), pretrained, baseline, state["recipe"],
                      **geometry)


def _model_from_export(path: Path, seed: int) -> EvalTarget:
    from octfw.exports.pretrained import PretrainedEncoder, encoder_from_config, load_encoder

    pretrained = load_encoder(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = encoder_from_config(pretrained.info["config"])
    random_init = PretrainedEncoder(encoder, pretrained.info).eval()
    recipe = {"transform": pretrained.info["transform"], "model": pretrained.info.get("model", {})}
    return EvalTarget(str(path), pretrained.info.get("update_step"), pretrained, random_init, recipe,
                      tuple(pretrained.image_size), tuple(pretrained.patch_size))


def recipe_model(path: Path, seed: int, registry: Registry) -> EvalTarget:
    """The model a training recipe starts from, untrained: its ``[model] init`` weights (published
    weights as they are), beside the same architecture randomly initialised."""
    from octfw.recipe import load_recipe

    recipe = load_recipe(path, (), registry)
    models = []
    for apply_init in (True, False):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            models.append(recipe.model.build(recipe.build_context(registry=registry, apply_init=apply_init)))
    data = recipe.to_dict()
    return EvalTarget(str(path), 0, models[0].eval(), models[1].eval(), data,
                      **_geometry(data, recipe.model.config))


def load_target(source: str | Path, seed: int, registry: Registry) -> EvalTarget:
    """A run folder (its latest checkpoint), a checkpoint file, an exported encoder in any format,
    or a training recipe (.toml: the model it starts from, its ``[model] init`` weights)."""
    from octfw.exports.checkpoint import find_checkpoint
    from octfw.exports.formats import FORMAT
    from octfw.exports.reading import is_export_path

    path = Path(source)
    if path.suffix == ".toml" and path.is_file():
        return recipe_model(path, seed, registry)
    if is_export_path(path):
        return _model_from_export(path, seed)
    if path.is_file():
        from octfw.storage.checkpoints import load_checkpoint

        head = load_checkpoint(str(path))  # checked against its SHA-256 where it has one
        if isinstance(head, Mapping) and head.get("format") == FORMAT:
            return _model_from_export(path, seed)
        if not isinstance(head, Mapping) or "model" not in head:
            raise UserError(f"{path}: neither an octfw checkpoint nor an exported encoder")
        return checkpoint_model(str(path), head, seed, registry)
    location, state = find_checkpoint(path, registry)
    return checkpoint_model(location, state, seed, registry)


# --------------------------------------------------------------------------
# evaluating


@attrs.frozen
class EvalReport:
    location: str
    update_step: int | None
    seed: int
    device: str
    pretrained: dict[str, float]  #: "<evaluator>/<metric>" -> value
    random_init: dict[str, float]
    #: pretrained minus random init for every metric both report; with a paired bootstrap interval
    #: ("<evaluator>/auroc_ci_low", ...) where the evaluator keeps its test predictions
    difference: dict[str, float] = attrs.field(factory=dict)
    #: "<evaluator>" -> the test split's volumes and patients (:func:`.reporting.summarise_test_split`)
    test_split: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def csv_rows(self) -> list[dict[str, Any]]:
        """One row per metric: each side's value and interval, then the difference and its interval."""
        keys = list(self.pretrained) + [k for k in self.random_init if k not in self.pretrained]
        rows = []
        for key in (k for k in keys if not is_interval_key(k.partition("/")[2])):
            row: dict[str, Any] = {"metric": key}
            for column, scores in (("pretrained", self.pretrained), ("random_init", self.random_init),
                                   ("difference", self.difference)):
                row.update(with_interval(scores, key, column))
            rows.append(row)
        return rows


def eval_device(recipe: EvalRecipe) -> torch.device:
    from octfw.engine.backend import single_process_backend

    return single_process_backend(recipe.run.device, "fp32").device


def build_evaluators(target: EvalTarget, recipe: EvalRecipe, registry: Registry) -> list[tuple[str, Any]]:
    """``[(name, evaluator)]`` of every ``[[evaluator]]`` table, built for ``target``'s geometry."""
    # Not Recipe.build_context: an evaluation recipe has no model or transform;
    # the encoder's geometry and training recipe come from the target.
    ctx = BuildContext(recipe_dir=recipe.source.parent, cache_dir=cache_dir_for(recipe.run, writable=True),
                       run_dir=None, seed=recipe.run.seed, image_size=target.image_size,
                       patch_size=target.patch_size, recipe=target.recipe, registry=registry)
    return [(spec.name, spec.build(ctx)) for spec in recipe.evaluators]


class Counter:
    """Units of work (an encoder's evaluation, an encoding, a fit) done out of ``total``, told to
    ``progress`` as each finishes; while one runs (:meth:`running`), the steps of a long fit in it
    (:func:`octfw.display.progress.fit_step`) are told too."""

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress

    def finished(self, text: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, text)

    @contextlib.contextmanager
    def running(self, text: str) -> Iterator[None]:
        from octfw.display.progress import fit_steps

        progress = self.progress
        if progress is None:
            yield
            return
        with fit_steps(lambda step, steps: progress(self.done, self.total, f"{text}: fit step {step}/{steps}")):
            yield


def run_evaluators(model: torch.nn.Module, evaluators: Sequence[tuple[str, Any]], device: torch.device,
                   update_step: int, counter: Counter | None = None, label: str = "") -> dict[str, float]:
    """``{"<evaluator>/<metric>": value}`` of ``model``, moved to ``device`` for the time it takes;
    each evaluator is a unit of ``counter``'s work, named ``<label>: <evaluator>``."""
    model = model.to(device)
    scores: dict[str, float] = {}
    try:
        with torch.no_grad():
            for name, evaluator in evaluators:
                where = f"{label}: {name}" if label else name
                with counter.running(where) if counter is not None else contextlib.nullcontext():
                    for key, value in evaluator.evaluate(model, device, update_step).items():
                        scores[f"{name}/{key}"] = float(value)
                if counter is not None:
                    counter.finished(where)
    finally:
        model.to("cpu")
    return scores


def kept_predictions(evaluators: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``{evaluator: its newest test predictions}`` of the :class:`ComparingEvaluator` s (for
    :func:`paired_differences`), read after an evaluation."""
    return {name: evaluator.last_test_probabilities for name, evaluator in evaluators
            if isinstance(evaluator, ComparingEvaluator)}


def score_models(models: Sequence[tuple[str, torch.nn.Module]], evaluators: Sequence[tuple[str, Any]],
                 device: torch.device, update_step: int, progress: Progress | None = None,
                 ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """Every evaluator on each ``(label, model)``: ``({label: scores}, {label: {evaluator: test
    predictions}})``, the predictions of :class:`ComparingEvaluator` s only (paired differences)."""
    counter = Counter(len(models) * len(evaluators), progress)
    scores: dict[str, dict[str, float]] = {}
    predictions: dict[str, dict[str, Any]] = {}
    for label, model in models:
        scores[label] = run_evaluators(model, evaluators, device, update_step, counter, label.replace("_", " "))
        predictions[label] = kept_predictions(evaluators)
    return scores, predictions


def paired_differences(evaluators: Sequence[tuple[str, Any]], predictions: Mapping[str, Mapping[str, Any]],
                       label: str, baseline: str) -> dict[str, float]:
    """``label`` minus ``baseline`` with paired bootstrap intervals, for each evaluator that compares."""
    return {f"{name}/{key}": value for name, evaluator in evaluators
            if isinstance(evaluator, ComparingEvaluator)
            and predictions[label].get(name) is not None and predictions[baseline].get(name) is not None
            for key, value in evaluator.difference(predictions[label][name], predictions[baseline][name]).items()}


def evaluate_target(target: EvalTarget, recipe: EvalRecipe, registry: Registry,
                    progress: Progress | None = None) -> EvalReport:
    """Run every evaluator of ``recipe`` on the pretrained and the random network."""
    device = eval_device(recipe)
    evaluators = build_evaluators(target, recipe, registry)
    scores, predictions = score_models([("pretrained", target.pretrained), ("random_init", target.random_init)],
                                       evaluators, device, target.update_step or 0, progress)
    paired = paired_differences(evaluators, predictions, "pretrained", "random_init")
    return EvalReport(target.location, target.update_step, recipe.run.seed, str(device),
                      scores["pretrained"], scores["random_init"],
                      plain_differences(scores["pretrained"], scores["random_init"], paired),
                      summarise_test_split(evaluators))


#: What :func:`main_metric` plots when none is asked for, the first reported: a classifier's AUROC or
#: balanced accuracy (a ``reading = "tokens"`` evaluator reports the ``tokens_`` ones only), a dense
#: evaluator's voxel Dice.
PLOTTED_METRICS = ("auroc", "tokens_auroc", "balanced_accuracy", "tokens_balanced_accuracy", "voxel_dice",
                   "mean_dice")


def main_metric(metrics: Sequence[str], asked: str | None) -> str:
    """The metric to plot: ``asked``, else the first of :data:`PLOTTED_METRICS` reported."""
    if asked is not None:
        if asked not in metrics:
            shown = ", ".join(m for m in dict.fromkeys(metrics) if "/" not in m)
            raise UserError(f"--metric {asked}: not reported by every evaluator (reported: {shown})")
        return asked
    return next((m for m in PLOTTED_METRICS if m in metrics), "balanced_accuracy")


def format_report(report: EvalReport) -> str:
    """A plain-text table: one row per metric, pretrained next to random init;
    an AUROC or AUPRC carries its bootstrap 95 % interval in brackets."""
    step = "" if report.update_step is None else f" (update step {report.update_step})"
    lines = [f"encoder   {report.location}{step}",
             f"baseline  same architecture, randomly initialised (seed {report.seed})",
             f"device    {report.device}"]
    keys = list(report.pretrained) + [k for k in report.random_init if k not in report.pretrained]
    keys = [k for k in keys if not is_interval_key(k.partition("/")[2])]
    lines += [format_test_split(report.test_split, list(dict.fromkeys(k.partition("/")[0] for k in keys))), ""]
    lines.append(render_table(
        ["metric", "pretrained", "random init", "difference"],
        [[key, format_value(report.pretrained, key), format_value(report.random_init, key),
          format_difference(report.difference, key)] for key in keys],
        right=(1, 2, 3)))
    lines.append("")
    if any(is_interval_key(k.partition("/")[2]) for k in report.pretrained):
        lines.append(INTERVAL_LEGEND)
    if any(is_interval_key(k.partition("/")[2]) for k in report.difference):
        lines.append(DIFFERENCE_LEGEND)
    lines += boundary_legend(report.test_split, keys)
    return "\n".join(lines).rstrip()
