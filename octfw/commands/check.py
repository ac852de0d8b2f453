"""``octfw check RECIPE [--set k=v ...]``: validate, build, and push one real batch through."""

from __future__ import annotations

import argparse
import logging

from octfw.commands._common import add_recipe_arguments, load_recipe_from_args

__all__ = ["add_parser"]

HELP = ("Validate, build every component and push one real batch through "
        "dataset -> transform -> model forward and backward on the CPU.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("check", help=HELP, description=HELP)
    add_recipe_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe, registry = load_recipe_from_args(args)
    print(f"recipe    {recipe.source}: valid")
    from octfw.engine.cadence import cadence_warnings

    for warning in cadence_warnings(recipe.engine):
        logging.getLogger(__name__).warning(warning)
    from octfw.tools.check import check_recipe  # imports torch: only when the command runs

    check_recipe(recipe, registry)
    print("check passed")
    return 0
