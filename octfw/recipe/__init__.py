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

What the config classes are made of lives here too: :mod:`octfw.recipe.fields`
(``doc()`` and the validators every component's config uses, light: attrs
only), :mod:`octfw.recipe.config` (the ``[run]`` and ``[engine]`` tables),
:mod:`octfw.recipe.changes` (what may change when a run resumes) and
:mod:`octfw.recipe.reference` (docs/recipe-reference.md, generated from the
config classes: ``python -m octfw.recipe.reference``).

The names below are imported when first asked for (``from octfw.recipe import
load_recipe``): ``fields`` and ``config`` sit far below the loader (the
registry and every component's config import them), so importing them must not
import the loader, which imports the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name -> the module that defines it.
_DEFINED_IN = {
    **dict.fromkeys(("apply_overrides", "parse_override", "read_with_extends"), "loading"),
    **dict.fromkeys(("CORE_TABLES", "DEFAULT_STAGES", "TOP_LEVEL_KEYS", "Recipe", "cache_dir_for", "load_recipe",
                     "stage_attribute", "to_toml", "validate"), "resolved"),
    **dict.fromkeys(("Problem", "StageSpec", "build_component", "structure_config", "structure_stage"),
                    "structuring"),
}

__all__ = sorted(_DEFINED_IN)


def __getattr__(name: str) -> Any:
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module 'octfw.recipe' has no attribute {name!r}")
    return getattr(importlib.import_module(f"octfw.recipe.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
