"""Recipes: TOML files that compose components into one training run.

Loading a recipe is four steps, all before any data or device is touched:

1. read the TOML file and the chain of files it ``extends``
   (:mod:`octfw.recipe.loading`);
2. apply ``--set table.key=value`` overrides (same module);
3. structure ``[run]`` and ``[engine]`` and each stage table into the config
   class of the component it names, refusing unknown keys
   (:mod:`octfw.recipe.structuring`);
4. report every problem at once, each naming ``table.key``, what was expected
   and, for a misspelled key or component, the closest valid name
   (:mod:`octfw.recipe.resolved` assembles the :class:`Recipe`).

Relative paths resolve against the folder of the file that wrote them (the
current directory for ``--set`` values).
"""

from octfw.recipe.loading import apply_overrides, parse_override, read_with_extends
from octfw.recipe.resolved import (
    CORE_TABLES, DEFAULT_STAGES, TOP_LEVEL_KEYS, Recipe, cache_dir_for, load_recipe, stage_attribute,
    to_toml, validate,
)
from octfw.recipe.structuring import Problem, StageSpec, build_component, structure_config, structure_stage

__all__ = [
    "Recipe", "StageSpec", "Problem", "load_recipe", "validate", "to_toml", "parse_override",
    "apply_overrides", "read_with_extends", "structure_config", "structure_stage", "stage_attribute",
    "cache_dir_for", "build_component", "DEFAULT_STAGES", "CORE_TABLES", "TOP_LEVEL_KEYS",
]
