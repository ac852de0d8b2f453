"""Does pretraining help? Pretrained against random encoders, per synthetic task and probe.

For each pretraining seed, ``recipes/pretrain_cpu.toml`` (the quickstart's
tiny model on a 240-volume cohort holding every finding; labels unused) is
trained for the same number of update steps, then its checkpoint is probed
with ``octfw eval``'s own code (:func:`octfw.evaluation.target.load_target`,
:func:`~octfw.evaluation.target.evaluate_target`) on every synthetic task,
next to a randomly initialised encoder of the same architecture built with
the run's seed: the very network the run started from. Every split seed is
a fresh train/test split of the held-out cohort (seed 1, no volume shared
with pretraining); gaps are paired (same run seed, same split).

- tasks: ``lesion``, ``fluid``, ``thinning`` (120 volumes) and the
  four-class ``finding`` (240 volumes), sized in docs/evaluation.md before
  any pretrained encoder was probed on them;
- probes: ``linear-probe``, ``knn`` (k = 10) and ``attentive-probe`` when
  ``octfw list`` shows it;
- budget: ``--updates N``, or ``--budget-minutes M`` turned into updates by
  timing a short calibration run first (both seeds get the same number, and
  the learning-rate and EMA schedules span it).

Prints a table (mean ± std over seeds x splits of balanced accuracy and
AUROC: pretrained, random, gap, and the room above random: 1 minus its
mean, the largest gap any encoder could show) and writes
``benchmarks/results/pretraining_gain_pretrain_cpu-ID[_NAME].json``: ``ID``
names the recipe measured (the first 8 hex digits of the SHA-256 of its
TOML data and the ``--set`` overrides, comments ignored), so a result is
never overwritten by a run of another version of the recipe, and the JSON
keeps ``recipe_id`` and the recipe's text (``--smoke``: ``_smoke`` added). The full run wants the machine to itself
(two runs of ``--budget-minutes`` each, then roughly 10-20 minutes of probes
on 2 CPUs); ``--smoke`` checks the whole path (about 3 minutes on a 2-CPU
machine shared with other work, less alone) and says nothing about
pretraining: 8-20 updates on 24 volumes.

    PJRT_DEVICE=CPU python benchmarks/learning/pretraining_gain.py --budget-minutes 10
    PJRT_DEVICE=CPU python benchmarks/learning/pretraining_gain.py --smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, machine, write_result  # noqa: E402

RECIPE = ROOT / "recipes" / "pretrain_cpu.toml"
TASKS = ("lesion", "fluid", "thinning", "finding")
#: Held-out cohort sizes: the four-class task needs twice the volumes for the
#: same train volumes per class (docs/evaluation.md, the synthetic tasks).
EVAL_VOLUMES = {"lesion": 120, "fluid": 120, "thinning": 120, "finding": 240}
PROBES = ("linear-probe", "knn", "attentive-probe")
METRICS = ("balanced_accuracy", "auroc")
GLOBAL_BATCH = 4  # recipes/pretrain_cpu.toml: per_device_batch 4 x 1 device x 1 micro-step


def pretrain(out: Path, seed: int, updates: int, n_volumes: int | None, overrides: list[str] = ()) -> dict[str, Any]:
    """Train ``recipes/pretrain_cpu.toml`` for ``updates`` update steps; its summary and run folder."""
    from octfw.cli.main import main

    # run.max_steps caps run.epochs: epochs high enough that the budget, not the
    # recipe's 10 epochs, decides the length (and the LR and EMA schedules span it).
    sets = [f"run.seed={seed}", f"run.max_steps={updates}", "run.epochs=100000",
            f"run.output_dir={json.dumps(str(out))}",
            'logger=[{name="jsonl"}]', "evaluator=[]"]  # probed below, on every task
    if n_volumes is not None:
        sets.append(f"dataset.n_volumes={n_volumes}")
    sets += overrides  # a variant of the recipe (--set), measured the same way
    code = main(["run", str(RECIPE), *[arg for value in sets for arg in ("--set", value)]])
    if code != 0:
        raise SystemExit(f"pretraining seed {seed} failed with exit code {code}")
    (run_dir,) = (out / "pretrain_cpu").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [row for row in rows if "metric/effective_rank" in row][-1]
    return {"run_dir": str(run_dir), "seed": seed, "update_steps": summary["update_steps"],
            "elapsed_s": round(summary["elapsed_s"], 1), "samples_per_s": summary["samples_per_s"],
            "first_loss": summary["first_loss"], "last_loss": summary["last_loss"],
            "last_target_std": last["metric/target_std"], "last_effective_rank": last["metric/effective_rank"]}


def calibrate(out: Path, budget_minutes: float, steps: int, n_volumes: int | None) -> dict[str, Any]:
    """Updates that fit in ``budget_minutes``, from the throughput of a ``steps``-update run."""
    run = pretrain(out, seed=0, updates=steps, n_volumes=n_volumes)
    per_second = run["samples_per_s"] / GLOBAL_BATCH
    return {"steps": steps, "updates_per_s": round(per_second, 3),
            "updates": max(1, math.floor(budget_minutes * 60 * per_second))}


def moved(target: Any) -> float | None:
    """Relative L2 distance of the exported encoder's weights (V-JEPA's target encoder, MAE's
    encoder) from the random init's."""
    pretrained = getattr(target.pretrained, "encoder", None)
    initial = getattr(target.random_init, "encoder", None)
    if pretrained is None or initial is None:
        return None
    diff = sum(float((a - b).square().sum()) for a, b in zip(pretrained.parameters(), initial.parameters()))
    norm = sum(float(b.square().sum()) for b in initial.parameters())
    return round(math.sqrt(diff / norm), 4) if norm else None


def eval_recipe(folder: Path, task: str, split_seed: int, seed: int, probes: list[str], n_volumes: int,
                probe_options: dict[str, dict[str, Any]]) -> Path:
    """An ``octfw eval`` recipe: every probe on ``task``'s held-out cohort, split by ``split_seed``."""
    import tomli_w

    dataset = {"name": "synthetic-oct", "n_volumes": n_volumes, "labels": True, "seed": 1, "task": task}
    evaluators = [{"name": name, "dataset": dataset, "split_seed": split_seed, **probe_options.get(name, {})}
                  for name in probes]
    path = folder / f"eval_{task}_{split_seed}_{seed}.toml"
    path.write_text(tomli_w.dumps({"run": {"seed": seed, "device": "cpu"}, "evaluator": evaluators}))
    return path


def probe_options(registry: Any, probes: list[str], smoke: bool) -> dict[str, dict[str, Any]]:
    """Per-probe options: k = 10 for knn; no bootstrap intervals (the spread over seeds and
    splits is what is reported); a short attentive probe in the smoke run."""
    import attrs

    options: dict[str, dict[str, Any]] = {}
    for name in probes:
        fields = attrs.fields_dict(registry.get("evaluator", name).config)
        chosen: dict[str, Any] = {}
        if name == "knn":
            chosen["k"] = 10
        if "bootstrap" in fields:
            chosen["bootstrap"] = 0
        if smoke and name == "attentive-probe":
            chosen.update({k: v for k, v in {"max_epochs": 2, "learning_rates": [1e-3],
                                             "weight_decays": [0.01]}.items() if k in fields})
        options[name] = chosen
    return options


def measure(work: Path, seed: int, updates: int, pretrain_volumes: int | None, overrides: list[str],
            tasks: list[str], splits: int, eval_volumes: dict[str, int], probes: list[str],
            options: dict[str, dict[str, Any]], registry: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Pretrain one seed (with ``overrides``) and probe it next to its random init on every task and split:
    (the run's summary, one record per task and split)."""
    from octfw.evaluation.target import evaluate_target, load_eval_recipe, load_target

    run = pretrain(work / f"seed{seed}", seed, updates, pretrain_volumes, overrides)
    target = load_target(run["run_dir"], seed, registry)
    run["target_encoder_moved"] = moved(target)
    print(f"pretrain  seed {seed}: {run['update_steps']} updates in {run['elapsed_s']} s, loss "
          f"{run['first_loss']:.3f} -> {run['last_loss']:.3f}, effective rank {run['last_effective_rank']:.2f}, "
          f"target encoder moved {run['target_encoder_moved']}", flush=True)
    records = []
    for task in tasks:
        for split_seed in range(splits):
            path = eval_recipe(work, task, split_seed, seed, probes, eval_volumes[task], options)
            report = evaluate_target(target, load_eval_recipe(path, [], registry), registry)
            records.append({"seed": seed, "task": task, "split_seed": split_seed,
                            "pretrained": report.pretrained, "random_init": report.random_init})
        print(f"probed    seed {seed}: {task}", flush=True)
    return run, records


def mean_std(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.pstdev(values), 4) if len(values) > 1 else 0.0, "n": len(values)}


def summarise(records: list[dict[str, Any]], probes: list[str], tasks: list[str]) -> list[dict[str, Any]]:
    """One row per (task, probe, metric): pretrained, random and paired gap over seeds x splits."""
    rows = []
    for task in tasks:
        for probe in probes:
            for metric in METRICS:
                key = f"{probe}/{metric}"
                pairs = [(r["pretrained"][key], r["random_init"][key]) for r in records
                         if r["task"] == task and key in r["pretrained"] and key in r["random_init"]]
                if not pairs:
                    continue
                random_init = mean_std([q for _, q in pairs])
                rows.append({"task": task, "probe": probe, "metric": metric,
                             "pretrained": mean_std([p for p, _ in pairs]),
                             "random_init": random_init,
                             "gap": mean_std([p - q for p, q in pairs]),
                             # Both metrics top out at 1: the largest mean gap a perfect encoder could show.
                             "room": round(1.0 - random_init["mean"], 4)})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(stat: dict[str, float], signed: bool = False) -> str:
        return f"{stat['mean']:+.3f} ± {stat['std']:.3f}" if signed else f"{stat['mean']:.3f} ± {stat['std']:.3f}"

    header = (f"{'task':<9} {'probe':<16} {'metric':<18} {'pretrained':>15} {'random init':>15} {'gap':>16} "
              f"{'room':>6}")
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(f"{row['task']:<9} {row['probe']:<16} {row['metric']:<18} {cell(row['pretrained']):>15} "
                     f"{cell(row['random_init']):>15} {cell(row['gap'], signed=True):>16} {row['room']:>6.3f}")
    return "\n".join(lines)


def measured_recipe_id(recipe_text: str, overrides: list[str]) -> str:
    """8 hex digits naming what was pretrained: the recipe's TOML data (not its comments) and overrides."""
    data = json.dumps(tomllib.loads(recipe_text), sort_keys=True)
    return hashlib.sha256((data + "\n" + "\n".join(overrides)).encode("utf-8")).hexdigest()[:8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-minutes", type=float, default=10.0,
                        help="wall-clock budget of each pretraining run, turned into update steps by a "
                             "calibration run (default 10)")
    parser.add_argument("--updates", type=int, help="update steps of each pretraining run (skips calibration)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="pretraining seeds (default 0 1)")
    parser.add_argument("--splits", type=int, default=5, help="split seeds 0..N-1 per task (default 5)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                        help="pretrain a variant of the recipe (repeatable); the result's name gets the "
                             "variant's recipe id and _<name>, see --name")
    parser.add_argument("--name", help="result file suffix for a variant (default: from --set)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny version (small cohorts, a few updates, 2 splits, a short attentive "
                             "probe) to check the path in a few minutes")
    args = parser.parse_args()

    from octfw.registry import load_registry

    started = time.perf_counter()
    registry = load_registry()
    probes = [name for name in PROBES if name in registry.names("evaluator")]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="octfw-pretraining-gain-"))
    work.mkdir(parents=True, exist_ok=True)
    pretrain_volumes = 24 if args.smoke else None  # None: the recipe's 240
    eval_volumes = {task: n // 5 for task, n in EVAL_VOLUMES.items()} if args.smoke else dict(EVAL_VOLUMES)
    splits = 2 if args.smoke else args.splits
    options = probe_options(registry, probes, args.smoke)
    print(f"work dir  {work}\nprobes    {', '.join(probes)}", flush=True)

    calibration = None
    updates = args.updates
    if updates is None:
        budget = 0.1 if args.smoke else args.budget_minutes
        calibration = calibrate(work / "calibration", budget, 4 if args.smoke else 30, pretrain_volumes)
        updates = min(calibration["updates"], 20) if args.smoke else calibration["updates"]
        print(f"budget    {budget} min at {calibration['updates_per_s']} updates/s: {updates} updates", flush=True)

    runs, records = [], []
    for seed in args.seeds:
        run, seed_records = measure(work, seed, updates, pretrain_volumes, args.overrides, args.tasks, splits,
                                    eval_volumes, probes, options, registry)
        runs.append(run)
        records += seed_records

    rows = summarise(records, probes, args.tasks)
    print()
    print(format_table(rows))
    recipe_text = RECIPE.read_text(encoding="utf-8")
    recipe_id = measured_recipe_id(recipe_text, args.overrides)
    name = f"pretraining_gain_{RECIPE.stem}-{recipe_id}"
    if args.name or args.overrides:
        name += "_" + (args.name or "_".join(o.replace("=", "").replace(".", "-") for o in args.overrides))
    if args.smoke:
        name += "_smoke"
    path = write_result(name, {
        "machine": machine(),
        "recipe": str(RECIPE.relative_to(ROOT)),
        "recipe_id": recipe_id,
        "recipe_text": recipe_text,
        "smoke": args.smoke,
        "updates": updates,
        "overrides": args.overrides,
        "calibration": calibration,
        "seeds": args.seeds,
        "splits": splits,
        "eval_volumes": {task: eval_volumes[task] for task in args.tasks},
        "pretrain_volumes": pretrain_volumes or 240,
        "probes": probes,
        "probe_options": options,
        "runs": runs,
        "table": rows,
        "records": records,
        "seconds": round(time.perf_counter() - started, 1),
    })
    print(f"\nwrote {path.relative_to(ROOT)} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
