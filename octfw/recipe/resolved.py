"""The validated recipe: one typed component spec per stage, and how it is made.

:func:`load_recipe` reads (see :mod:`octfw.recipe.loading`), fills in the
default components of the stages a recipe leaves out, applies overrides and
structures every table (see :mod:`octfw.recipe.structuring`), reporting
every problem at once. The stages come from :data:`octfw.hookspecs.STAGES`
alone: adding a stage there (and its hook) adds its recipe table, its
attribute on :class:`Recipe` and its place in ``octfw show``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import attrs
import tomli_w

from octfw.recipe.config import EngineConfig, RunConfig
from octfw.display.errors import RecipeError, UserError
from octfw.hookspecs import STAGES
from octfw.recipe.loading import Dropped, apply_overrides, parse_override, read_with_extends
from octfw.recipe.structuring import (
    Problem, StageSpec, describe, plain, structure_config, structure_stage, structure_stage_array,
)
from octfw.registry import Registry, did_you_mean
from octfw.storage.files import require_writable_folder
from octfw.types import BuildContext, MaskingConfig

__all__ = ["Recipe", "DEFAULT_STAGES", "CORE_TABLES", "TOP_LEVEL_KEYS", "SAFETY_GUARDS", "stage_attribute",
           "validate", "load_recipe", "to_toml", "cache_dir_for"]

#: Components used when a recipe leaves a stage out. dataset, transform and
#: model have no default: a recipe must say what it trains on and what.
DEFAULT_STAGES: dict[str, Any] = {
    "scheduler": {"name": "cosine-no-restart"},
    "guard": [{"name": "nan-skip"}],
    "logger": [{"name": "console"}, {"name": "jsonl"}],
    "checkpointer": {"name": "local"},
    "evaluator": [],
}
CORE_TABLES = {"run": RunConfig, "engine": EngineConfig}
#: The guards that keep one bad update out of the weights, and what a run without one risks:
#: a run that lacks any is warned about at its start (:meth:`Recipe.warnings`).
SAFETY_GUARDS = {
    "nan-skip": "an update with a non-finite loss or gradient reaches the weights",
    "grad-clip": "one gradient spike moves the weights without bound",
}
TOP_LEVEL_KEYS = ["extends", "append", *CORE_TABLES, *(table for _hook, table, _many in STAGES.values())]


def stage_attribute(stage: str) -> str:
    """The attribute a stage is read by: ``recipe.dataset``, ``recipe.guards`` (plural
    for the stages that take several components)."""
    return f"{stage}s" if STAGES[stage][2] else stage


_STAGE_OF_ATTRIBUTE = {stage_attribute(stage): stage for stage in STAGES}


class ByStage:
    """``obj.dataset``, ``obj.guards``, ... read from ``obj.by_stage`` (keyed by stage)."""

    by_stage: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        stage = _STAGE_OF_ATTRIBUTE.get(name)
        if stage is None or name == "by_stage":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.by_stage[stage]


@attrs.frozen
class Recipe(ByStage):
    """A validated recipe. Every value is typed; nothing is read with a default later.

    ``recipe.dataset``, ``recipe.model``, ``recipe.guards``, ... are the
    :class:`StageSpec` (a tuple of them for ``guard``, ``logger``, ``evaluator``).
    """

    source: Path
    run: RunConfig
    engine: EngineConfig
    by_stage: Mapping[str, Any]  #: stage -> StageSpec or tuple of StageSpec, in STAGES order
    #: the parents' components an ``extends`` chain dropped that the recipe still lacks
    dropped: tuple[Dropped, ...] = ()

    @property
    def name(self) -> str:
        return self.run.name or self.source.stem

    @property
    def folder(self) -> Path:
        return self.source.parent

    def stages(self) -> Iterator[StageSpec]:
        for value in self.by_stage.values():
            yield from value if isinstance(value, tuple) else (value,)

    def warnings(self) -> list[str]:
        """One line per thing a user should hear before the run trains on: each parent component
        the ``extends`` chain dropped, and the :data:`SAFETY_GUARDS` the recipe lacks. Logged once
        at the start of ``octfw run`` (rank 0), by ``octfw check``, and shown by ``octfw show``."""
        lines = [drop.describe() for drop in self.dropped]
        guards = {spec.name for spec in self.guards}
        missing = [name for name in SAFETY_GUARDS if name not in guards]
        if missing:
            risks = "; ".join(f"without {name}, {SAFETY_GUARDS[name]}" for name in missing)
            tables = " and ".join(f'[[guard]] with name = "{name}"' for name in missing)
            lines.append(f"{self.source}: no {' or '.join(missing)} guard: {risks}; add {tables} "
                         "(as recipes/quickstart.toml does)")
        return lines

    def total_update_steps(self, steps_per_epoch: int) -> int:
        """How long this recipe trains, in update steps, an epoch being ``steps_per_epoch`` of
        them: ``run.epochs`` epochs, at most ``run.max_steps``."""
        run = self.run
        total = steps_per_epoch * run.epochs if run.epochs is not None else run.max_steps
        return min(total, run.max_steps) if run.max_steps is not None else total

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe with every default filled in (unset values as None)."""
        out: dict[str, Any] = {key: plain(getattr(self, key)) for key in CORE_TABLES}
        for stage, (_hook, table, many) in STAGES.items():
            value = self.by_stage[stage]
            out[table] = [s.to_table() for s in value] if many else value.to_table()
        return out

    def build_context(self, *, registry: Registry, run_dir: Path | None = None, rank: int = 0,
                      world_size: int = 1, total_update_steps: int = 0,
                      writable_cache: bool = False, apply_init: bool = True) -> BuildContext:
        """The one way a :class:`BuildContext` is made from a recipe.

        ``writable_cache``: refuse a cache folder that cannot be written (see
        :func:`cache_dir_for`), for callers that build the dataset and transform.
        ``apply_init``: False where the model's weights come from elsewhere (a checkpoint,
        or a random initialisation on purpose), so it does not read ``[model] init``."""
        # Conventions documented in octfw.hookspecs: the transform's image_size and
        # the model's patch_size define the patch grid both must agree on.
        image_size = getattr(self.transform.config, "image_size", None)
        patch_size = getattr(self.model.config, "patch_size", None)
        masking = self.transform.config
        return BuildContext(
            recipe_dir=self.folder, cache_dir=cache_dir_for(self.run, writable=writable_cache),
            run_dir=run_dir, seed=self.run.seed, rank=rank, world_size=world_size,
            image_size=tuple(image_size) if image_size is not None else None,
            patch_size=tuple(patch_size) if patch_size is not None else None,
            mask_pairs=masking.mask_pairs() if isinstance(masking, MaskingConfig) else ("",),
            base_lr=self.engine.base_lr, weight_decay=self.engine.weight_decay,
            total_update_steps=total_update_steps, recipe=self.to_dict(), registry=registry,
            apply_init=apply_init,
        )


def cache_dir_for(run: Any, *, writable: bool = False) -> Path:
    """``run.cache_dir``, else ``$OCTFW_CACHE_DIR``, else ``~/.cache/octfw``.

    ``writable`` (when components that fill the cache are about to be built):
    the folder is created and proven writable, else one UserError naming the
    setting it came from, before any data is read. Refused rather than run
    without a cache: the synthetic cohort lives there, and a run that decodes
    every volume every epoch is a silent slowdown the user did not ask for.
    """
    if getattr(run, "cache_dir", None) is not None:
        folder, setting = Path(run.cache_dir.local_path), f"run.cache_dir = {str(run.cache_dir)!r}"
    elif os.environ.get("OCTFW_CACHE_DIR"):
        folder = Path(os.environ["OCTFW_CACHE_DIR"])
        setting = f"OCTFW_CACHE_DIR={folder}"
    else:
        folder = Path.home() / ".cache" / "octfw"
        setting = f"the default cache folder {folder}"
    if writable:
        require_writable_folder(folder, setting, "; set run.cache_dir or OCTFW_CACHE_DIR to a writable folder")
    return folder


def validate(data: Mapping[str, Any], registry: Registry, source: Path, overrides: Sequence[str] = ()) -> Recipe:
    """Turn merged recipe data into a :class:`Recipe`, or raise :class:`RecipeError`.

    ``overrides``: the ``--set`` texts applied to ``data``; a problem in a value
    one of them wrote names that ``--set``, not the file."""
    problems: list[Problem] = []
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            problems.append((key, f"unknown table{did_you_mean(key, TOP_LEVEL_KEYS)}; "
                                  f"valid tables: {', '.join(TOP_LEVEL_KEYS[1:])}"))
    core: dict[str, Any] = {}
    for key, cls in CORE_TABLES.items():
        table = data.get(key, {})
        if not isinstance(table, dict):
            problems.append((key, f"expected a table, got {describe(table)}"))
            continue
        core[key], found = structure_config(cls, table, key, registry)
        problems += found

    by_stage: dict[str, Any] = {}
    for stage, (_hook, table, many) in STAGES.items():
        if table not in data:
            choices = ", ".join(registry.names(stage)) or "none installed"
            problems.append((f"[{table}]", f"missing; choose a {stage} component: {choices}"))
            continue
        if many:
            by_stage[stage], found = structure_stage_array(registry, stage, data[table], table)
        else:
            by_stage[stage], found = structure_stage(registry, stage, data[table], table)
        problems += found

    if problems:
        raise RecipeError(str(source), _blame_overrides(problems, overrides))
    return Recipe(source=source, run=core["run"], engine=core["engine"], by_stage=by_stage)


def _blame_overrides(problems: list[Problem], overrides: Sequence[str]) -> list[Problem]:
    """Each problem at a key a ``--set`` wrote, or inside a table it wrote, labelled with that
    ``--set`` (``--set engine.bse_lr=1: unknown key ...``): a typo on the command line is
    looked for there, not in the file."""
    set_by: dict[str, str] = {}  # problem path ("guard[1].max_norm") -> the --set text, the last one winning
    for text in overrides:
        keys, _value = parse_override(text)
        path = keys[0] + "".join(f"[{k}]" if k.isdigit() else f".{k}" for k in keys[1:])
        set_by[path] = text
    blamed = []
    for path, message in problems:
        if path in set_by:
            path = f"--set {set_by[path]}"
        else:
            inside = [key for key in set_by if path.startswith((f"{key}.", f"{key}["))]
            if inside:
                path = f"--set {set_by[max(inside, key=len)]}: {path}"
        blamed.append((path, message))
    return blamed


def load_recipe(path: str | Path, overrides: Sequence[str], registry: Registry) -> Recipe:
    """Read, merge, override and validate a recipe. Imports no heavy dependency.

    ``registry`` is the command's one :func:`octfw.registry.load_registry`."""
    source = Path(path)
    if source.is_dir():
        raise UserError(f"{source}: is a folder; give a recipe file (.toml)")
    dropped: list[Dropped] = []
    data = read_with_extends(source, dropped=dropped)
    for stage, default in DEFAULT_STAGES.items():
        data.setdefault(STAGES[stage][1], copy.deepcopy(default))
    data = apply_overrides(data, overrides)
    recipe = validate(data, registry, source.resolve(), overrides)
    return attrs.evolve(recipe, dropped=_still_dropped(recipe, dropped))


def _still_dropped(recipe: Recipe, dropped: list[Dropped]) -> tuple[Dropped, ...]:
    """``dropped`` less the components a later file of the chain (or a ``--set``) listed again."""
    stage_of_table = {table: stage for stage, (_hook, table, _many) in STAGES.items()}
    out = []
    for drop in dropped:
        specs = recipe.by_stage[stage_of_table[drop.table]] if drop.table in stage_of_table else ()
        names = tuple(name for name in drop.names if name not in {spec.name for spec in specs})
        if names:
            out.append(drop._replace(names=names))
    return tuple(out)


def _without_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return str(value) if isinstance(value, str) else value


def to_toml(data: Mapping[str, Any]) -> str:
    """Resolved recipe data as TOML (``octfw show``, the run's recipe.toml).

    TOML has no null: an unset option is left out, so reading the file back
    gives it its default (None) again."""
    return tomli_w.dumps(_without_none(data))
