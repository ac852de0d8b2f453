"""Choosing a checkpoint by its downstream value, without letting the choice grade itself.

For each pretraining run (one per seed) and each task: ``octfw eval RUN
--checkpoints all`` with the attentive probe, once per split seed. The
update step is chosen on split 0 (the best balanced accuracy there) and
measured on the other splits, so the number reported is not the number the
choice was made on. Per task and seed the result holds the mean over those
splits at every step (``curve``), at the chosen step, at the last step and
for the randomly initialised encoder.

The published ``benchmarks/results/checkpoint_selection.json`` was made on
the two 24,000-update runs of ``pretraining_gain.py --updates 24000 --set
engine.base_lr=3e-5 --set 'transform.mask={generator="multiblock3d"}' --set
engine.checkpoint_every_steps=3000 --set checkpointer.keep_last=10`` (the
recipe's settings now), on the thinning and lesion tasks:

    PJRT_DEVICE=CPU python benchmarks/learning/checkpoint_selection.py \\
        --runs RUN_DIR_SEED0 RUN_DIR_SEED1 --tasks thinning lesion

``--smoke`` pretrains two tiny runs itself (a few updates, a checkpoint every
few) and runs the whole path on small cohorts and two splits, into
``checkpoint_selection_smoke.json``; it says nothing about checkpoints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import machine, write_result  # noqa: E402
from pretraining_gain import EVAL_VOLUMES, eval_recipe, pretrain, probe_options  # noqa: E402

PROBE = "attentive-probe"
METRIC = "balanced_accuracy"


def selection(curves: dict[int, list[float]], random: dict[int, float]) -> dict[str, Any]:
    """Choose on split 0, measure on the others. ``curves``: split -> metric per step."""
    steps_chosen_on = curves[0]
    chosen = max(range(len(steps_chosen_on)), key=lambda i: steps_chosen_on[i])  # first of equals
    held_out = [split for split in curves if split != 0]
    mean_at = [statistics.fmean(curves[split][i] for split in held_out) for i in range(len(steps_chosen_on))]
    return {"chosen_index": chosen, "test_chosen": round(mean_at[chosen], 4), "test_final": round(mean_at[-1], 4),
            "random": round(statistics.fmean(random[split] for split in held_out), 4),
            "curve": [round(value, 3) for value in mean_at]}


def measure(run_dir: Path, seed: int, task: str, splits: int, n_volumes: int, options: dict[str, Any],
            work: Path, registry: Any) -> dict[str, Any]:
    from octfw.evaluation.checkpoints import compare_checkpoints
    from octfw.evaluation.target import load_eval_recipe

    key = f"{PROBE}/{METRIC}"
    curves, random, steps = {}, {}, None
    for split in range(splits):
        path = eval_recipe(work, task, split, seed, [PROBE], n_volumes, options)
        report = compare_checkpoints(run_dir, load_eval_recipe(path, [], registry), registry, "all")
        if steps is not None and report.steps != steps:
            raise SystemExit(f"{run_dir}: its checkpoints changed between splits ({steps} -> {report.steps})")
        steps = report.steps
        curves[split] = [scores[key] for scores in report.pretrained]
        random[split] = report.random_init[key]
        print(f"{task} seed {seed} split {split}: " + " ".join(f"{v:.3f}" for v in curves[split]), flush=True)
    chosen = selection(curves, random)
    return {"steps": steps, "chosen": steps[chosen.pop("chosen_index")], **chosen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", help="run folders, one per pretraining seed (0, 1, ...)")
    parser.add_argument("--tasks", nargs="+", default=["thinning", "lesion"], choices=sorted(EVAL_VOLUMES))
    parser.add_argument("--splits", type=int, default=5, help="split seeds 0..N-1; 0 chooses (default 5)")
    parser.add_argument("--work-dir", type=Path, help="where eval recipes (and smoke runs) go")
    parser.add_argument("--smoke", action="store_true", help="pretrain two tiny runs and check the path")
    args = parser.parse_args()
    if not args.smoke and not args.runs:
        parser.error("--runs RUN_DIR [RUN_DIR ...] is needed (or --smoke)")

    from octfw.registry import load_registry

    started = time.perf_counter()
    registry = load_registry()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="octfw-checkpoint-selection-"))
    work.mkdir(parents=True, exist_ok=True)
    options = probe_options(registry, [PROBE], args.smoke)
    splits = 2 if args.smoke else args.splits
    n_volumes = {task: n // 5 for task, n in EVAL_VOLUMES.items()} if args.smoke else dict(EVAL_VOLUMES)
    runs = args.runs or []
    if args.smoke:
        sets = ["engine.checkpoint_every_steps=3", "checkpointer.keep_last=10"]
        runs = [Path(pretrain(work / f"seed{seed}", seed, 6, 24, sets)["run_dir"]) for seed in (0, 1)]

    results = {f"{task}_seed{seed}": measure(run, seed, task, splits, n_volumes[task], options, work, registry)
               for task in args.tasks for seed, run in enumerate(runs)}
    for name, result in results.items():
        print(f"{name}: chosen step {result['chosen']}, held-out {result['test_chosen']:.3f} "
              f"(last step {result['test_final']:.3f}, random init {result['random']:.3f})")
    path = write_result("checkpoint_selection_smoke" if args.smoke else "checkpoint_selection", {
        "what": f"octfw eval RUN --checkpoints all, {PROBE} {METRIC}, per task and pretraining seed, split "
                f"seeds 0-{splits - 1}; the step is chosen on split 0 and measured on the others",
        "machine": machine(),
        "runs": [str(run) for run in runs],
        "results": results,
        "seconds": round(time.perf_counter() - started, 1),
    })
    print(f"wrote {path} ({json.dumps(round(time.perf_counter() - started))} s)")


if __name__ == "__main__":
    main()
