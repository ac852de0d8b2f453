"""``octfw show RECIPE [--set k=v ...]``: the resolved recipe as TOML."""

from __future__ import annotations

import argparse

from octfw.commands._common import add_recipe_arguments, load_recipe_from_args

__all__ = ["add_parser"]

HELP = "Print the resolved recipe with every default filled in, as TOML."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("show", help=HELP, description=HELP)
    add_recipe_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.recipe import to_toml

    recipe, _registry = load_recipe_from_args(args)
    print(to_toml(recipe.to_dict()), end="")
    return 0
