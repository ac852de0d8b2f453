"""From a run or a checkpoint file to the encoder an export holds: the checkpoint it names
(a run's is the one :func:`octfw.runs.checkpoint.run_checkpoint` finds, as the run plan does), the
recipe it recorded, the model rebuilt with its weights, its target encoder, and what an
export records of it (:func:`octfw.exports.formats.encoder_info`, with the run's evaluator
results for the model card)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from torch import nn

from octfw.display.errors import UserError
from octfw.exports.formats import DEFAULT_LICENSE, dataset_label, encoder_info
from octfw.models.vit3d import ViT3DEncoder
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.types import EncoderModel

__all__ = ["find_checkpoint", "recorded_recipe", "rebuild_model", "checkpoint_encoder", "evaluator_results"]


def find_checkpoint(source: str | Path, registry: Registry) -> tuple[str, dict[str, Any]]:
    """The checkpoint ``source`` names and its contents: a run folder gives the checkpoint
    it stands at (:func:`octfw.runs.checkpoint.run_checkpoint`: its fallback copy where the final save
    failed, else the newest complete checkpoint of the checkpointer its recipe records), a file
    or a sharded checkpoint's ``step_N.dcp`` folder is read as a checkpoint. Raises UserError for
    anything else."""
    from octfw.storage.checkpoint_names import is_sharded_checkpoint
    from octfw.storage.checkpoints import load_checkpoint

    path = Path(source)
    if path.is_dir() and not is_sharded_checkpoint(path.name):
        return _latest_in_run(path, registry)
    if not path.exists():
        raise UserError(f"{source}: no such run folder or checkpoint file")
    return str(path), load_checkpoint(str(path))


def _latest_in_run(run_dir: Path, registry: Registry) -> tuple[str, dict[str, Any]]:
    from octfw.recipe import load_recipe
    from octfw.runs.checkpoint import run_checkpoint

    recorded = run_dir / "recipe.toml"
    if not recorded.is_file():
        raise UserError(f"{run_dir}: not a run folder (it has no recipe.toml); "
                        "give a run folder or a checkpoint file")
    recipe = load_recipe(recorded, (), registry)
    checkpointer = recipe.checkpointer.build(recipe.build_context(registry=registry, run_dir=run_dir))
    location, _ = run_checkpoint(run_dir, checkpointer)
    if location is None:
        raise UserError(f"{run_dir}: no complete checkpoint found "
                        f"(checkpointer {recipe.checkpointer.name!r})")
    return location, checkpointer.load(location)


def recorded_recipe(state: Mapping[str, Any], where: str, registry: Registry) -> Recipe:
    """The recipe a checkpoint carries (every option resolved when it was saved), validated again."""
    from octfw.display.errors import RecipeError
    from octfw.recipe import validate

    recipe = state.get("recipe")
    if not isinstance(recipe, Mapping) or "model" not in recipe or "transform" not in recipe:
        raise UserError(f"{where}: the checkpoint records no recipe with [model] and [transform]")
    try:
        return validate(recipe, registry, Path(where))
    except RecipeError as exc:
        raise UserError(f"checkpoint {where}: its recorded recipe no longer validates: "
                        + "; ".join(exc.problems)) from None


def rebuild_model(state: Mapping[str, Any], where: str, registry: Registry) -> nn.Module:
    """The model the checkpoint's recipe describes, with the checkpoint's weights."""
    recipe = recorded_recipe(state, where, registry)
    model = recipe.model.build(recipe.build_context(registry=registry, apply_init=False))  # weights: below
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"checkpoint {where}: its weights do not fit the model its recipe "
                        f"describes ({first})") from None
    return model


def _require_table(recipe: Mapping[str, Any], key: str, where: str) -> None:
    table = recipe.get(key)
    if not isinstance(table, Mapping) or "name" not in table:
        raise UserError(f"checkpoint {where}: its recorded recipe has no [{key}] table")


def checkpoint_encoder(source: str | Path, registry: Registry, *, license: str = DEFAULT_LICENSE,
                       datasets: Sequence[str] | None = None) -> tuple[str, ViT3DEncoder, dict[str, Any]]:
    """(where the checkpoint ``source`` names is (:func:`find_checkpoint`), its target encoder,
    what an export records beside the weights (:func:`octfw.exports.formats.encoder_info`))."""
    location, state = find_checkpoint(source, registry)
    if not isinstance(state, Mapping) or "model" not in state or "recipe" not in state:
        raise UserError(f"{location}: not an octfw training checkpoint (it lacks 'model' or 'recipe')")
    model = rebuild_model(state, location, registry)
    encoder = model.encoder if isinstance(model, EncoderModel) else None
    if not isinstance(encoder, ViT3DEncoder):
        raise UserError(f"checkpoint {location}: model {state['recipe']['model']['name']!r} has no "
                        "ViT3D target encoder (.encoder) to export")
    for key in ("transform", "model"):
        _require_table(state["recipe"], key, location)
    update_step = int(state.get("update_step", 0))
    checkpoint_folder = Path(location).parent
    run_dir = Path(source) if Path(source).is_dir() else checkpoint_folder.parent
    in_a_run = Path(source).is_dir() or checkpoint_folder.name == "checkpoints"
    metrics = evaluator_results(run_dir, state["recipe"], update_step) if in_a_run else []
    info = encoder_info(encoder.architecture(), state["recipe"], location, update_step, state.get("versions"),
                        license=license, datasets=datasets, metrics=metrics)
    return str(location), encoder, info


def evaluator_results(run_dir: Path, recipe: Mapping[str, Any], update_step: int) -> list[dict[str, Any]]:
    """The overall metrics of the run's last evaluation at or before ``update_step``, as
    its ``jsonl`` logger wrote them (``eval/<evaluator>/<metric>``); per-domain values and
    interval bounds are left out. Empty when the run logged none or is not on this disk."""
    import json

    loggers = [dict(t) for t in recipe.get("logger") or () if isinstance(t, Mapping) and t.get("name") == "jsonl"]
    evaluators = {str(t.get("name")): dict(t) for t in recipe.get("evaluator") or () if isinstance(t, Mapping)}
    if not loggers or not evaluators:
        return []
    path = run_dir / str(loggers[0].get("filename", "metrics.jsonl"))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:  # a checkpoint outside its run folder, or a remote run: the card says no results
        return []
    last: tuple[int, dict[str, float]] | None = None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or step > update_step:
            continue
        found = {k: v for k, v in record.items()
                 if k.startswith("eval/") and k.count("/") == 2 and not k.endswith(("_ci_low", "_ci_high"))}
        if found:
            last = (step, found)
    if last is None:
        return []
    step, found = last
    results = []
    for key, value in found.items():
        _, evaluator, metric = key.split("/")
        table = evaluators.get(evaluator, {}).get("dataset")
        results.append({"evaluator": evaluator, "metric": metric, "value": float(value), "step": step,
                        "dataset": dataset_label(table) if isinstance(table, Mapping) else None})
    return results
