"""``octfw bench RECIPE --grid table.key=v1,v2 ... --steps N [--csv FILE]``."""

from __future__ import annotations

import argparse
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from octfw.diagnostics.bench import bench, format_table, parse_grid, write_csv

    grid = parse_grid(args.grid or [])
    rows = bench(Path(args.recipe), grid, args.steps, base_overrides=args.set or (),
                 work_dir=Path(args.keep_runs) if args.keep_runs else None)
    print(format_table(rows))
    if args.csv:
        write_csv(rows, Path(args.csv))
        print(f"written {args.csv}")
    return 0 if all(r.error is None for r in rows) else 1


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
    p.set_defaults(func=run)
