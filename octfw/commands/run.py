"""``octfw run RECIPE [--set k=v ...] [--resume auto|PATH]``: train."""

from __future__ import annotations

import argparse
import sys

from octfw.commands._common import add_recipe_arguments, load_recipe_from_args

__all__ = ["add_parser"]

HELP = "Train: validate the recipe, build the components and run the engine."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help=HELP, description=HELP)
    add_recipe_arguments(parser)
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="continue from the newest complete checkpoint of the latest run (auto) or from PATH")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe, registry = load_recipe_from_args(args)
    from octfw.engine.launch import launch  # imports torch: only when the command runs

    summary = launch(recipe, registry, resume=args.resume)
    if summary.stopped:
        print(f"stopped early: {summary.stopped}", file=sys.stderr)
        return 1
    return 0
