"""Which pretraining settings help the probes? One change of the recipe at a time, measured alike.

Issue #17 names the levers a user controls: the loss and its target
normalisation, the masking and its ratio, predictor depth, model size,
augmentations, weight decay (the LR and EMA schedules were measured with
``pretraining_gain.py`` at the full budget). This screen trains
``recipes/pretrain_cpu.toml`` (at LR 1e-4 with random masking: ``BASE``)
with each lever changed alone, for a short budget (2,400 updates, about 2
minutes per run on one idle core), and probes every run next to the network
it started from exactly as ``pretraining_gain.py`` does, on the two
findings where the attentive probe has room above a random encoder
(``fluid`` and ``thinning``; on ``lesion`` a random encoder's tokens
already give it 0.92 balanced accuracy).

A short screen ranks levers; it does not predict the full budget (at 2,400
updates the baseline's tokens have not yet partially collapsed, at 24,000
they have). Promising levers are then run with ``pretraining_gain.py
--updates 24000 --set ...``.

Each (lever, seed) is written to ``--work-dir`` as it finishes, so an
interrupted screen resumes where it stopped. Prints, per lever, the gap
(pretrained - random, balanced accuracy, mean ± std over seeds x splits) per
task and probe, and its change against the baseline's; writes
``benchmarks/results/pretraining_levers.json``.

    PJRT_DEVICE=CPU python benchmarks/learning/pretraining_levers.py --work-dir /tmp/levers
    PJRT_DEVICE=CPU python benchmarks/learning/pretraining_levers.py --work-dir /tmp/levers --only baseline mse
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, machine, write_result  # noqa: E402
from pretraining_gain import EVAL_VOLUMES, RECIPE, measure, probe_options, summarise  # noqa: E402

#: Every run starts from the recipe as it was when the levers were screened (it
#: now sets the winner of the full-budget runs, multiblock masking at LR 3e-5).
BASE = ("engine.base_lr=1e-4", 'transform.mask={generator="random", ratio=0.6}')
#: name -> (what changes, the --set overrides on top of BASE).
LEVERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "baseline": ("recipes/pretrain_cpu.toml at LR 1e-4: l1 on layer-normed targets, random masking 0.6", ()),
    "nmse": ("loss: MSE of L2-normalised vectors (the seeds')", ('model.loss="nmse"',)),
    "mse": ("loss: MSE on raw targets (no target normalisation)", ('model.loss="mse"',)),
    "ratio0.8": ("random masking, 80 % of patches are targets", ('transform.mask={generator="random", ratio=0.8}',)),
    "ratio0.9": ("random masking, 90 % of patches are targets", ('transform.mask={generator="random", ratio=0.9}',)),
    "ratio0.4": ("random masking, 40 % of patches are targets", ('transform.mask={generator="random", ratio=0.4}',)),
    "multiblock3d": ("3D multiblock masking (V-JEPA's 8 short-range and 2 long-range blocks)",
                     ('transform.mask={generator="multiblock3d"}',)),
    "predictor4": ("predictor depth 4 instead of 2", ("model.predictor_depth=4",)),
    "width192": ("encoder width 192 instead of 96 (about 4x the encoder's weights)", ("model.embed_dim=192",)),
    "wd0.2": ("weight decay 0.2 instead of 0.05", ("engine.weight_decay=0.2",)),
    "augment": ("augmentations: flip 0.5, affine 0.5, intensity jitter 0.2",
                ("transform.flip_prob=0.5", "transform.affine_prob=0.5", "transform.intensity_jitter=0.2")),
}
TASKS = ("fluid", "thinning")
SCREEN_PROBES = ("linear-probe", "attentive-probe")


def overrides_of(lever: str) -> list[str]:
    return [*BASE, *LEVERS[lever][1]]


def screen(work: Path, lever: str, seed: int, args: argparse.Namespace, probes: list[str],
           options: dict[str, dict[str, Any]], registry: Any) -> dict[str, Any]:
    """One lever on one seed, read back from ``work`` when an earlier screen finished it."""
    done = work / lever / f"seed{seed}.json"
    if done.exists():
        return json.loads(done.read_text())
    overrides = overrides_of(lever)
    run, records = measure(work / lever, seed, args.updates, None, overrides, list(TASKS), args.splits,
                           EVAL_VOLUMES, probes, options, registry)
    result = {"lever": lever, "overrides": overrides, "updates": args.updates, "run": run, "records": records}
    done.write_text(json.dumps(result, indent=1))
    return result


def format_table(rows: dict[str, list[dict[str, Any]]], probes: list[str]) -> str:
    columns = [(task, probe) for probe in probes for task in TASKS]
    header = f"{'lever':<13}" + "".join(f"{task + ' ' + probe.split('-')[0]:>24}" for task, probe in columns)
    lines = [header, "-" * len(header)]
    base = {(r["task"], r["probe"]): r["gap"]["mean"] for r in rows.get("baseline", [])}
    for lever, lever_rows in rows.items():
        gaps = {(r["task"], r["probe"]): r["gap"] for r in lever_rows}
        cells = []
        for key in columns:
            gap = gaps[key]
            change = f" ({gap['mean'] - base[key]:+.2f})" if lever != "baseline" and key in base else ""
            cells.append(f"{gap['mean']:+.3f}±{gap['std']:.2f}{change}")
        lines.append(f"{lever:<13}" + "".join(f"{cell:>24}" for cell in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(LEVERS), help="these levers (default: all)")
    parser.add_argument("--updates", type=int, default=2400, help="update steps per run (default 2400)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="pretraining seeds (default 0 1)")
    parser.add_argument("--splits", type=int, default=3, help="split seeds 0..N-1 per task (default 3)")
    parser.add_argument("--work-dir", type=Path, required=True,
                        help="runs and per-(lever, seed) results; a rerun reuses what is there")
    args = parser.parse_args()

    from octfw.registry import load_registry

    started = time.perf_counter()
    registry = load_registry()
    probes = [name for name in SCREEN_PROBES if name in registry.names("evaluator")]
    options = probe_options(registry, probes, smoke=False)
    levers = args.only or list(LEVERS)
    results, records, rows = {}, {}, {}
    for lever in levers:
        results[lever] = [screen(args.work_dir, lever, seed, args, probes, options, registry) for seed in args.seeds]
        records[lever] = [record for result in results[lever] for record in result["records"]]
        rows[lever] = [row for row in summarise(records[lever], probes, list(TASKS))
                       if row["metric"] == "balanced_accuracy"]
        print(f"screened  {lever}: {LEVERS[lever][0]}", flush=True)

    print("\nbalanced-accuracy gap, pretrained - random (change against the baseline's gap)")
    print(format_table(rows, probes))
    path = write_result("pretraining_levers", {
        "machine": machine(),
        "recipe": str(RECIPE.relative_to(ROOT)),
        "updates": args.updates, "seeds": args.seeds, "splits": args.splits, "tasks": list(TASKS),
        "probes": probes, "probe_options": options,
        "levers": {lever: {"what": LEVERS[lever][0], "overrides": overrides_of(lever),
                           "runs": [result["run"] for result in results[lever]], "table": rows[lever],
                           "records": records[lever]}
                   for lever in levers},
        "seconds": round(time.perf_counter() - started, 1),
    })
    print(f"\nwrote {path.relative_to(ROOT)} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
