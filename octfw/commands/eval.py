"""``octfw eval RUN_DIR_OR_ENCODER --recipe EVAL.toml``: probe a pretrained encoder
against a randomly initialised one of the same architecture."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_parser"]

HELP = ("Evaluate a run's latest checkpoint, a checkpoint file or an exported encoder with the "
        "[[evaluator]] tables of a recipe, next to a randomly initialised encoder of the same "
        "architecture; print a table.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help=HELP, description=HELP)
    parser.add_argument("source", metavar="RUN_DIR_OR_ENCODER",
                        help="a run folder (its latest checkpoint), a checkpoint file or an encoder file "
                             "written by octfw export")
    parser.add_argument("--recipe", required=True, metavar="EVAL.toml",
                        help="recipe with [[evaluator]] tables and optionally [run] seed, device, cache_dir "
                             "(a training recipe with [[evaluator]] tables works as it is)")
    parser.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                        help="override a recipe value, e.g. --set evaluator.0.k=5 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.commands._common import load_registry_once
    from octfw.tools.evaluate import evaluate_target, format_report, load_eval_recipe, load_target

    registry = load_registry_once()
    recipe = load_eval_recipe(args.recipe, args.set or (), registry)
    target = load_target(args.source, recipe.run.seed, registry)
    report = evaluate_target(target, recipe, registry)
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(format_report(report))
    return 0
