"""``octfw check RECIPE [--set k=v ...]``: validate, build, and push one real batch through."""

from __future__ import annotations

import argparse
import logging

from octfw.cli.commands._common import add_recipe_arguments, load_recipe_from_args
from octfw.display.errors import UserError

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
    parser.add_argument("--device-kind", choices=("cpu", "cuda", "xla"), default=None,
                        help="size the memory estimate for this kind of device (default: the recipe's "
                             "run.device; cpu and cuda keep a fused attention kernel's log-sum-exp per query, "
                             "xla the same from octfw's query-blocked attention, plus one block's scores)")
    parser.add_argument("--device-memory", default=None, metavar="SIZE",
                        help="memory of one device, e.g. 32GiB for a TPU v4 chip or 80GB for an H100: "
                             "the estimate is compared with it and the largest per-device batch that "
                             "fits is shown (default: this machine's device, or OCTFW_DEVICE_MEMORY_GIB)")
    parser.add_argument("--steps", type=int, default=None, metavar="S",
                        help="preview only, without the data: the global batch for N x M devices and the "
                             "schedule over S update steps (no batch is pushed through; nothing is read)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    recipe, registry = load_recipe_from_args(args)
    print(f"recipe    {recipe.source}: valid")
    from octfw.engine.cadence import cadence_warnings

    for warning in (*recipe.warnings(), *cadence_warnings(recipe.engine)):
        logging.getLogger(__name__).warning(warning)
    for flag, value in (("--processes", args.processes), ("--devices-per-process", args.devices_per_process)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1")
    if args.steps is not None:
        return preview(recipe, registry, args.processes, args.devices_per_process, args.steps)
    from octfw.diagnostics.check import check_recipe  # imports torch: only when the command runs
    from octfw.diagnostics.device_memory import device_memory_bytes

    device_bytes = None
    if args.device_memory is not None:
        try:
            device_bytes = device_memory_bytes(args.device_memory)
        except ValueError as error:
            raise UserError(f"--device-memory {error}") from None
    check_recipe(recipe, registry, processes=args.processes, devices_per_process=args.devices_per_process,
                 device_kind=args.device_kind, device_bytes=device_bytes)
    print("check passed")
    return 0


def preview(recipe, registry, processes: int, devices_per_process: int, steps: int) -> int:
    """``--steps S``: what needs no data (a recipe written for a pod, previewed on a laptop)."""
    from octfw.cli.commands.lr import schedule_for
    from octfw.diagnostics.check import schedule_line
    from octfw.engine.build import check_schedule_values
    from octfw.engine.distributed import layout_for

    layout = layout_for(recipe.engine.per_device_batch, recipe.engine.grad_accum_steps, recipe.engine.global_batch,
                        processes=processes, devices_per_process=devices_per_process)
    schedule, total, _ = schedule_for(recipe, registry, layout.devices, steps)
    print(f"layout    {layout.describe()}")
    print(schedule_line(recipe, schedule, total, "--steps"))
    check_schedule_values(recipe, schedule, total)
    print("preview passed: the layout and the schedule; no data was read and no batch pushed through "
          "(without --steps, check does both)")
    return 0
