"""``octfw run RECIPE [--set k=v ...] [--resume auto|PATH]``: train."""

from __future__ import annotations

import argparse
import shlex
import sys

from octfw.commands._common import add_recipe_arguments, load_recipe_from_args

__all__ = ["add_parser"]

HELP = "Train: validate the recipe, build the components and run the engine."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help=HELP, description=HELP)
    add_recipe_arguments(parser)
    parser.add_argument("--resume", metavar="auto|PATH",
                        help="auto: continue the newest run of this recipe from its last complete checkpoint, "
                             "start a new run when there is none, and do nothing when it finished (safe to "
                             "repeat, e.g. in a preemptible VM's startup script); PATH: a checkpoint file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe, registry = load_recipe_from_args(args)
    from octfw.engine.launch import AlreadyFinished, launch  # imports torch: only when the command runs
    from octfw.engine.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
    from octfw.engine.trainer import SAVE_FAILED_EXIT_CODE

    try:
        summary = launch(recipe, registry, resume=args.resume)
    except AlreadyFinished as done:  # --resume auto: nothing left to train
        print(f"octfw: nothing to resume: {done}", file=sys.stderr)
        return 1 if done.summary.get("stopped") else 0
    again = shlex.join(["octfw", "run", args.recipe, *(f"--set={item}" for item in args.set or ()),
                        "--resume", "auto"])
    if summary.final_save_failed:
        kept = (f"the final state is in {summary.fallback_checkpoint}" if summary.fallback_checkpoint
                else f"the newest complete checkpoint is {summary.checkpoint or '(none)'}")
        print(f"octfw: error: the final checkpoint could not be written ({summary.failed_saves[-1]}); {kept}. "
              f"When the checkpoint location works again, resume with: {again}", file=sys.stderr)
        return SAVE_FAILED_EXIT_CODE
    if summary.preempted:
        print(f"octfw: stopped by {summary.stopped}; checkpoint {summary.checkpoint or '(none written)'}. "
              f"Resume with: {again}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE if summary.interrupted else PREEMPTED_EXIT_CODE
    if summary.stopped:
        print(f"stopped early: {summary.stopped}", file=sys.stderr)
        return 1
    return 0
