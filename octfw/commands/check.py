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
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="processes of the run to check: TPU hosts, or torchrun processes (default 1)")
    parser.add_argument("--devices-per-process", type=int, default=1, metavar="M",
                        help="devices each process drives, e.g. 4 on a TPU v4 host (default 1); the global "
                             "batch and the schedule's length follow from N x M")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe, registry = load_recipe_from_args(args)
    print(f"recipe    {recipe.source}: valid")
    from octfw.engine.cadence import cadence_warnings

    for warning in cadence_warnings(recipe.engine):
        logging.getLogger(__name__).warning(warning)
    from octfw.tools.check import check_recipe  # imports torch: only when the command runs

    for flag, value in (("--processes", args.processes), ("--devices-per-process", args.devices_per_process)):
        if value < 1:
            from octfw.errors import UserError

            raise UserError(f"{flag} {value}: must be at least 1")
    check_recipe(recipe, registry, processes=args.processes, devices_per_process=args.devices_per_process)
    print("check passed")
    return 0
