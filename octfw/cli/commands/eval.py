"""``octfw eval RUN_DIR_OR_ENCODER [...] --recipe EVAL.toml``: probe a pretrained encoder
against a randomly initialised one of the same architecture; several encoders side by side.

``--shots 5,10,50,all`` measures label efficiency (several encoders too, beside one random
baseline fitted once per draw); ``--checkpoints all`` (a run folder) probes every saved
checkpoint and plots the metric over update steps. Every report states the test split, each
metric's interval and each encoder's difference from random init; a run folder keeps it in
``eval/``. Progress goes to a bar on a terminal, else to a log line every 30 s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser"]

HELP = ("Evaluate a run's latest checkpoint, a checkpoint file, an exported encoder or the model a "
        "training recipe starts from (its [model] init weights) with the [[evaluator]] tables of a recipe, "
        "next to a randomly initialised encoder of the same architecture; print a table of each metric "
        "(classifiers: accuracy, balanced accuracy, AUROC, AUPRC; dense-probe: voxel and token Dice and IoU; "
        "layer-segmentation: Dice per layer, mean_dice and boundary errors in µm and in rows) with its 95 % "
        "interval over test patients, and each encoder's difference from random init with its paired interval. "
        "Several encoders: side by side, one random baseline. --shots: label efficiency; --checkpoints: "
        "compare a run's checkpoints.")
#: Seconds between two progress lines when stderr is not a terminal (a log file, a batch job).
LOG_EVERY_S = 30.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help=HELP.replace("%", "%%"), description=HELP)
    parser.add_argument("source", metavar="RUN_DIR_OR_ENCODER", nargs="+",
                        help="a run folder (its latest checkpoint), a checkpoint file, what octfw export "
                             "wrote (any --format), or a training recipe (.toml: the model it starts from, "
                             "e.g. published weights as they are); several: compared side by side with one "
                             "random baseline (with --shots too)")
    parser.add_argument("--names", metavar="A,B,...",
                        help="several encoders: their column names (default: each path's name)")
    parser.add_argument("--recipe", required=True, metavar="EVAL.toml",
                        help="recipe with [[evaluator]] tables and optionally [run] seed, device, cache_dir "
                             "(a training recipe with [[evaluator]] tables works as it is)")
    parser.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                        help="override a recipe value, e.g. --set evaluator.0.k=5 (repeatable)")
    parser.add_argument("--shots", metavar="K,K,...,all",
                        help="label efficiency: fit each evaluator on K labelled volumes per class (a classifier, "
                             "dense-probe: K with the finding and K without; layer-segmentation: K volumes, each "
                             "labelled with every layer), seeded draws, the same for every encoder ('all': the "
                             "whole train split); a validation split, where the evaluator has one, stays whole "
                             "and is counted beside K; e.g. --shots 5,10,50,all; prints a table, writes a PNG, a "
                             "CSV and a CSV of every draw")
    parser.add_argument("--draws", type=int, default=None, metavar="N",
                        help="draws of the K volumes per shot count (default 3); the table shows mean ± std "
                             "over draws and each encoder's mean paired difference from random init")
    parser.add_argument("--checkpoints", metavar="all|latest|STEP,STEP",
                        help="probe these saved checkpoints of the run folder and plot the metric against "
                             "the update step")
    parser.add_argument("--metric", metavar="NAME",
                        help="metric the PNG shows (default: auroc, or balanced_accuracy where an evaluator "
                             "reports no AUROC, voxel_dice for dense-probe, mean_dice for layer-segmentation; "
                             "e.g. boundary_error_um)")
    parser.add_argument("--png", metavar="FILE",
                        help="PNG to write with --shots or --checkpoints (default: eval_shots.png or "
                             "eval_checkpoints.png in the run folder, else in the current folder)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def _check_options(args: argparse.Namespace) -> None:
    from octfw.display.errors import UserError

    if len(args.source) > 1 and args.checkpoints is not None:
        raise UserError(f"{len(args.source)} encoders: --checkpoints takes one run folder; compare several "
                        "without it")
    if args.names is not None and len(args.source) == 1:
        raise UserError("--names applies to several encoders")
    if args.shots is not None and args.checkpoints is not None:
        raise UserError("--shots and --checkpoints: give one of them (label efficiency of one checkpoint, "
                        "or a metric over checkpoints)")
    if args.draws is not None and args.shots is None:
        raise UserError("--draws applies to --shots")
    if args.draws is not None and args.draws < 1:
        raise UserError(f"--draws {args.draws}: give 1 or more")
    if args.shots is None and args.checkpoints is None:
        for option in ("png", "metric"):
            if getattr(args, option) is not None:
                raise UserError(f"--{option} applies to --shots or --checkpoints")


def _default_png(source: str, name: str) -> Path:
    folder = Path(source)
    return (folder if folder.is_dir() else Path.cwd()) / name


def run(args: argparse.Namespace) -> int:
    from octfw.cli.commands._common import load_registry_once
    from octfw.evaluation.shots import parse_shots
    from octfw.evaluation.target import evaluate_target, format_report, load_eval_recipe, load_target

    _check_options(args)
    source = args.source[0]
    shots = parse_shots(args.shots) if args.shots is not None else None
    registry = load_registry_once()
    recipe = load_eval_recipe(args.recipe, args.set or (), registry)

    if args.checkpoints is not None:
        from octfw.evaluation.checkpoints import compare_checkpoints, format_checkpoints, plot_checkpoints

        with _progress() as progress:
            report = compare_checkpoints(source, recipe, registry, args.checkpoints, progress)
        png = plot_checkpoints(report, args.png or _default_png(source, "eval_checkpoints.png"),
                               args.metric)
        _print(args, report, format_checkpoints, {"png": str(png)}, "checkpoints")
        return 0

    if shots is not None:
        from octfw.evaluation.compare import load_targets, source_labels
        from octfw.evaluation.label_efficiency import evaluate_shots, format_shots, write_shots

        labels = ["pretrained"] if len(args.source) == 1 else source_labels(
            args.source, args.names.split(",") if args.names else None)
        targets = load_targets(args.source, labels, recipe.run.seed, registry)
        draws = 3 if args.draws is None else args.draws
        with _progress() as progress:
            report = evaluate_shots(targets, recipe, registry, shots, draws, progress)
        files = write_shots(report, args.png or _default_png(source, "eval_shots.png"), args.metric)
        _print(args, report, format_shots, files, "shots")
        return 0

    if len(args.source) > 1:
        from octfw.evaluation.compare import compare_sources, format_comparison, source_labels

        labels = source_labels(args.source, args.names.split(",") if args.names else None)
        with _progress() as progress:
            report = compare_sources(args.source, labels, recipe, registry, progress)
        _print(args, report, format_comparison, {}, "compare")
        return 0

    target = load_target(source, recipe.run.seed, registry)
    with _progress() as progress:
        report = evaluate_target(target, recipe, registry, progress)
    _print(args, report, format_report, {}, "target")
    return 0


def _progress() -> Any:
    """A bar on a terminal; elsewhere (a log, a batch job) a line every :data:`LOG_EVERY_S` seconds."""
    from octfw.display.progress import progress_bar

    return progress_bar("eval", text="loading volumes", log_every=LOG_EVERY_S)


def _print(args: argparse.Namespace, report: Any, formatter: Any, files: dict[str, str], kind: str) -> None:
    """The report on stdout (a table, or JSON with --json); kept in every run folder evaluated."""
    text = formatter(report)
    for source in args.source:
        if (Path(source) / "recipe.toml").is_file():  # a run folder: the results stay with the run
            kept = _keep(Path(source), f"{kind}-{Path(args.recipe).stem}", report, text)
            files = {**files, **(kept if len(args.source) == 1 else {f"{k} ({Path(source).name})": v
                                                                    for k, v in kept.items()})}
    if args.json:
        json.dump({**report.as_dict(), **files}, sys.stdout, indent=2)
        print()
        return
    print(text)
    width = max((len(name) for name in files), default=0)
    for name, path in files.items():
        print(f"{name.ljust(max(width, 9))} {path}")


def _keep(run_dir: Path, name: str, report: Any, text: str) -> dict[str, str]:
    """``<run_dir>/eval/<name>.json``, ``.txt`` and, for a report with ``csv_rows``, ``.csv``
    (``pandas.read_csv`` opens it; ``--shots``: a row per draw); written atomically, a later eval
    replaces them. Returns their paths as ``eval_json``, ``eval_txt``, ``eval_csv``."""
    import csv
    import io

    from octfw.storage.files import write_atomically

    folder = run_dir / "eval"
    folder.mkdir(exist_ok=True)
    kept = {"eval_json": folder / f"{name}.json", "eval_txt": folder / f"{name}.txt"}
    write_atomically(str(kept["eval_json"]), (json.dumps(report.as_dict(), indent=2) + "\n").encode("utf-8"))
    write_atomically(str(kept["eval_txt"]), (text + "\n").encode("utf-8"))
    rows = report.csv_rows() if hasattr(report, "csv_rows") else []
    if rows:
        kept["eval_csv"] = folder / f"{name}.csv"
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        write_atomically(str(kept["eval_csv"]), buffer.getvalue().encode("utf-8"))
    return {key: str(path) for key, path in kept.items()}
