"""``octfw plot RUN_DIR --png run.png``: draw a run's loss, collapse signals, evaluations, LR,
gradient norm and skipped updates."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser"]

HELP = ("Draw loss (overall and per domain), the collapse signals (target std, effective rank, "
        "with the collapse guard's thresholds) and evaluator scores when logged, learning rate, "
        "gradient norm and skipped updates over update steps from a run folder's metrics.jsonl.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plot", help=HELP, description=HELP)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holding metrics.jsonl)")
    parser.add_argument("--png", metavar="FILE", help="PNG to write (default: RUN_DIR/run.png)")
    parser.add_argument("--metrics", default="metrics.jsonl", metavar="NAME",
                        help="metrics log inside RUN_DIR (the jsonl logger's filename; default metrics.jsonl)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.errors import UserError
    from octfw.plots import plot_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a folder; give a run folder, e.g. runs/quickstart/20260101-120000")
    png = Path(args.png) if args.png else run_dir / "run.png"
    print(f"plot      {plot_run(run_dir / args.metrics, png)}")
    return 0
