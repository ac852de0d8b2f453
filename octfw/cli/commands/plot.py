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
    from octfw.display.errors import UserError
    from octfw.display.plots import plot_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a folder; give a run folder, e.g. runs/quickstart/20260101-120000")
    png = Path(args.png) if args.png else run_dir / "run.png"
    print(f"plot      {plot_run(run_dir / args.metrics, png, _schedule(run_dir))}")
    return 0


def _schedule(run_dir: Path) -> tuple[list[int], list[float]] | None:
    """The run's LR at every update step, from its saved recipe's scheduler (the log samples
    it at log steps only); None when that cannot be rebuilt here (a plugin not installed)."""
    import json
    import logging

    import attrs

    from octfw.cli.commands._common import load_registry_once
    from octfw.display.errors import UserError
    from octfw.recipe import load_recipe
    from octfw.engine.schedules import simulate

    try:
        total = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["total_update_steps"]
        registry = load_registry_once()
        recipe = load_recipe(run_dir / "recipe.toml", (), registry)
        ctx = attrs.evolve(recipe.build_context(registry=registry), total_update_steps=int(total))
        lr = simulate(recipe.scheduler.build(ctx), int(total), recipe.engine.base_lr)["lr"]
    except (OSError, KeyError, ValueError, UserError) as exc:  # the logged LR is still drawn
        logging.getLogger(__name__).debug("LR schedule not rebuilt for the plot: %s", exc)
        return None
    return [step + 1 for step in range(len(lr))], [float(v) for v in lr]
