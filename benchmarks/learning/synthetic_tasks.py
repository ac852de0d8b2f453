"""Sizing the synthetic tasks: each finding is visible on the voxels, not to a random encoder.

A synthetic task is only useful to judge pretraining if it has room for it:
a probe on the voxels themselves must see the finding (so the information
survives the resize to the model's input), while the features of a randomly
initialised encoder of the model's architecture must mostly miss it (so a
probe on the pretrained encoder has something to gain). This script measures
both, for each task of ``synthetic-oct`` and a grid of ``finding_scale``
values, and applies the rule written in docs/evaluation.md:

- **visible**: the voxel probe's mean balanced accuracy over the split seeds
  is at least ``VISIBLE`` (0.90);
- **not given away**: the best random encoder (highest mean over the
  encoder seeds, the linear probe and kNN) recovers at most ``GIVEN_AWAY``
  (half) of the voxel probe's margin over chance;
- **size**: the smallest scale of the grid that passes both becomes
  ``finding_scale = 1`` (the generator's constants).

No pretrained encoder is probed here: the tasks are fixed before that.

What is measured, all with octfw's own evaluation code on the quickstart's
preparation (``recipes/quickstart_eval.toml``: oct-standard at 16 x 64 x 64,
vjepa3d ``tiny``, patches 4 x 16 x 16):

- the held-out cohort of the quickstart's evaluators: 120 volumes, cohort
  seed 1, written by the ``synthetic-oct`` plugin (``task`` and
  ``finding_scale`` in its options, so every scale has its own cache folder);
- split seeds 0-9: half of each (vendor, label) group trains the probe
  (:func:`~octfw.evaluation.features.stratified_split`);
- voxel probe: :func:`~octfw.plugins.evaluators.linear_probe.algorithm.fit_linear_probe` on the
  prepared volume average-pooled 2 x 4 x 4 (8 x 16 x 16 = 2048 values, no
  other processing); for reference also the max-pooled voxels the lesion
  was sized with (depth max of the 3-voxel-smoothed volume, then 8 x 8 max
  over H x W: 64 values);
- random encoders: vjepa3d ``tiny`` built with torch seeds 0, 1, 2 as
  ``octfw eval`` builds its baseline, mean-pooled target-encoder features
  (:func:`~octfw.evaluation.features.extract_features`), then the
  ``linear-probe`` and ``knn`` (k = 10) evaluators' classifiers. For split
  seed 0 and encoder seed 0 the script also runs the evaluator components
  themselves and checks that they give the same numbers.

Writes ``benchmarks/results/synthetic_tasks.json``.

    PJRT_DEVICE=CPU python benchmarks/learning/synthetic_tasks.py [--tasks fluid thinning] [--splits 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, machine, write_result  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart_eval.toml"
VISIBLE = 0.90
GIVEN_AWAY = 0.5
#: Scales tried per task. The lesion was sized before (generator version 2)
#: and is measured at its size only, for the record.
GRID: dict[str, tuple[float, ...]] = {
    "lesion": (1.0,),
    "fluid": (0.6, 0.8, 1.0, 1.2),
    "thinning": (0.6, 0.8, 1.0, 1.2),
}
#: Measured at the chosen sizes; its rule uses chance = 1/4.
MULTI_CLASS = "finding"
KNN_K = 10


class Harness:
    """The quickstart's transform and model, and the probes, built once."""

    def __init__(self, n_volumes: int, cohort_seed: int, dataset: dict[str, Any] | None = None):
        import torch

        from octfw.evaluation.classification import build_from_table
        from octfw.recipe import load_recipe
        from octfw.registry import load_registry

        torch.set_num_threads(1)  # a shared machine; results do not depend on it
        self.registry = load_registry()
        self.recipe = load_recipe(RECIPE, [], self.registry)
        self.ctx = self.recipe.build_context(registry=self.registry)
        self.transform = build_from_table("transform", self.ctx.recipe["transform"], self.ctx, "transform")
        self.n_volumes, self.cohort_seed = n_volumes, cohort_seed
        #: the dataset component and its options other than the task's (phantom-oct: its family)
        self.dataset = dataset or {"name": "synthetic-oct"}

    def dataset_table(self, task: str, scale: float, n_volumes: int | None = None) -> dict[str, Any]:
        return {**self.dataset, "n_volumes": n_volumes or self.n_volumes, "labels": True,
                "seed": self.cohort_seed, "task": task, "finding_scale": scale}

    def volumes(self, task: str, scale: float, n_volumes: int | None = None):
        from octfw.evaluation.classification import build_from_table
        from octfw.evaluation.features import load_labelled

        dataset = build_from_table("dataset", self.dataset_table(task, scale, n_volumes), self.ctx, "dataset")
        return load_labelled(dataset, self.transform, keep=True, where=f"{task} x{scale}")

    def random_encoder(self, seed: int):
        import torch

        # As octfw eval builds its baseline (octfw.evaluation.target): the recipe's
        # model, seeded, without touching the caller's generator.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.recipe.model.build(self.ctx)

    def evaluator(self, name: str, task: str, scale: float, n_volumes: int | None = None, **options: Any):
        from octfw.evaluation.classification import build_from_table

        table = {"name": name, "dataset": self.dataset_table(task, scale, n_volumes), **options}
        return build_from_table("evaluator", table, self.ctx, name)


def voxel_features(volumes) -> "Any":
    """The prepared volumes average-pooled 2 x 4 x 4 and flattened: ``[N, 2048]``."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    stacked = torch.from_numpy(np.stack(volumes.prepared))
    return F.avg_pool3d(stacked, (2, 4, 4)).flatten(1)


def max_pooled_voxels(volumes) -> "Any":
    """The lesion's sizing features: depth max of the smoothed volume, 8 x 8 max over H x W."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    stacked = torch.from_numpy(np.stack(volumes.prepared))
    smoothed = F.avg_pool3d(stacked, 3, stride=1, padding=1)
    return F.max_pool2d(smoothed.amax(dim=2), 8).flatten(1)


def probe(features, volumes, split_seed: int, classifier: str, l2: float = 1e-2) -> dict[str, float]:
    """Metrics of one classifier on one split, as the evaluators compute them."""
    import numpy as np
    import torch

    from octfw.evaluation.features import stratified_split
    from octfw.plugins.evaluators.knn.algorithm import knn_probabilities
    from octfw.evaluation.metrics import classification_metrics
    from octfw.plugins.evaluators.linear_probe.algorithm import fit_linear_probe

    # Whole patients when the cohort knows them (phantom-oct), as the evaluators split.
    train, test = stratified_split(volumes.labels, volumes.domains, 0.5, split_seed, groups=volumes.groups)
    classes = np.unique(volumes.labels[train])
    targets = torch.from_numpy(np.searchsorted(classes, volumes.labels[train]))
    if classifier == "linear":
        probabilities = fit_linear_probe(features[train], targets, len(classes), l2=l2).probabilities(features[test])
    else:
        probabilities = knn_probabilities(features[train], targets, features[test], len(classes), k=KNN_K)
    return classification_metrics(volumes.labels[test], probabilities.numpy(), classes,
                                   [volumes.domains[i] for i in test])


def summarise(per_split: list[dict[str, float]]) -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {}
    for key in ("balanced_accuracy", "accuracy", "auroc"):
        values = [m[key] for m in per_split if key in m]
        if values:
            out[key] = {"mean": round(float(np.mean(values)), 4), "std": round(float(np.std(values)), 4)}
    return out


def measure(harness: Harness, task: str, scale: float, splits: int, encoder_seeds: list[int],
            n_volumes: int | None = None, attentive: bool = False) -> dict[str, Any]:
    """The rule's numbers for one task and scale; with ``attentive``, the random encoders are also
    read by the ``attentive-probe`` evaluator (default options) on their patch tokens."""
    from octfw.evaluation.features import extract_features

    started = time.perf_counter()
    volumes = harness.volumes(task, scale, n_volumes)
    chance = 1.0 / len(set(volumes.labels.tolist()))
    result: dict[str, Any] = {"task": task, "finding_scale": scale, "n_volumes": len(volumes),
                              "label_counts": {int(k): int((volumes.labels == k).sum())
                                               for k in sorted(set(volumes.labels.tolist()))},
                              "chance": chance, "probes": {}}
    seeds = range(splits)
    for name, features in (("voxels", voxel_features(volumes)), ("max-pooled voxels", max_pooled_voxels(volumes))):
        result["probes"][name] = summarise([probe(features, volumes, s, "linear") for s in seeds])
    models = {seed: harness.random_encoder(seed) for seed in encoder_seeds}
    for seed, model in models.items():
        features = extract_features(model, volumes, "cpu", 8)
        for classifier in ("linear", "knn"):
            result["probes"][f"random encoder {seed} {classifier}"] = summarise(
                [probe(features, volumes, s, classifier) for s in seeds])
    if attentive:
        per_seed: dict[int, list[dict[str, float]]] = {seed: [] for seed in models}
        for split_seed in seeds:
            # One evaluator per split: it decodes the cohort once, for every encoder.
            evaluator = harness.evaluator("attentive-probe", task, scale, n_volumes, split_seed=split_seed)
            for seed, model in models.items():
                per_seed[seed].append(evaluator.evaluate(model, "cpu", 0))
        for seed, per_split in per_seed.items():
            result["probes"][f"random encoder {seed} attentive"] = summarise(per_split)
    voxels = result["probes"]["voxels"]["balanced_accuracy"]["mean"]
    best_random = max(v["balanced_accuracy"]["mean"] for k, v in result["probes"].items()
                      if k.startswith("random encoder"))
    limit = chance + GIVEN_AWAY * (voxels - chance)
    result["rule"] = {"voxels": voxels, "best_random": best_random, "random_limit": round(limit, 4),
                      "visible": voxels >= VISIBLE, "not_given_away": best_random <= limit}
    result["rule"]["passes"] = result["rule"]["visible"] and result["rule"]["not_given_away"]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def check_against_the_evaluators(harness: Harness, task: str) -> dict[str, Any]:
    """The components' own numbers for split seed 0 and encoder seed 0, next to this script's."""
    import torch

    from octfw.evaluation.features import extract_features

    model = harness.random_encoder(0)
    volumes = harness.volumes(task, 1.0)
    features = extract_features(model, volumes, "cpu", 8)
    out = {}
    for name, classifier, options in (("linear-probe", "linear", {}), ("knn", "knn", {"k": KNN_K})):
        evaluator = harness.evaluator(name, task, 1.0, **options)
        with torch.no_grad():
            theirs = evaluator.evaluate(model, "cpu", 0)
        ours = probe(features, volumes, 0, classifier, **({"l2": evaluator.config.l2} if classifier == "linear" else {}))
        same = all(abs(theirs[k] - ours[k]) < 1e-9 for k in ("accuracy", "balanced_accuracy"))
        if not same:
            raise SystemExit(f"{name}: the script's probe ({ours}) differs from the evaluator's ({theirs})")
        out[name] = {"balanced_accuracy": ours["balanced_accuracy"], "same_as_evaluator": same}
    return out


def line(result: dict[str, Any]) -> str:
    rule = result["rule"]
    verdict = "passes" if rule["passes"] else ("not visible" if not rule["visible"] else "given away")
    return (f"{result['task']:<9} x{result['finding_scale']:<4} n={result['n_volumes']:<4} voxels {rule['voxels']:.3f}  "
            f"max-pooled {result['probes']['max-pooled voxels']['balanced_accuracy']['mean']:.3f}  "
            f"best random {rule['best_random']:.3f} (limit {rule['random_limit']:.3f})  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(GRID), choices=list(GRID))
    parser.add_argument("--splits", type=int, default=10, help="split seeds 0..N-1 (default 10)")
    parser.add_argument("--encoder-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--n-volumes", type=int, default=120)
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    args = parser.parse_args()

    harness = Harness(args.n_volumes, cohort_seed=1)
    sweep, chosen = [], {}
    for task in args.tasks:
        for scale in GRID[task]:
            result = measure(harness, task, scale, args.splits, args.encoder_seeds)
            print(line(result), flush=True)
            sweep.append(result)
        passing = [r["finding_scale"] for r in sweep if r["task"] == task and r["rule"]["passes"]]
        chosen[task] = min(passing) if passing else None
        print(f"{task:<9} chosen scale: {chosen[task]}", flush=True)

    # The multi-class task at the generator's sizes (scale 1): on the same
    # cohort size, and on twice as many volumes, which gives each of its four
    # classes as many training volumes as a binary task's two get.
    multi = [measure(harness, MULTI_CLASS, 1.0, args.splits, args.encoder_seeds, n)
             for n in (args.n_volumes, 2 * args.n_volumes)]
    for result in multi:
        print(line(result), flush=True)
    check = check_against_the_evaluators(harness, args.tasks[0])
    print(f"evaluator check ({args.tasks[0]}, split 0, encoder 0): {check}", flush=True)
    if any(scale not in (None, 1.0) for scale in chosen.values()):
        print("note: a chosen scale is not 1.0; set the generator's constants to it and run again")

    if not args.no_write:
        path = write_result("synthetic_tasks", {
            "machine": machine(),
            "recipe": str(RECIPE.relative_to(ROOT)),
            "rule": {"visible": VISIBLE, "given_away": GIVEN_AWAY, "metric": "balanced_accuracy",
                     "splits": args.splits, "encoder_seeds": args.encoder_seeds, "knn_k": KNN_K,
                     "cohort": {"n_volumes": args.n_volumes, "seed": 1}},
            "sweep": sweep,
            "chosen_scale": chosen,
            "multi_class": multi,
            "evaluator_check": check,
        })
        print(f"wrote {Path(path).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
