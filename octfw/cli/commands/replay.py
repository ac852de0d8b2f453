"""``octfw replay RUN_DIR --step N``: rebuild a step's batch and run it on the CPU."""

from __future__ import annotations

import argparse
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from octfw.cli.commands._common import load_registry_once
    from octfw.diagnostics.replay import replay

    replay(Path(args.run_dir), args.step, load_registry_once())
    return 0


def add_parser(subparsers) -> None:
    text = ("Rebuild the batch of update step N of a run and run it on the CPU from the nearest "
            "earlier checkpoint, printing input statistics, the loss and gradient norms per "
            "parameter group.")
    p = subparsers.add_parser("replay", help=text, description=text)
    p.add_argument("run_dir", help="a run directory (runs/<name>/<timestamp>)")
    p.add_argument("--step", type=int, required=True, help="update step, counted from 1 as in metrics.jsonl")
    p.set_defaults(func=run)
