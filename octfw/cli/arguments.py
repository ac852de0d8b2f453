"""What commands share, octfw's own and those plugins add: the recipe arguments and the registry.

A plugin's command (:meth:`octfw.hookspecs.OctfwSpecs.octfw_register_commands`) that
takes a recipe reads it as ``octfw run`` does::

    from octfw.cli.arguments import add_recipe_arguments, load_recipe_from_args

    def add_arguments(parser):
        add_recipe_arguments(parser)          # RECIPE and --set TABLE.KEY=VALUE

    def run(args):
        recipe, registry = load_recipe_from_args(args)
        ...

Light at import (argparse and logging only): ``octfw --help`` imports it.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from octfw.recipe import Recipe
    from octfw.registry import Registry

__all__ = ["add_recipe_arguments", "load_registry_once", "load_recipe_from_args"]


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """``RECIPE`` (a .toml file) and ``--set TABLE.KEY=VALUE`` (repeatable), as every recipe command takes them."""
    parser.add_argument("recipe", help="recipe file (.toml)")
    parser.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                        help="override a recipe value, e.g. --set engine.base_lr=1e-4 (repeatable)")


def load_registry_once(*, report_failures: bool = True) -> Registry:
    """The command's one registry: plugins are discovered here and passed down.
    A plugin that failed to load (or one of its commands) is a warning, not an error (the
    others still work); ``report_failures=False`` where another process names them (a
    launched job's worker: its launcher loaded the same plugins and said so once)."""
    from octfw.registry import load_registry

    registry = load_registry()
    for failure in registry.failures if report_failures else ():
        logging.getLogger(__name__).warning(str(failure))
    return registry


def load_recipe_from_args(args: argparse.Namespace, *, report_failures: bool = True) -> tuple[Recipe, Registry]:
    """(recipe, registry) for a command that takes RECIPE and --set (:func:`add_recipe_arguments`);
    a bad recipe raises :class:`octfw.display.errors.RecipeError`, every problem in it listed.
    ``report_failures``: as for :func:`load_registry_once`."""
    from octfw.recipe import load_recipe

    registry = load_registry_once(report_failures=report_failures)
    return load_recipe(args.recipe, args.set or (), registry), registry
