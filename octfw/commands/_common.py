"""What several commands share: the recipe arguments and loading the registry once.
(The progress bar of long work is :func:`octfw.progress.progress_bar`.)"""

from __future__ import annotations

import argparse
import logging
from typing import Any

__all__ = ["add_recipe_arguments", "load_registry_once", "load_recipe_from_args"]


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe file (.toml)")
    parser.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                        help="override a recipe value, e.g. --set engine.base_lr=1e-4 (repeatable)")


def load_registry_once() -> Any:
    """The command's one registry: plugins are discovered here and passed down.
    A plugin that failed to load is a warning, not an error (the others still work)."""
    from octfw.registry import load_registry

    registry = load_registry()
    for failure in registry.failures:
        logging.getLogger(__name__).warning(str(failure))
    return registry


def load_recipe_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(recipe, registry) for a command that takes RECIPE and --set."""
    from octfw.recipe import load_recipe

    registry = load_registry_once()
    return load_recipe(args.recipe, args.set or (), registry), registry
