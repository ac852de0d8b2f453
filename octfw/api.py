"""octfw from Python: what the command line does, for notebooks, scripts and Lightning users.

::

    import octfw

    recipe = octfw.load_recipe("recipes/quickstart.toml", ["run.max_steps=20"])
    result = octfw.train(recipe)              # the progress bar of `octfw run`, in a notebook too
    result.run_dir, result.summary["last_loss"], result.checkpoint
    octfw.train(recipe, resume="auto")        # continue the newest run of this recipe
    report = octfw.evaluate(result.run_dir, "recipes/quickstart_eval.toml")
    report.pretrained["linear-probe/auroc"], report.random_init["linear-probe/auroc"]
    encoder_file = octfw.export(result.run_dir, "encoder.pt")
    encoder = octfw.load_encoder(encoder_file)

Each function validates as the command does and raises what the command
would print: a :class:`~octfw.display.errors.UserError` (a
:class:`~octfw.display.errors.RecipeError` lists every problem of a recipe) whose
message is the command's one line, never ``sys.exit``. A run that ends before
its last update raises :class:`~octfw.display.errors.RunNotFinished`, which carries
what there is (``.result``) and says how to continue.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import attrs

from octfw.display.errors import RunNotFinished, UserError
from octfw.exports.formats import DEFAULT_LICENSE

if TYPE_CHECKING:  # pragma: no cover - typing only
    from octfw.evaluation.target import EvalReport
    from octfw.recipe import Recipe
    from octfw.registry import Registry

__all__ = ["TrainResult", "load_recipe", "train", "evaluate", "export"]


@attrs.frozen
class TrainResult:
    """What a training run left: its folder, its summary (``summary.json``) and its last checkpoint."""

    run_dir: Path
    summary: dict[str, Any]
    checkpoint: str | None  #: the newest complete checkpoint (None: none was written)


def _registry(registry: Registry | None) -> Registry:
    if registry is not None:
        return registry
    from octfw.registry import load_registry

    return load_registry()


def load_recipe(path: str | Path, overrides: Sequence[str] = (), *, registry: Registry | None = None) -> Recipe:
    """Read, override (``"table.key=value"`` as ``--set`` takes them) and validate a recipe.

    Raises :class:`~octfw.display.errors.RecipeError` naming every problem at once.
    """
    from octfw.recipe import load_recipe as load

    if isinstance(overrides, str):
        raise UserError(f"overrides: give a list of 'table.key=value' strings, got the string {overrides!r}")
    return load(path, list(overrides), _registry(registry))


def train(recipe: Recipe | str | Path, *, resume: str | Path | None = None,
          registry: Registry | None = None, allow_recipe_change: bool = False) -> TrainResult:
    """Train ``recipe`` (a loaded recipe or a recipe file) as ``octfw run`` does.

    ``resume``: None (a new run), ``"auto"`` (continue the newest run of this
    recipe from its last complete checkpoint; a run that finished is returned
    as it is) or a checkpoint file. A resumed run is the run that was started: a recipe
    that trains otherwise is refused (:class:`~octfw.display.errors.RecipeError`, one problem per key)
    unless ``allow_recipe_change``. Raises :class:`~octfw.display.errors.RunNotFinished`
    when a guard stopped the run, it was preempted or interrupted, or its
    final checkpoint could not be written.
    """
    from octfw.engine.launch import AlreadyFinished, launch  # imports torch: only when training

    registry = _registry(registry)
    if not hasattr(recipe, "build_context"):
        recipe = load_recipe(recipe, registry=registry)
    try:
        summary = launch(recipe, registry, resume=None if resume is None else str(resume),
                         allow_recipe_change=allow_recipe_change)
    except AlreadyFinished as done:
        result = TrainResult(Path(done.run_dir), dict(done.summary), done.summary.get("checkpoint"))
        if done.summary.get("stopped"):
            raise RunNotFinished(result, "stopped", f"{done.run_dir} stopped early: {done.summary['stopped']}")
        return result
    result = TrainResult(Path(summary.run_dir), summary.as_dict(), summary.checkpoint)
    resume_hint = "; continue it with octfw.train(recipe, resume='auto')"
    if summary.final_save_failed:
        kept = summary.fallback_checkpoint or summary.checkpoint or "(none)"
        raise RunNotFinished(result, "final_save_failed",
                             f"the final checkpoint could not be written ({summary.failed_saves[-1]}); "
                             f"the final state is in {kept}{resume_hint}")
    if summary.preempted:
        reason = "interrupted" if summary.interrupted else "preempted"
        raise RunNotFinished(result, reason, f"{summary.run_dir} {reason} by {summary.stopped}; "
                                             f"checkpoint {summary.checkpoint or '(none written)'}{resume_hint}")
    if summary.stopped:
        raise RunNotFinished(result, "stopped", f"{summary.run_dir} stopped early: {summary.stopped}")
    return result


def evaluate(source: str | Path, recipe: str | Path, overrides: Sequence[str] = (), *,
             registry: Registry | None = None) -> EvalReport:
    """``octfw eval SOURCE --recipe RECIPE``: probe a run's latest checkpoint, a checkpoint file
    or an exported encoder next to a randomly initialised encoder of the same architecture.

    Returns the report: ``.pretrained`` and ``.random_init`` map ``"<evaluator>/<metric>"`` to
    values; ``print(octfw.evaluation.target.format_report(report))`` shows the table.
    """
    from octfw.evaluation.target import evaluate_target, load_eval_recipe, load_target
    from octfw.display.progress import progress_bar

    registry = _registry(registry)
    eval_recipe = load_eval_recipe(recipe, list(overrides), registry)
    target = load_target(source, eval_recipe.run.seed, registry)
    with progress_bar("eval", text="loading volumes") as progress:
        return evaluate_target(target, eval_recipe, registry, progress)


def export(source: str | Path, out: str | Path, *, format: str = "octfw", force: bool = False,
           license: str = DEFAULT_LICENSE, datasets: Sequence[str] | None = None,
           registry: Registry | None = None) -> Path:
    """``octfw export SOURCE --out OUT [--format F] [--force]``: write the target encoder of a run's
    latest checkpoint (or of a checkpoint file); returns ``out``. ``format``: ``octfw`` and
    ``safetensors`` (a Hub-style folder) are read by :func:`octfw.load_encoder`, as are
    ``torchscript`` (also ``torch.jit.load``) and ``monai-bundle`` (also ``monai.bundle``, both
    without octfw; :mod:`octfw.exports.formats`). An existing ``out`` is replaced only with ``force``.
    ``license`` and ``datasets`` go to the model card (``--license``, ``--dataset``)."""
    from octfw.exports.export import export_encoder

    return Path(export_encoder(source, out, _registry(registry), format, force=force, license=license,
                               datasets=datasets)["out"])
