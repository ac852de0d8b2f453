"""``octfw lr RECIPE --png lr.png``: simulate a recipe's schedule, draw it, give the verdict.

Builds only what the schedule needs: the scheduler, and the dataset when the
run is given in epochs alone (its size fixes the total update steps). No model,
no device. A length in steps, ``--steps N`` or ``run.max_steps``, previews any
recipe without its data. The PNG is drawn before the verdict, so a refused schedule can be seen;
a refused schedule then exits with code 2 and names the update step and values.
"""

from __future__ import annotations

import argparse
from typing import Any

from octfw.cli.commands._common import add_recipe_arguments, load_recipe_from_args
from octfw.types import WarmupSchedule

__all__ = ["add_parser", "schedule_for"]

HELP = ("Simulate the recipe's LR, weight decay and EMA momentum over every update step, "
        "optionally draw them (--png), and refuse a schedule that restarts or reaches 0 early.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("lr", help=HELP, description=HELP)
    add_recipe_arguments(parser)
    parser.add_argument("--png", metavar="FILE", help="draw the schedule into this PNG, e.g. lr.png")
    parser.add_argument("--devices", type=int, default=1, metavar="N",
                        help="devices the run will train on (the world size): with run.epochs alone "
                             "the total update steps depend on it (default 1)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help="preview this many update steps, whatever run.max_steps and run.epochs say "
                             "(the dataset is not read); default: run.max_steps when set, else run.epochs "
                             "x the update steps of one epoch of the dataset")
    parser.set_defaults(func=run)


def schedule_for(recipe: Any, registry: Any, devices: int = 1,
                 steps: int | None = None) -> tuple[Any, int, int | None]:
    """(schedule, total update steps, steps per epoch or None) for ``recipe`` on ``devices`` devices.

    The length is ``steps`` when given, else ``run.max_steps`` when set: a preview
    in steps needs no data (with ``run.epochs`` also set, the run itself may end
    sooner: it stops at whichever comes first). Only ``run.epochs`` alone builds
    the dataset, whose size fixes the total.
    """
    import attrs

    from octfw.engine.build import plan_update_steps
    from octfw.engine.distributed import layout_for
    from octfw.display.errors import UserError

    if devices < 1:
        raise UserError(f"--devices {devices}: must be at least 1")
    if steps is not None and steps < 1:
        raise UserError(f"--steps {steps}: must be at least 1")
    total = steps if steps is not None else recipe.run.max_steps
    by_epochs = total is None  # the dataset's size is needed, so it is built
    ctx = recipe.build_context(registry=registry, world_size=devices, writable_cache=by_epochs)
    steps_per_epoch = None
    if by_epochs:
        try:
            dataset = recipe.dataset.build(ctx)
        except UserError as exc:  # say why the data is read at all, and how to do without it
            raise UserError(f"run.epochs = {recipe.run.epochs} counts update steps from the dataset's size, "
                            f"and [dataset] {recipe.dataset.name!r} could not be read: {exc}. Point it at "
                            "your data (e.g. --set dataset.path=...), or preview a length in steps without "
                            "the data: --steps N (or --set run.max_steps=N)") from None
        if len(dataset) == 0:
            raise UserError(f"dataset {recipe.dataset.name!r} lists no files")
        layout = layout_for(recipe.engine.per_device_batch, recipe.engine.grad_accum_steps,
                            recipe.engine.global_batch, devices_per_process=devices)
        steps_per_epoch, total = plan_update_steps(recipe, len(dataset), layout)
    schedule = recipe.scheduler.build(attrs.evolve(ctx, total_update_steps=total))
    return schedule, total, steps_per_epoch


def run(args: argparse.Namespace) -> int:
    import math

    from octfw.display.errors import UserError
    from octfw.engine.schedules import plot_schedule, simulate, validate_schedule

    recipe, registry = load_recipe_from_args(args)
    schedule, total, per_epoch = schedule_for(recipe, registry, args.devices, args.steps)
    base_lr = recipe.engine.base_lr
    values = simulate(schedule, total, base_lr)
    lr = values["lr"]
    if per_epoch is not None:
        length = f", {per_epoch} per epoch"
    elif args.steps is not None:
        length = " (--steps)"
    elif recipe.run.epochs is not None:
        length = f" (run.max_steps; the run stops sooner if run.epochs = {recipe.run.epochs} ends first)"
    else:
        length = ""
    devices = "device" if args.devices == 1 else "devices"
    print(f"schedule  {recipe.scheduler.name}: {total} update steps{length} on {args.devices} {devices}")
    peak = int(lr.argmax())
    print(f"lr        first {lr[0]:.3g}, peak {lr[peak]:.3g} at update step {peak}, last {lr[-1]:.3g}")
    for key, label in (("weight_decay", "wd"), ("ema_momentum", "ema")):
        series = values[key]
        if not all(math.isnan(v) for v in series):  # NaN everywhere: not scheduled
            print(f"{label:<9} first {series[0]:.6g}, last {series[-1]:.6g}")
    if args.png:
        print(f"plot      {plot_schedule(values, args.png)}")
    problems = validate_schedule(schedule, total, base_lr,
                                 schedule.warmup_steps if isinstance(schedule, WarmupSchedule) else None)
    if problems:
        raise UserError(f"[scheduler] {recipe.scheduler.name}: refused: " + "; ".join(problems))
    print("verdict   ok: the LR stays above 0 and never rises after warmup")
    return 0
