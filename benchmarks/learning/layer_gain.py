"""Does pretraining pay in labels on retinal layer segmentation, and across vendors? (issue #51)

The encoders are those ``benchmarks/learning/family_gain.py pretrain --settings in-domain``
exports: V-JEPA, its 2.1 dense variant and MAE, each pretrained on 240 unlabelled volumes of
every vendor of the ``held-out`` phantom family (cohort seed 0), a seed per run. Each is judged
against a randomly initialised encoder of the same architecture and seed (``octfw eval``'s
baseline) by the ``layer-segmentation`` evaluator (the encoder frozen, or with ``--blocks all`` fine-tuned
with the decoder; ``--decoder``: UNETR-style, the default, or linear from the final tokens alone) on the
family's labelled cohort (cohort seed 1: no volume shared with pretraining), split by patient,
``--splits`` times:

- ``all vendors``: labelled volumes drawn from every vendor's training patients, tested on the
  others: mean Dice at 1, 2, 5, 10 and 20 labelled volumes (``--draws`` seeded draws each, the
  same volumes for both encoders). **Labels saved**: how many labelled volumes the random encoder
  needs to reach the pretrained encoder's mean Dice at 5, interpolated in log volumes between the
  counts measured; the target is at least 2x (10 volumes).
- ``one vendor``: labels from one vendor only (``train_domains``; the vendor turns with the split,
  so each is the labelled one in some splits), tested on that vendor's held-out patients
  (in-vendor) and on every other vendor (cross-vendor). **Vendor drop**: in-vendor minus
  cross-vendor mean Dice; the target is the pretrained encoder's drop at most half the random
  encoder's (at ``--vendor-shots`` labelled volumes, 5 by default).

Nothing is tuned on the test splits: the decoder's network is chosen on each split's validation
patients, and every evaluator option but `--decoder` (and `--min-steps` and `--blocks`, where given) is its
default.

    OMP_NUM_THREADS=1 PJRT_DEVICE=CPU python benchmarks/learning/family_gain.py pretrain --out /tmp/lg \\
        --methods vjepa3d vjepa3d-dense mae3d --settings in-domain --seeds 0 1 --updates 4000 --jobs 2
    OMP_NUM_THREADS=1 PJRT_DEVICE=CPU python benchmarks/learning/layer_gain.py fit --out /tmp/lg [--device cuda]
        [--part I --parts N]   # N processes at once, each its share
    python benchmarks/learning/layer_gain.py report --out /tmp/lg
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import machine, write_result  # noqa: E402
from pretraining_gain import mean_std  # noqa: E402

FAMILY, VOLUMES, COHORT_SEED = "held-out", 200, 1
VENDORS = ("optopol", "bioptigen", "moptim")  # the held-out family's devices
SHOTS = (1, 2, 5, 10, 20)
ANCHOR = 5  # labelled volumes at which the pretrained encoder's Dice sets the bar
PROTOCOLS = ("all vendors", "one vendor")


def eval_recipe(folder: Path, protocol: str, split: int, seed: int, volumes: int, min_steps: int | None,
                decoder: str = "unetr", blocks: int | str = 0) -> Path:
    import tomli_w

    evaluator: dict[str, Any] = {
        "name": "layer-segmentation", "split_seed": split, "bootstrap": 0, "decoder": decoder,
        "dataset": {"name": "phantom-oct", "family": FAMILY, "n_volumes": volumes, "seed": COHORT_SEED}}
    if protocol == "one vendor":
        evaluator["train_domains"] = [VENDORS[split % len(VENDORS)]]
    if min_steps is not None:
        evaluator["min_steps"] = min_steps
    if blocks != 0:
        evaluator["blocks"] = blocks
    path = folder / f"eval_{protocol.replace(' ', '_')}_{split}_{seed}.toml"
    path.write_text(tomli_w.dumps({"run": {"seed": seed, "device": "cpu"}, "evaluator": [evaluator]}))
    return path


def fits(model: Any, evaluator: Any, split: int, shots: tuple[int, ...], draws: int,
         device: str) -> dict[int, list[dict]]:
    """Every draw's metrics at every shot count: ``{shots: [metrics, ...]}``."""
    import torch

    from octfw.evaluation.shots import label_efficiency

    with torch.no_grad():
        encoded = evaluator.encode(model, torch.device(device))
    return {count: [{k: float(v) for k, v in result.items()} for result in results]
            for count, results in label_efficiency(evaluator, encoded, list(shots), draws=draws, seed=split)}


def volumes_to_reach(curve: dict[int, float], bar: float) -> float:
    """Labelled volumes at which ``curve`` (volumes -> mean Dice) first reaches ``bar``, interpolated
    linearly in log volumes between the counts measured; ``inf`` when it never does."""
    counts = sorted(curve)
    if curve[counts[0]] >= bar:
        return float(counts[0])
    for low, high in zip(counts, counts[1:]):
        if curve[high] >= bar:
            share = (bar - curve[low]) / (curve[high] - curve[low])
            return math.exp(math.log(low) + share * (math.log(high) - math.log(low)))
    return math.inf


def summarise(records: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Per method: the label-efficiency curves (mean over seeds x splits x draws), labels saved and
    the vendor drop, for the pretrained and the random encoder."""
    def values_of(method: str, protocol: str, encoder: str, count: int, key: str) -> list[float]:
        return [m[key] for r in records if r["method"] == method and r["protocol"] == protocol
                for m in r[encoder].get(str(count), []) if key in m]

    summary: dict[str, Any] = {}
    for method in methods:
        summary[method] = entry = {}
        curves = {encoder: {count: mean_std(values) for count in SHOTS
                            if (values := values_of(method, "all vendors", encoder, count, "mean_dice"))}
                  for encoder in ("pretrained", "random_init")}
        entry["boundary_error_um"] = {
            encoder: {count: mean_std(values) for count in SHOTS
                      if (values := values_of(method, "all vendors", encoder, count, "boundary_error_um"))}
            for encoder in ("pretrained", "random_init")}
        curves["gap"] = {count: mean_std([p["mean_dice"] - q["mean_dice"] for r in records
                                          if r["method"] == method and r["protocol"] == "all vendors"
                                          for p, q in zip(r["pretrained"][str(count)], r["random_init"][str(count)])])
                         for count in curves["pretrained"]}
        if ANCHOR in curves["pretrained"]:
            bar = curves["pretrained"][ANCHOR]["mean"]
            needed = volumes_to_reach({c: s["mean"] for c, s in curves["random_init"].items()}, bar)
            entry.update(curves=curves, pretrained_at_anchor=bar, random_volumes_to_reach=needed,
                         labels_saved=needed / ANCHOR)
        drops: dict[str, dict[int, Any]] = {"pretrained": {}, "random_init": {}}
        for encoder in drops:
            for count in SHOTS:
                inside = values_of(method, "one vendor", encoder, count, "in_vendor_mean_dice")
                across = values_of(method, "one vendor", encoder, count, "cross_vendor_mean_dice")
                if inside:
                    drops[encoder][count] = {"in_vendor": mean_std(inside), "cross_vendor": mean_std(across),
                                             "drop": mean_std([a - b for a, b in zip(inside, across)])}
        if drops["pretrained"]:
            entry["vendor"] = drops
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    lines = []
    for method, s in summary.items():
        if "curves" in s:
            lines.append(f"\n{method}: mean Dice by labelled volumes (all vendors), pretrained / random init")
            for count in s["curves"]["pretrained"]:
                p, r = s["curves"]["pretrained"][count], s["curves"]["random_init"][count]
                g = s["curves"]["gap"][count]
                lines.append(f"  {count:>3}: {p['mean']:.3f} ± {p['std']:.3f}   {r['mean']:.3f} ± {r['std']:.3f}   "
                             f"gap {g['mean']:+.3f} ± {g['std']:.3f}")
            errors = s["boundary_error_um"]
            lines.append("  boundary error (µm), pretrained / random init: " + ", ".join(
                f"{count}: {errors['pretrained'][count]['mean']:.1f} / {errors['random_init'][count]['mean']:.1f}"
                for count in errors["pretrained"]))
            lines.append(f"  labels saved: random needs {s['random_volumes_to_reach']:.1f} volumes for the "
                         f"pretrained encoder's {s['pretrained_at_anchor']:.3f} at {ANCHOR}: "
                         f"{s['labels_saved']:.2f}x (target 2x)")
        if "vendor" in s:
            lines.append(f"\n{method}: one vendor labelled: in-vendor / cross-vendor / drop, pretrained | random init")
            for count in s["vendor"]["pretrained"]:
                p, r = s["vendor"]["pretrained"][count], s["vendor"]["random_init"][count]
                ratio = p["drop"]["mean"] / r["drop"]["mean"] if r["drop"]["mean"] else math.nan
                lines.append(f"  {count:>3}: {p['in_vendor']['mean']:.3f} / {p['cross_vendor']['mean']:.3f} / "
                             f"{p['drop']['mean']:+.3f} | {r['in_vendor']['mean']:.3f} / "
                             f"{r['cross_vendor']['mean']:.3f} / {r['drop']['mean']:+.3f}   drop ratio {ratio:.2f}")
    return "\n".join(lines)


def items(seeds: list[int], protocols: list[str], splits: range) -> list[tuple[str, int, int]]:
    """(protocol, seed, split) in the order worth having first if a run is cut short: every
    protocol and seed at the first split, then at the next, and so on."""
    return [(protocol, seed, split) for split in splits for seed in seeds for protocol in protocols]


def fit_part(args: argparse.Namespace) -> None:
    """This part's share of :func:`items` (every ``--parts``-th, from ``--part``): for each, the
    random encoder and every method's pretrained encoder of that seed; the records rewritten after
    each item, so a run cut short keeps what it fitted."""
    from octfw.evaluation.target import build_evaluators, load_eval_recipe, load_target
    from octfw.registry import load_registry

    started = time.perf_counter()
    registry = load_registry()
    runs = [r for r in json.loads((args.out / "pretrain.json").read_text())["runs"]
            if r["method"] in args.methods and r["setting"] == "in-domain"
            and (args.seeds is None or r["seed"] in args.seeds)]
    seeds = sorted({r["seed"] for r in runs})
    work = Path(tempfile.mkdtemp(prefix="octfw-layer-gain-"))
    targets = {r["job"]: load_target(args.out / "encoders" / f"{r['job']}.pt", r["seed"], registry) for r in runs}
    path = args.out / "layer_records" / f"part{args.part}{args.tag}.json"
    path.parent.mkdir(exist_ok=True)
    records: list[dict[str, Any]] = []
    for protocol, seed, split in items(seeds, args.protocols, range(args.first_split, args.splits))[args.part::args.parts]:
        recipe = load_eval_recipe(eval_recipe(work, protocol, split, seed, args.volumes, args.min_steps,
                                              args.decoder, args.blocks), [], registry)
        shots = SHOTS if protocol == "all vendors" else tuple(args.vendor_shots)
        seeded = [r for r in runs if r["seed"] == seed]
        # One evaluator for the seed's encoders (one architecture), and one random encoder's fits:
        # it depends on the seed only.
        first = targets[seeded[0]["job"]]
        ((_, evaluator),) = build_evaluators(first, recipe, registry)
        random_fits = fits(first.random_init, evaluator, split, shots, args.draws, args.device)
        for run in seeded:
            records.append({"method": run["method"], "seed": seed, "protocol": protocol, "split": split,
                            "pretrained": {str(k): v for k, v in fits(targets[run["job"]].pretrained, evaluator,
                                                                      split, shots, args.draws, args.device).items()},
                            "random_init": {str(k): v for k, v in random_fits.items()}})
        path.write_text(json.dumps({"machine": machine(), "device": args.device, "records": records}))
        print(f"part {args.part}: {protocol} seed {seed} split {split} ({time.perf_counter() - started:.0f} s)",
              flush=True)


#: What a record keeps in the results file: the overall figures and each vendor's mean Dice (the
#: per-boundary errors, per-vendor layers and intervals stay in the parts' files).
KEPT = ("mean_dice", "boundary_error_um", "dice_", "val_mean_dice", "selected_step", "steps", "labelled_volumes")


def compact(metrics: dict[str, float]) -> dict[str, float]:
    kept = {}
    for key, value in metrics.items():
        base = key.removeprefix("in_vendor_").removeprefix("cross_vendor_")
        overall = "/" not in key and (base.startswith(KEPT) and not base.startswith("boundary_error_um_"))
        if overall or base.startswith("mean_dice/"):
            kept[key] = round(value, 4)
    return kept


def report(args: argparse.Namespace) -> None:
    import attrs

    from octfw.plugins.evaluators.layer_segmentation import LayerSegmentationConfig

    min_steps = attrs.fields(LayerSegmentationConfig).min_steps.default if args.min_steps is None else args.min_steps
    parts = [json.loads(p.read_text()) for p in sorted((args.out / "layer_records").glob("part*.json"))]
    records = [r for part in parts for r in part["records"]]
    pretrained = json.loads((args.out / "pretrain.json").read_text())
    methods = [m for m in args.methods if any(r["method"] == m for r in records)]
    summary = summarise(records, methods)
    print(format_summary(summary))
    done = sorted({(r["protocol"], r["seed"], r["split"]) for r in records})
    path = write_result("layer_gain" + (f"_{args.name}" if args.name else ""), {
        "machine_fitted": parts[0]["machine"] if parts else None, "device": parts[0]["device"] if parts else None,
        "pretraining": {k: v for k, v in pretrained.items() if k != "runs"}, "runs": pretrained["runs"],
        "eval": {"family": FAMILY, "volumes": args.volumes, "cohort_seed": COHORT_SEED, "draws": args.draws,
                 "shots": SHOTS, "vendor_shots": args.vendor_shots, "min_steps": min_steps,
                 "decoder": args.decoder, "blocks": args.blocks, "vendors": VENDORS, "fitted": done},
        "summary": summary,
        "records": [{**r, **{encoder: {count: [compact(m) for m in draws] for count, draws in r[encoder].items()}
                             for encoder in ("pretrained", "random_init")}} for r in records]})
    print(f"{len(done)} (protocol, seed, split) fitted; wrote {path}")


def blocks_option(value: str) -> int | str:
    return value if value == "all" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["fit", "report"])
    parser.add_argument("--out", type=Path, required=True, help="family_gain.py pretrain's --out")
    parser.add_argument("--methods", nargs="+", default=["vjepa3d", "vjepa3d-dense", "mae3d"])
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--first-split", type=int, default=0, help="fit: splits from this one to --splits - 1 "
                        "(the rest of a run cut short)")
    parser.add_argument("--tag", default="", help="fit: suffix of this run's part files, beside earlier ones")
    parser.add_argument("--draws", type=int, default=1, help="seeded draws of the labelled volumes per count")
    parser.add_argument("--volumes", type=int, default=VOLUMES, help="labelled cohort size")
    parser.add_argument("--min-steps", type=int, help="the decoder's least update steps (default: the evaluator's)")
    parser.add_argument("--seeds", type=int, nargs="+", help="fit: only these pretraining seeds (default: all)")
    parser.add_argument("--vendor-shots", type=int, nargs="+", default=[ANCHOR],
                        help="fit: labelled volumes of the one-vendor protocol (default: %(default)s)")
    parser.add_argument("--decoder", default="unetr", choices=["unetr", "linear"],
                        help="the evaluator's decoder (linear: the final tokens alone, no skip from the volume)")
    parser.add_argument("--blocks", type=blocks_option, default=0,
                        help="what of the encoder trains with the decoder: 0 (frozen, the evaluator's default), "
                        "the last k blocks or 'all'")
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--part", type=int, default=0, help="fit: this process's part, 0 to --parts - 1")
    parser.add_argument("--parts", type=int, default=1, help="fit: processes sharing the items")
    parser.add_argument("--name", default="", help="report: result file suffix")
    args = parser.parse_args()
    fit_part(args) if args.phase == "fit" else report(args)


if __name__ == "__main__":
    main()
