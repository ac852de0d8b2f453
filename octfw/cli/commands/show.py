"""``octfw show RECIPE [--set k=v ...]``: the resolved recipe as TOML, every option shown."""

from __future__ import annotations

import argparse

from octfw.cli.commands._common import add_recipe_arguments, load_recipe_from_args

__all__ = ["add_parser"]

HELP = ("Print the resolved recipe as TOML: every option with its default filled in; those unset or "
        "derived (run.cache_dir, engine.num_workers, ...) as comments saying how they are derived.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("show", help=HELP, description=HELP)
    add_recipe_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.recipe.shown import annotated_toml

    recipe, registry = load_recipe_from_args(args)
    print(annotated_toml(recipe, registry), end="")
    return 0
