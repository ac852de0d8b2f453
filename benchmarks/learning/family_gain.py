"""Does pretraining help on data nobody tuned for? V-JEPA and MAE, judged on the held-out phantom family.

Every recipe choice of octfw was made on ``synthetic-oct`` (the cohort the
recipes pretrain on) or on the ``phantom-oct`` tuning family; this measures
on the ``held-out`` family, whose renderer shares nothing with either but the
DICOM writer, and whose task was sized (``benchmarks/learning/phantom_tasks.py``)
before any pretrained encoder was probed on it.

Two phases, so that pretraining can run where it is fast (a GPU) and probing
where the results are read:

``pretrain``: for each method (``recipes/pretrain_cpu.toml``, V-JEPA, and
``recipes/mae_cpu.toml``, MAE; the variants ``vjepa3d-dense``,
``recipes/pretrain_dense_cpu.toml``, and ``mae3d-pix``, ``recipes/mae_pix_cpu.toml``,
with ``--methods``), each setting and each seed, train the recipe
for the same number of update steps and export its encoder
(``octfw export``) to ``OUT/encoders/<method>_<setting>_seed<N>.pt``:

- ``in-domain``: pretrain on 240 unlabelled volumes of the held-out family
  (cohort seed 0; its labels exist but are never read), as a user pretrains
  on their own cohort;
- ``transfer``: pretrain on 240 volumes of the tuning family.

``--jobs`` runs happen at once (a GPU has room for many tiny models). With
``--updates auto`` a short run of every job at once measures the rate and
the runs get the updates that fit ``--budget-minutes``, capped at
``--max-updates`` (24,000: what 2 CPU cores pretrain in about 40 minutes).

``probe``: each exported encoder against a randomly initialised encoder of
the same architecture and seed (``octfw eval``'s baseline: for a seed the same
network for both methods, so it is probed once), on the held-out family's
labelled task (200 volumes, 100 patients, cohort seed 1: no volume shared
with pretraining), ``--splits`` patient-level splits (half the patients
train): ``linear-probe``, ``knn`` (k = 10), ``attentive-probe`` and
``fine-tune`` on 10 labelled volumes per class (the field's few-label
protocol; drawn from the train split, the same volumes for both encoders).
Prints balanced accuracy and AUROC per method, setting and probe (mean ±
std over seeds x splits: pretrained, random init, paired gap) and writes one
JSON per method, ``benchmarks/results/family_gain_<recipe>-<id>.json``,
named after the recipe it measured (:func:`pretraining_gain.measured_recipe_id`).

    python benchmarks/learning/family_gain.py pretrain --out /tmp/fg --updates auto --jobs 8 --device cuda
    PJRT_DEVICE=CPU python benchmarks/learning/family_gain.py probe --out /tmp/fg
    PJRT_DEVICE=CPU python benchmarks/learning/family_gain.py smoke     # the whole path, small, in minutes
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, machine, write_result  # noqa: E402
from pretraining_gain import mean_std, measured_recipe_id  # noqa: E402

METHODS = {"vjepa3d": ROOT / "recipes" / "pretrain_cpu.toml", "mae3d": ROOT / "recipes" / "mae_cpu.toml",
           "vjepa3d-dense": ROOT / "recipes" / "pretrain_dense_cpu.toml",
           "mae3d-pix": ROOT / "recipes" / "mae_pix_cpu.toml"}
#: Pretraining cohort of each setting: 240 volumes (120 patients), cohort seed 0. ``context``:
#: in-domain for the context family's task (issue #39's task that needs learned features).
SETTINGS = {"in-domain": "held-out", "transfer": "tuning", "context": "context"}
PRETRAIN_VOLUMES = 240
#: The held-out family's labelled cohort: 100 patients, two volumes each; half the patients test.
EVAL_FAMILY, EVAL_VOLUMES, EVAL_SEED = "held-out", 200, 1
PROBES = ("linear-probe", "knn", "attentive-probe", "fine-tune", "dense-probe")
FINE_TUNE_SHOTS = 10
METRICS = ("balanced_accuracy", "auroc", "tokens_balanced_accuracy", "tokens_auroc", "voxel_dice", "token_dice",
           "fine_tune_voxel_dice", "fine_tune_token_dice")
GLOBAL_BATCH = 4  # both recipes: per_device_batch 4 x 1 device x 1 micro-step
MAX_UPDATES = 24_000


def job_name(method: str, setting: str, seed: int) -> str:
    return f"{method}_{setting}_seed{seed}"


def pretrain_overrides(setting: str, seed: int, updates: int, out: Path, device: str,
                       volumes: int = PRETRAIN_VOLUMES) -> list[str]:
    dataset = {"name": "phantom-oct", "family": SETTINGS[setting], "n_volumes": volumes, "labels": True,
               "seed": 0}
    return [f"run.seed={seed}", f"run.max_steps={updates}", "run.epochs=100000", f"run.device={json.dumps(device)}",
            f"run.output_dir={json.dumps(str(out))}", "run.export_encoder=false",
            "engine.precision=\"fp32\"", "engine.num_workers=0",
            f"dataset={_inline(dataset)}", 'logger=[{name="jsonl"}]', "evaluator=[]"]


def _inline(table: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def pretrain_one(method: str, setting: str, seed: int, updates: int, out: Path, device: str,
                 volumes: int = PRETRAIN_VOLUMES) -> dict[str, Any]:
    """Train one job, export its encoder; the run's summary and health at the end."""
    from octfw.cli.main import main

    name = job_name(method, setting, seed)
    runs = out / "runs" / name
    sets = pretrain_overrides(setting, seed, updates, runs, device, volumes)
    code = main(["run", str(METHODS[method]), *[arg for value in sets for arg in ("--set", value)]])
    if code != 0:
        raise SystemExit(f"{name}: pretraining failed with exit code {code}")
    (run_dir,) = (runs / METHODS[method].stem).iterdir()
    (out / "encoders").mkdir(parents=True, exist_ok=True)
    code = main(["export", str(run_dir), "--out", str(out / "encoders" / f"{name}.pt")])
    if code != 0:
        raise SystemExit(f"{name}: export failed with exit code {code}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    health = [row for row in rows if "metric/effective_rank" in row]
    record = {"job": name, "method": method, "setting": setting, "seed": seed,
              "update_steps": summary["update_steps"], "elapsed_s": round(summary["elapsed_s"], 1),
              "samples_per_s": summary["samples_per_s"], "first_loss": summary["first_loss"],
              "last_loss": summary["last_loss"],
              "effective_rank": [(r["step"], round(r["metric/effective_rank"], 3)) for r in health][::10] +
                                ([(health[-1]["step"], round(health[-1]["metric/effective_rank"], 3))] if health else [])}
    (out / "records").mkdir(parents=True, exist_ok=True)
    (out / "records" / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def run_jobs(jobs: list[tuple[str, str, int]], updates: int, out: Path, device: str, parallel: int,
             volumes: int = PRETRAIN_VOLUMES) -> list[dict[str, Any]]:
    """Every job as its own process, ``parallel`` at a time; their records."""
    pending, running, failed = list(jobs), [], []
    while pending or running:
        while pending and len(running) < parallel:
            method, setting, seed = pending.pop(0)
            log = (out / "logs").joinpath(f"{job_name(method, setting, seed)}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, __file__, "pretrain-one", "--out", str(out), "--method", method,
                       "--setting", setting, "--seed", str(seed), "--updates", str(updates),
                       "--device", device, "--volumes", str(volumes)]
            running.append((job_name(method, setting, seed), subprocess.Popen(
                command, stdout=log.open("w"), stderr=subprocess.STDOUT)))
        time.sleep(1)
        for job in list(running):
            if job[1].poll() is not None:
                running.remove(job)
                if job[1].returncode != 0:
                    failed.append(job[0])
                print(f"{job[0]}: exit {job[1].returncode}", flush=True)
    if failed:
        raise SystemExit(f"pretraining failed: {', '.join(failed)} (logs in {out / 'logs'})")
    return [json.loads((out / "records" / f"{job_name(*job)}.json").read_text()) for job in jobs]


def write_cohorts(out: Path, volumes: int, settings: Any = SETTINGS) -> None:
    """Write each setting's pretraining cohort once, before the jobs that read it start together."""
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    registry = load_registry()
    for setting in settings:
        overrides = pretrain_overrides(setting, 0, 1, out / "cohorts", "cpu", volumes)
        recipe = load_recipe(METHODS["vjepa3d"], overrides, registry)
        dataset = recipe.dataset.build(recipe.build_context(registry=registry))
        print(f"cohort {setting}: {len(dataset)} volumes", flush=True)


def pretrain(args: argparse.Namespace) -> None:
    if (args.out / "runs").exists():
        # A job finds its run as the one folder under its own: an older run there would be taken.
        raise SystemExit(f"--out {args.out}: holds runs of an earlier pretrain; give a new folder")
    jobs = [(method, setting, seed) for method in args.methods for setting in args.settings for seed in args.seeds]
    write_cohorts(args.out, args.volumes, args.settings)
    updates = args.updates
    calibration = None
    if updates == "auto":
        # Every job at once for a short run: the rate they share decides the budget's updates.
        probe_out = args.out / "calibration"
        records = run_jobs(jobs, args.calibration_updates, probe_out, args.device, args.jobs)
        slowest = min(r["samples_per_s"] for r in records) / GLOBAL_BATCH
        updates = min(args.max_updates, math.floor(args.budget_minutes * 60 * slowest))
        calibration = {"updates": args.calibration_updates, "slowest_updates_per_s": round(slowest, 2),
                       "chosen_updates": updates}
        print(f"calibration: slowest job {slowest:.1f} updates/s -> {updates} updates", flush=True)
    started = time.perf_counter()
    records = run_jobs(jobs, int(updates), args.out, args.device, args.jobs)
    (args.out / "pretrain.json").write_text(json.dumps({
        "machine": machine(), "device": args.device, "updates": int(updates), "calibration": calibration,
        "seconds": round(time.perf_counter() - started, 1), "runs": records}, indent=1))
    print(json.dumps(records, indent=1))


# --------------------------------------------------------------------------
# probing


def eval_recipe(folder: Path, split_seed: int, seed: int, volumes: int, fine_tune: dict[str, Any],
                probes: list[str], family: str = EVAL_FAMILY, cohort_seed: int = EVAL_SEED) -> Path:
    import tomli_w

    dataset = {"name": "phantom-oct", "family": family, "n_volumes": volumes, "labels": True,
               "seed": cohort_seed}
    options = {"knn": {"k": 10}, "fine-tune": fine_tune}
    evaluators = [{"name": name, "dataset": dataset, "split_seed": split_seed, "bootstrap": 0,
                   **options.get(name, {})} for name in probes]
    path = folder / f"eval_{split_seed}_{seed}.toml"
    path.write_text(tomli_w.dumps({"run": {"seed": seed, "device": "cpu"}, "evaluator": evaluators}))
    return path


def score_encoder(model: Any, evaluators: list[tuple[str, Any]], split_seed: int, shots: int) -> dict[str, float]:
    """``{"<probe>/<metric>": value}``: the frozen probes, and fine-tuning on ``shots`` volumes per class."""
    import torch

    from octfw.evaluation.shots import label_efficiency

    scores: dict[str, float] = {}
    with torch.no_grad():
        for name, evaluator in evaluators:
            encoded = evaluator.encode(model, torch.device("cpu"))
            if name == "fine-tune":
                ((_, (result,)),) = label_efficiency(evaluator, encoded, [shots], draws=1,
                                                     seed=split_seed)
            else:
                result = evaluator.score(encoded)
            scores.update({f"{name}/{key}": float(value) for key, value in result.items()})
    return scores


def probe(args: argparse.Namespace) -> None:
    from octfw.evaluation.target import build_evaluators, load_eval_recipe, load_target
    from octfw.registry import load_registry

    started = time.perf_counter()
    registry = load_registry()
    pretrained = json.loads((args.out / "pretrain.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="octfw-family-gain-"))
    fine_tune = {"epochs": 2} if args.smoke else {}
    shots = args.fine_tune_shots
    records, random_scores = [], {}
    for run in pretrained["runs"]:
        if run["method"] not in args.methods:
            continue
        target = load_target(args.out / "encoders" / f"{run['job']}.pt", run["seed"], registry)
        for split_seed in range(args.splits):
            recipe = load_eval_recipe(eval_recipe(work, split_seed, run["seed"], args.eval_volumes, fine_tune,
                                                  args.probes, args.eval_family), [], registry)
            evaluators = build_evaluators(target, recipe, registry)
            key = (run["seed"], split_seed)  # the random encoder depends on the seed only
            if key not in random_scores:
                random_scores[key] = score_encoder(target.random_init, evaluators, split_seed, shots)
            records.append({"method": run["method"], "setting": run["setting"], "seed": run["seed"],
                            "split_seed": split_seed, "pretrained": score_encoder(target.pretrained, evaluators,
                                                                                  split_seed, shots),
                            "random_init": random_scores[key]})
            print(f"probed {run['job']} split {split_seed} ({time.perf_counter() - started:.0f} s)", flush=True)
    for method in args.methods:
        rows = summarise([r for r in records if r["method"] == method])
        print(f"\n{method}\n{format_table(rows)}")
        recipe_text = METHODS[method].read_text(encoding="utf-8")
        recipe_id = measured_recipe_id(recipe_text, [])
        name = f"family_gain_{METHODS[method].stem}-{recipe_id}" + (f"_{args.name}" if args.name else "") + \
            ("_smoke" if args.smoke else "")
        path = write_result(name, {
            "machine_probed": machine(), "pretraining": {k: v for k, v in pretrained.items() if k != "runs"},
            "runs": [r for r in pretrained["runs"] if r["method"] == method],
            "recipe": str(METHODS[method].relative_to(ROOT)), "recipe_id": recipe_id, "recipe_text": recipe_text,
            "eval": {"family": args.eval_family, "volumes": args.eval_volumes, "cohort_seed": EVAL_SEED,
                     "splits": args.splits, "fine_tune_shots": shots, "fine_tune_options": fine_tune},
            "table": rows, "records": [r for r in records if r["method"] == method],
            "seconds": round(time.perf_counter() - started, 1)})
        print(f"wrote {path.relative_to(ROOT)}")


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (setting, probe, metric): pretrained, random and paired gap over seeds x splits."""
    rows = []
    for setting in SETTINGS:
        for name in PROBES:
            for metric in METRICS:
                key = f"{name}/{metric}"
                pairs = [(r["pretrained"][key], r["random_init"][key]) for r in records
                         if r["setting"] == setting and key in r["pretrained"] and key in r["random_init"]]
                if pairs:
                    rows.append({"setting": setting, "probe": name, "metric": metric,
                                 "pretrained": mean_std([p for p, _ in pairs]),
                                 "random_init": mean_std([q for _, q in pairs]),
                                 "gap": mean_std([p - q for p, q in pairs])})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(stat: dict[str, float], signed: bool = False) -> str:
        return f"{stat['mean']:{'+' if signed else ''}.3f} ± {stat['std']:.3f}"

    header = f"{'setting':<10} {'probe':<16} {'metric':<18} {'pretrained':>15} {'random init':>15} {'gap':>16}"
    lines = [header, "-" * len(header)]
    lines += [f"{r['setting']:<10} {r['probe']:<16} {r['metric']:<18} {cell(r['pretrained']):>15} "
              f"{cell(r['random_init']):>15} {cell(r['gap'], True):>16}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="phase", required=True)
    for phase in ("pretrain", "probe", "smoke", "pretrain-one"):
        p = sub.add_parser(phase)
        p.add_argument("--out", type=Path, default=None)
        p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
        p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
        p.add_argument("--device", default="cpu")
        p.add_argument("--volumes", type=int, default=PRETRAIN_VOLUMES, help="pretraining cohort size")
    sub.choices["pretrain"].add_argument("--updates", default="auto", help="update steps per run, or auto")
    sub.choices["pretrain"].add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    sub.choices["pretrain"].add_argument("--budget-minutes", type=float, default=5.0)
    sub.choices["pretrain"].add_argument("--max-updates", type=int, default=MAX_UPDATES)
    sub.choices["pretrain"].add_argument("--calibration-updates", type=int, default=300)
    sub.choices["pretrain"].add_argument("--jobs", type=int, default=1, help="runs at once")
    sub.choices["probe"].add_argument("--splits", type=int, default=5)
    sub.choices["probe"].add_argument("--eval-family", default=EVAL_FAMILY, choices=["held-out", "context"],
                                      help="the labelled family probed (context: the task that needs learned features)")
    sub.choices["probe"].add_argument("--eval-volumes", type=int, default=EVAL_VOLUMES)
    sub.choices["probe"].add_argument("--fine-tune-shots", type=int, default=FINE_TUNE_SHOTS)
    sub.choices["probe"].add_argument("--probes", nargs="+", default=list(PROBES), choices=PROBES)
    sub.choices["probe"].add_argument("--name", default="", help="result file suffix (a partial run)")
    sub.choices["pretrain-one"].add_argument("--method", required=True, choices=list(METHODS))
    sub.choices["pretrain-one"].add_argument("--setting", required=True, choices=list(SETTINGS))
    sub.choices["pretrain-one"].add_argument("--seed", type=int, required=True)
    sub.choices["pretrain-one"].add_argument("--updates", type=int, required=True)
    args = parser.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="octfw-family-gain-"))
    args.smoke = args.phase == "smoke"
    if args.phase == "pretrain-one":
        pretrain_one(args.method, args.setting, args.seed, args.updates, args.out, args.device, args.volumes)
    elif args.phase == "pretrain":
        if args.updates != "auto":
            args.updates = int(args.updates)
        pretrain(args)
    elif args.phase == "probe":
        probe(args)
    else:  # smoke: a few updates on small cohorts, two splits, a short fine-tune
        args.seeds, args.updates, args.jobs, args.volumes = [0], 6, 2, 12
        pretrain(args)
        args.splits, args.eval_volumes, args.fine_tune_shots, args.probes, args.name = 2, 40, 3, list(PROBES), ""
        probe(args)


if __name__ == "__main__":
    main()
