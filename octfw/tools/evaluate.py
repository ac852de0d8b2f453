"""``octfw eval``: evaluate a checkpoint or an exported encoder against a random one.

The evaluation recipe is a TOML file with ``[[evaluator]]`` tables and
optionally ``[run]`` ``seed`` / ``device`` / ``cache_dir``. A training recipe
with ``[[evaluator]]`` tables works as it is: its other tables are not used,
because the encoder must see volumes prepared as *its* training prepared them
(the ``[transform]`` recorded in the checkpoint or the export).

The baseline is the same architecture, randomly initialised with the
recipe's seed: a metric is only informative next to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import torch

from octfw.errors import RecipeError, UserError
from octfw.recipe import cache_dir_for
from octfw.registry import Registry
from octfw.fields import Location, choices, doc, non_negative
from octfw.types import BuildContext

__all__ = ["EvalRunConfig", "EvalRecipe", "EvalTarget", "EvalReport", "load_eval_recipe", "load_target",
           "evaluate_target", "format_report"]


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
    from octfw.config import RunConfig
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
    random_init: torch.nn.Module
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


def _model_from_checkpoint(location: str, state: Mapping[str, Any], seed: int,
                           registry: Registry) -> EvalTarget:
    from octfw.tools.export import rebuild_model, recorded_recipe

    recipe = recorded_recipe(state, location, registry)
    pretrained = rebuild_model(state, location, registry)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random_init = recipe.model.build(recipe.build_context(registry=registry))
    geometry = _geometry(state["recipe"], recipe.model.config)
    return EvalTarget(location, int(state.get("update_step", 0)), pretrained, random_init, state["recipe"],
                      **geometry)


def _model_from_export(path: Path, seed: int) -> EvalTarget:
    from octfw.tools.export import PretrainedEncoder, load_encoder
    from octfw.models.vit3d import ViT3DEncoder

    pretrained = load_encoder(path)
    config = pretrained.info["config"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = ViT3DEncoder(tuple(config["image_size"]), tuple(config["patch_size"]), config["in_channels"],
                               config["embed_dim"], config["depth"], config["num_heads"], config["mlp_ratio"])
    random_init = PretrainedEncoder(encoder, pretrained.info).eval()
    recipe = {"transform": pretrained.info["transform"], "model": pretrained.info.get("model", {})}
    return EvalTarget(str(path), pretrained.info.get("update_step"), pretrained, random_init, recipe,
                      tuple(pretrained.image_size), tuple(pretrained.patch_size))


def load_target(source: str | Path, seed: int, registry: Registry) -> EvalTarget:
    """A run folder (its latest checkpoint), a checkpoint file, or an exported encoder file."""
    from octfw.tools.export import FORMAT, find_checkpoint

    path = Path(source)
    if path.is_file():
        try:
            head = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with the file's name
            first = (str(exc).strip().splitlines() or [""])[0]
            raise UserError(f"{path}: cannot be read as a checkpoint or encoder ({type(exc).__name__}: {first})") from None
        if isinstance(head, Mapping) and head.get("format") == FORMAT:
            return _model_from_export(path, seed)
        if not isinstance(head, Mapping) or "model" not in head:
            raise UserError(f"{path}: neither an octfw checkpoint nor an exported encoder")
        return _model_from_checkpoint(str(path), head, seed, registry)
    location, state = find_checkpoint(path, registry)
    return _model_from_checkpoint(location, state, seed, registry)


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

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def evaluate_target(target: EvalTarget, recipe: EvalRecipe, registry: Registry) -> EvalReport:
    """Run every evaluator of ``recipe`` on the pretrained and the random network."""
    from octfw.engine.backend import select_backend

    device = select_backend(recipe.run.device, "fp32").device
    # Not Recipe.build_context: an evaluation recipe has no model or transform;
    # the encoder's geometry and training recipe come from the target.
    ctx = BuildContext(recipe_dir=recipe.source.parent, cache_dir=cache_dir_for(recipe.run), run_dir=None,
                       seed=recipe.run.seed, image_size=target.image_size, patch_size=target.patch_size,
                       recipe=target.recipe, registry=registry)
    evaluators = [(spec.name, spec.build(ctx)) for spec in recipe.evaluators]
    results: dict[str, dict[str, float]] = {}
    for label, model in (("pretrained", target.pretrained), ("random_init", target.random_init)):
        model = model.to(device)
        scores: dict[str, float] = {}
        with torch.no_grad():
            for name, evaluator in evaluators:
                update_step = target.update_step or 0
                for key, value in evaluator.evaluate(model, device, update_step).items():
                    scores[f"{name}/{key}"] = float(value)
        results[label] = scores
        model.to("cpu")
    return EvalReport(target.location, target.update_step, recipe.run.seed, str(device),
                      results["pretrained"], results["random_init"])


def format_report(report: EvalReport) -> str:
    """A plain-text table: one row per metric, pretrained next to random init."""
    step = "" if report.update_step is None else f" (update step {report.update_step})"
    lines = [f"encoder   {report.location}{step}",
             f"baseline  same architecture, randomly initialised (seed {report.seed})",
             f"device    {report.device}", ""]
    keys = list(report.pretrained) + [k for k in report.random_init if k not in report.pretrained]
    width = max([len("metric")] + [len(k) for k in keys])
    lines.append(f"{'metric'.ljust(width)}  {'pretrained':>10}  {'random init':>11}")

    def cell(value: float | None, size: int) -> str:
        return ("-" if value is None else f"{value:.3f}").rjust(size)

    for key in keys:
        lines.append(f"{key.ljust(width)}  {cell(report.pretrained.get(key), 10)}  "
                     f"{cell(report.random_init.get(key), 11)}")
    return "\n".join(lines)
