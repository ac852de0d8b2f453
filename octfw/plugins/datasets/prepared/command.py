"""``octfw prepare RECIPE --out LOCATION``: prepare a recipe's dataset once, for streaming.

The ``prepared`` dataset's own command, registered by its plugin
(:mod:`octfw.plugins.datasets.prepared`) through ``octfw_register_commands`` as a third
party's would be. Light at import (argparse and :mod:`octfw.cli.arguments`): ``octfw --help``
imports it; the work (:mod:`.prepare`, Dask, zarr) is imported when the command runs.
"""

from __future__ import annotations

import argparse

from octfw.cli.arguments import add_recipe_arguments, load_recipe_from_args

__all__ = ["NAME", "HELP", "add_arguments", "run"]

NAME = "prepare"

HELP = ("Decode, resample, normalise and fit every volume of the recipe's dataset once, on a Dask "
        "cluster, into compressed zarr arrays at a local folder or gs:// URL; train from it with "
        "[dataset] name = \"prepared\". Resumable: run it again to finish or to add new files. "
        "Safe to run while trainers read the location: they see the last complete snapshot until "
        "the new one is written whole; one prepare at a time per location. A location holding "
        "another dataset or other transform options is refused unless --add or --replace says "
        "what to do; nothing is deleted without --prune or --replace.")

_NAMED = 5  # removed sources named on the console; the rest are counted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument("--out", required=True, metavar="LOCATION",
                        help="where the prepared dataset goes: a local folder or URL (gs://bucket/prefix)")
    parser.add_argument("--scheduler", default=None, metavar="ADDRESS",
                        help="a running Dask scheduler (tcp://host:8786) whose workers do the work; "
                             "default: a local cluster on this machine")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="worker processes of the local cluster (default: one per CPU core)")
    parser.add_argument("--dtype", choices=("auto", "uint8", "float16"), default="auto",
                        help="stored voxels: uint8 (error <= 1/510) or float16 (error <= 2^-12); auto: "
                             "uint8 for 8-bit sources, float16 otherwise (default)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--add", action="store_true",
                      help="LOCATION holds another recipe's dataset: add this recipe's volumes to it "
                           "(same transform options needed); nothing is removed")
    mode.add_argument("--replace", action="store_true",
                      help="rebuild LOCATION for this recipe alone: once the new snapshot is written, "
                           "every volume not in it (other datasets, other transform options, removed "
                           "or rewritten files) is deleted and its source listed")
    parser.add_argument("--prune", action="store_true",
                        help="once the new snapshot is written, delete the volumes it no longer lists "
                             "(files removed from the dataset or rewritten); without it they are kept, "
                             "for trainers still reading the previous snapshot, and counted as stale")


def run(args: argparse.Namespace) -> int:
    recipe, registry = load_recipe_from_args(args)
    from octfw.display.errors import UserError
    from octfw.plugins.datasets.prepared.prepare import prepare_dataset
    from octfw.display.progress import progress_bar
    from octfw.storage.failures import format_bytes
    from octfw.display.tables import counted

    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be at least 1")
    with progress_bar("prepare", unit="volumes", text="starting the Dask cluster") as progress:
        summary = prepare_dataset(recipe, registry, args.out, scheduler=args.scheduler, workers=args.workers,
                                  dtype=args.dtype, add=args.add, replace=args.replace, prune=args.prune,
                                  progress=progress)
    per_volume = format_bytes(summary.stored_bytes / max(summary.volumes, 1))
    print(f"prepared  {summary.location}: {counted(summary.volumes, 'volume')} ({summary.prepared} sources read now, "
          f"{summary.reused} done before), {summary.quarantined} quarantined, {summary.removed} removed; "
          f"{format_bytes(summary.stored_bytes)} stored ({per_volume} per volume) in {summary.seconds:.0f} s")
    if summary.kept:
        print(f"          {summary.kept} of the volumes are other datasets' (added before)")
    if summary.removed:
        named = ", ".join(summary.removed_sources[:_NAMED])
        more = len(summary.removed_sources) - _NAMED
        print(f"          removed {counted(summary.removed, 'volume')} no longer listed: {named}"
              + (f" and {more} more" if more > 0 else ""))
    if summary.stale:
        print(f"          {counted(summary.stale, 'volume')} no longer listed (files removed or rewritten) kept for "
              "trainers still reading the previous snapshot; run again with --prune to remove them")
    if summary.quarantined:
        print(f"          the files that could not be used and why: {summary.quarantine_file}")
    print(f"train from it: [dataset] name = \"prepared\", path = \"{summary.location}\"")
    return 0
