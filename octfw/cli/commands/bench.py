"""``octfw bench RECIPE --grid table.key=v1,v2 ... --steps N [--csv FILE]``."""

from __future__ import annotations

import argparse
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    if args.data_only:
        return run_data_only(args)
    from octfw.diagnostics.bench import bench, format_table, parse_grid, write_csv

    grid = parse_grid(args.grid or [])
    rows = bench(Path(args.recipe), grid, args.steps, base_overrides=args.set or (),
                 work_dir=Path(args.keep_runs) if args.keep_runs else None)
    print(format_table(rows))
    if args.csv:
        write_csv(rows, Path(args.csv))
        print(f"written {args.csv}")
    return 0 if all(r.error is None for r in rows) else 1


def run_data_only(args: argparse.Namespace) -> int:
    from octfw.cli.commands._common import load_recipe_from_args
    from octfw.display.errors import UserError
    from octfw.display.progress import progress_bar

    if args.grid:
        raise UserError("--data-only measures the loader alone: give --workers, not --grid")
    try:
        workers = sorted({int(w) for w in args.workers.split(",")})
    except ValueError:
        raise UserError(f"--workers {args.workers!r}: give worker counts, e.g. 0,1,2") from None
    if not workers or workers[0] < 0:
        raise UserError(f"--workers {args.workers!r}: worker counts are 0 or more")
    recipe, registry = load_recipe_from_args(args)
    from octfw.diagnostics.data_bench import format_data_bench, measure_loader  # imports torch

    with progress_bar("bench", text="building the dataset") as progress:
        rates, cache = measure_loader(recipe, registry, workers, args.samples, progress)
    print(format_data_bench(rates, device_rate=args.device_rate, devices=args.devices, cache=cache))
    return 0


def add_parser(subparsers) -> None:
    text = ("Train every combination of the --grid values for N update steps, each in its own "
            "process, and print per-device batch, accumulation, global batch, samples/s, samples/s "
            "per device, peak memory and stability.")
    p = subparsers.add_parser("bench", help=text, description=text)
    p.add_argument("recipe", help="recipe file (.toml)")
    p.add_argument("--grid", action="append", metavar="TABLE.KEY=V1,V2",
                   help="values to try for one key, e.g. engine.per_device_batch=1,2 (repeatable; "
                        "the combinations are their cartesian product)")
    p.add_argument("--steps", type=int, default=20, help="update steps per combination (default 20)")
    p.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                   help="override applied to every combination (repeatable)")
    p.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    p.add_argument("--keep-runs", metavar="DIR", help="keep each combination's run folder under DIR")
    data = p.add_argument_group("--data-only: the data loader alone, to size input hosts")
    data.add_argument("--data-only", action="store_true",
                      help="build only the recipe's dataset and transform and time the loader with each "
                           "--workers count: samples/s per worker, peak memory per worker, and (with "
                           "--device-rate) the workers the devices need")
    data.add_argument("--workers", default="0,1,2", metavar="N,N,...", help="worker counts (default 0,1,2)")
    data.add_argument("--samples", type=int, default=64, help="samples timed per worker count (default 64)")
    data.add_argument("--device-rate", type=float, metavar="SAMPLES_PER_S",
                      help="samples/s one device consumes (a training `octfw bench` measures it)")
    data.add_argument("--devices", type=int, default=1, metavar="N",
                      help="devices one training process feeds, e.g. 4 on a TPU v4 host (default 1)")
    p.set_defaults(func=run)
