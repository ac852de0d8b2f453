"""Sizing the ``context`` phantom family's task: a finding random-init tokens do not give away.

The held-out family's cysts left no room for pretraining: a random-init
``tiny`` encoder's tokens, read by a linear probe on all 64 tokens
concatenated, already reached 0.90 (issue #39, item 5). This script sizes
the third family's finding against the strongest readers of random tokens
before any pretrained encoder is probed, by the rule of
``phantom_tasks.py`` with stronger readers:

- data: a labelled ``context`` cohort of ``--n-volumes`` (default 200 as the
  other families; the shapes before the reversal were sized on 128; two
  eyes per patient), cohort seed 1, prepared as ``recipes/quickstart_eval.toml``
  prepares (oct-standard at 16 x 64 x 64); split seeds ``0..--splits-1``,
  half of the patients of each (vendor, labels) group train, the other half
  test;
- **visible**: the voxel probe of ``phantom_tasks.py`` (linear probe, l2 1e-2,
  on the prepared volume average-pooled 2 x 4 x 4) reaches a mean balanced
  accuracy of 0.90;
- **not given away**: for the vjepa3d ``tiny`` encoder (patches 4 x 16 x 16,
  64 tokens of width 96) built as the recipe builds it (input standardised
  per volume, xavier-initialised patch projection) with torch seeds ``--encoder-seeds``, no
  reader's mean balanced accuracy exceeds chance plus half of the voxel
  probe's margin. The readers, each choosing its regularisation on a
  validation third of the train patients (then, for the linear ones,
  refitted on all train patients):

  - ``mean linear``: the linear probe on mean-pooled tokens (the
    ``linear-probe`` evaluator's l2 1e-2, and the best l2 of the grid);
  - ``concat linear``: the linear probe (standardised features, logistic
    regression) on all 64 tokens concatenated (6,144 features), l2 grid;
  - ``attentive``: octfw's attentive probe
    (:func:`~octfw.plugins.evaluators.attentive_probe.algorithm.fit_attentive_grid`)
    trained to convergence (each member until the validation patients stop
    improving, at most ``ATTENTIVE_EPOCHS`` epochs) over a wide grid of learning
    rates and weight decays, the member chosen on validation as the
    evaluator chooses (:func:`select_member`);
  - ``best token``: a linear probe on one token position at a time (64
    probes), the position and l2 chosen on validation: the token-level
    reading of a finding that one region shows.

No pretrained encoder is probed here. One torch thread. Each shape runs on
its own cohort folder (``--work``); results of every shape run are merged
into ``benchmarks/results/context_task.json``.

    PJRT_DEVICE=CPU python benchmarks/learning/context_task.py --shapes reversal-AB [--n-volumes 200] [--splits 4] [--encoder-seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import RESULTS, ROOT, machine, write_result  # noqa: E402
from synthetic_tasks import GIVEN_AWAY, RECIPE, VISIBLE, Harness, probe, voxel_features  # noqa: E402

L2_GRID = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
TOKEN_L2_GRID = (1e-2, 1.0, 100.0)
ATTENTIVE_LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
ATTENTIVE_WDS = (0.0, 0.05, 0.5)
ATTENTIVE_EPOCHS = 300
VALIDATION = 1 / 3  # share of the train patients that choose a reader's regularisation


def shapes() -> dict[str, Any]:
    """The candidate findings, by name: (Shape, finding_scale)."""
    from octfw.plugins.datasets.phantom.context import Shape

    return {
        "dome-A": (Shape("dome", size=(0.06, 0.10), width=(1.0, 1.4)), 1.0),
        "dome-B": (Shape("dome", size=(0.09, 0.15), width=(1.0, 1.4)), 1.0),
        "dome-C": (Shape("dome", size=(0.12, 0.20), width=(1.0, 1.4)), 1.0),
        "dome-narrow": (Shape("dome", size=(0.09, 0.15), width=(0.6, 0.8)), 1.0),
        "dome-broad": (Shape("dome", size=(0.18, 0.30), width=(1.8, 2.4)), 1.0),
        "hemifield-A": (Shape("hemifield", size=(0.5, 0.8), width=(0.2, 0.4)), 1.0),
        "dimming-A": (Shape("dimming", size=(0.10, 0.20), width=(0.3, 0.6)), 1.0),
        "dimming-B": (Shape("dimming", size=(0.20, 0.35), width=(0.3, 0.6)), 1.0),
        "dimming-C": (Shape("dimming", size=(0.35, 0.50), width=(0.3, 0.6)), 1.0),
        "dimming-D": (Shape("dimming", size=(0.50, 0.80), width=(0.3, 0.6)), 1.0),
        "dimming-E": (Shape("dimming", size=(0.65, 0.95), width=(0.3, 0.6)), 1.0),
        "asymmetry-A": (Shape("asymmetry", size=(0.2, 0.35), width=(0.3, 0.6)), 1.0),
        "asymmetry-B": (Shape("asymmetry", size=(0.3, 0.5), width=(0.3, 0.6)), 1.0),
        "asymmetry-C": (Shape("asymmetry", size=(0.45, 0.65), width=(0.3, 0.6)), 1.0),
        "asymmetry-D": (Shape("asymmetry", size=(0.6, 0.8), width=(0.3, 0.6)), 1.0),
        "reversal-A": (Shape("reversal", size=(0.15, 0.3), width=(0.3, 0.6)), 1.0),
        "reversal-AB": (Shape("reversal", size=(0.2, 0.4), width=(0.3, 0.6)), 1.0),
        "reversal-B": (Shape("reversal", size=(0.3, 0.5), width=(0.3, 0.6)), 1.0),
        "reversal-C": (Shape("reversal", size=(0.45, 0.65), width=(0.3, 0.6)), 1.0),
    }


#: Quick looks (128 volumes unless "n=200", encoder seed 0, split seeds 0-1, no attentive probe): voxel
#: probe / mean linear (l2 1e-2) / mean linear (l2 grid) / concat linear / best token. Up to asymmetry-D
#: the encoder had no input standardisation (and a default-initialised patch projection); from
#: "current encoder" on, the encoder as the vjepa3d ``tiny`` recipe builds it now (standardise_input
#: true, xavier-initialised projection). Anatomy "wide": the
#: inner surface at 0.35-1.05 mm (then 0.45-1.15) in the window, layer levels lognormal 0.12 (then
#: 0.2); anatomy "narrow" (the code's now): 0.55-0.85 mm, 0.2; the dimmed/asymmetric layers NFL and
#: GCL+IPL ("2 layers") or NFL to OPL ("4 layers", the code's now). Every shape's code is kept in
#: shapes(); only the anatomy and the layer count moved.
HISTORY: list[str] = [
    "dome-A (wide, levels 0.12): 0.533 / 0.417 / 0.500 / 0.506 / 0.546: not visible",
    "dome-B (wide, levels 0.12): 0.610 / 0.449 / 0.500 / 0.531 / 0.672: not visible, and one token "
    "(the fovea's: the dome inverts the retina's local curvature) reads it better than the voxels",
    "hemifield-A (wide, levels 0.12): 0.614 / 0.450 / 0.482 / 0.436 / 0.474: not visible",
    "dimming-A (wide, 2 layers): 0.512 / 0.463 / 0.483 / 0.438 / 0.492: not visible",
    "dimming-B (wide, 2 layers): 0.599 / 0.463 / 0.464 / 0.478 / 0.485: not visible",
    "dimming-C (wide, 2 layers): 0.649 / 0.478 / 0.493 / 0.494 / 0.506: not visible",
    "dome-broad (wide): 0.640 / 0.572 / 0.597 / 0.661 / 0.721: not visible; a token reads it",
    "dome-C (wide): 0.699 / 0.524 / 0.508 / 0.569 / 0.583: not visible",
    "dimming-D (narrow, 2 layers): 0.743 / 0.668 / 0.510 / 0.537 / 0.494: not visible; the mean-pooled "
    "tokens read the volume's lower total brightness",
    "asymmetry-B (narrow, 2 layers): 0.606 / 0.601 / 0.497 / 0.454 / 0.533: not visible",
    "asymmetry-C (narrow, 2 layers): 0.707 / 0.633 / 0.487 / 0.508 / 0.531: not visible",
    "asymmetry-B (narrow, 4 layers): 0.715 / 0.643 / 0.547 / 0.469 / 0.533: not visible",
    "asymmetry-C (narrow, 4 layers): 0.851 / 0.710 / 0.658 / 0.539 / 0.553: not visible",
    "asymmetry-D (narrow, 4 layers): 0.899 / 0.839 / 0.721 / 0.585 / 0.590: given away to the "
    "mean-pooled linear probe (limit 0.699): the compression (intensity ** 0.4) and the encoder's "
    "nonlinearity turn a brightness moved between halves into a change of the mean token",
    "current encoder: dimming-D 0.790 / 0.632 / 0.596 / 0.550 / 0.557: not visible",
    "current encoder: dimming-E 0.861 / 0.679 / 0.696 / 0.631 / 0.596: not visible, and given away to the "
    "mean-pooled linear probe (limit 0.680): the standardisation per volume does not starve it",
    "current encoder: asymmetry-D 0.899 / 0.710 / 0.682 / 0.618 / 0.606: not visible, and given away "
    "(limit 0.699)",
    "reversal-A: 0.750 / 0.546 / 0.546 / 0.536 / 0.549: not visible",
    "reversal-B: 0.908 / 0.579 / 0.537 / 0.581 / 0.508: passes (limit 0.704); the full run: not visible (0.886)",
    "reversal-C: 0.947 / 0.685 / 0.637 / 0.688 / 0.601: passes (limit 0.724); the full run passes by 0.016",
    "reversal-B n=200: 0.985 / 0.655 / 0.615 / 0.722 / 0.536: passes (limit 0.743)",
    "reversal-C n=200: 1.000 / 0.680 / 0.710 / 0.891 / 0.645: given away to the concatenated linear probe "
    "(limit 0.750): with 100 train volumes it finds the halves' relation in 6,144 random features",
    "reversal-A n=200: 0.871 / 0.604 / 0.555 / 0.557 / 0.491: not visible",
    "reversal-AB n=200: 0.955 / 0.634 / 0.595 / 0.611 / 0.526: passes (limit 0.728), the widest margin; "
    "the full run passes (voxels 0.965, strongest 0.649 against 0.733): chosen",
    "current encoder: asymmetry-D n=200: 0.985 / 0.659 / 0.669 / 0.726 / 0.596: passes narrowly (limit 0.742)",
    "current encoder: dimming-E n=200: 0.941 / 0.680 / 0.685 / 0.746 / 0.533: given away to the concatenated "
    "linear probe (limit 0.720)",
    "reversal-AB n=400: 0.990 / 0.604 / 0.591 / 0.722 / 0.561: passes (limit 0.745), the margin narrower "
    "than on 200 volumes",
]


def _balanced_accuracy(labels, predicted) -> float:
    import numpy as np

    return float(np.mean([(predicted[labels == c] == c).mean() for c in np.unique(labels)]))


class Split:
    """One patient-level split: train (fit + validation) and test positions, targets 0/1."""

    def __init__(self, volumes, seed: int):
        import numpy as np
        import torch

        from octfw.evaluation.features import stratified_split

        self.train, self.test = stratified_split(volumes.labels, volumes.domains, 0.5, seed, groups=volumes.groups)
        train = np.asarray(self.train)
        fit, val = stratified_split(volumes.labels[train], [volumes.domains[i] for i in train], 1 - VALIDATION,
                                    seed + 1000, groups=[volumes.groups[i] for i in train])
        self.fit, self.val = train[fit].tolist(), train[val].tolist()
        self.y = torch.from_numpy(volumes.labels.astype("int64"))


def _linear(features, split: Split, grid) -> tuple[float, float]:
    """Test balanced accuracy of the linear probe whose l2 (of ``grid``) is best on validation; the l2."""
    from octfw.plugins.evaluators.linear_probe.algorithm import fit_linear_probe

    y = split.y
    scores = []
    for l2 in grid:
        predicted = fit_linear_probe(features[split.fit], y[split.fit], 2, l2=l2).probabilities(
            features[split.val]).argmax(1)
        scores.append(_balanced_accuracy(y[split.val].numpy(), predicted.numpy()))
    best = grid[max(range(len(grid)), key=lambda i: (scores[i], i))]  # ties: the stronger l2
    predicted = fit_linear_probe(features[split.train], y[split.train], 2, l2=best).probabilities(
        features[split.test]).argmax(1)
    return _balanced_accuracy(y[split.test].numpy(), predicted.numpy()), best


def _best_token(tokens, split: Split) -> tuple[float, int]:
    """Test balanced accuracy of the one-token linear probe chosen on validation (position, l2)."""
    from octfw.plugins.evaluators.linear_probe.algorithm import fit_linear_probe

    y = split.y
    best = (-1.0, 0, 0.0)
    for position in range(tokens.shape[1]):
        features = tokens[:, position]
        for l2 in TOKEN_L2_GRID:
            predicted = fit_linear_probe(features[split.fit], y[split.fit], 2, l2=l2, max_iter=100).probabilities(
                features[split.val]).argmax(1)
            score = _balanced_accuracy(y[split.val].numpy(), predicted.numpy())
            if score > best[0]:
                best = (score, position, l2)
    _, position, l2 = best
    features = tokens[:, position]
    predicted = fit_linear_probe(features[split.train], y[split.train], 2, l2=l2).probabilities(
        features[split.test]).argmax(1)
    return _balanced_accuracy(y[split.test].numpy(), predicted.numpy()), position


def _attentive(tokens, split: Split, seed: int) -> tuple[float, float]:
    """Test balanced accuracy of the attentive probe's member chosen on validation; its validation score."""
    from octfw.plugins.evaluators.attentive_probe.algorithm import fit_attentive_grid, select_member

    y = split.y
    # Each member stops when the validation patients stop improving (at most ATTENTIVE_EPOCHS).
    grid = fit_attentive_grid(tokens[split.fit], y[split.fit], tokens[split.val], y[split.val], 2,
                              learning_rates=ATTENTIVE_LRS, weight_decays=ATTENTIVE_WDS, num_heads=4,
                              max_epochs=ATTENTIVE_EPOCHS, batch_size=16, seed=seed)
    selection = select_member(grid, tokens[split.val], y[split.val])
    predicted = grid.probabilities(tokens[split.test], selection.chosen).argmax(1)
    return (_balanced_accuracy(y[split.test].numpy(), predicted.numpy()),
            selection.balanced_accuracy[selection.chosen])


def _summary(values: list[float]) -> dict[str, float]:
    import numpy as np

    return {"mean": round(float(np.mean(values)), 4), "std": round(float(np.std(values)), 4),
            "per_split": [round(v, 4) for v in values]}


def measure(name: str, shape, scale: float, work: Path, n_volumes: int, splits: int,
            encoder_seeds: list[int], attentive: bool) -> dict[str, Any]:
    import torch

    from octfw.evaluation.features import extract_tokens
    from octfw.plugins.datasets.phantom import context

    started = time.perf_counter()
    # The family's code is in the key too: a cohort drawn by an older anatomy is not reused.
    source = Path(context.__file__).read_bytes()
    digest = hashlib.sha256(repr((attrs.asdict(shape), scale)).encode() + source).hexdigest()[:8]
    context.FINDING = shape  # the family draws FINDING; this process measures one shape at a time
    harness = Harness(n_volumes, cohort_seed=1, dataset={"name": "phantom-oct", "family": "context",
                                                         "folder": str(work / f"{name}-{digest}")})
    volumes = harness.volumes(context.TASK, scale)
    split_list = [Split(volumes, s) for s in range(splits)]
    result: dict[str, Any] = {"shape": name, "finding": attrs.asdict(shape), "finding_scale": scale,
                              "n_volumes": len(volumes), "positives": int(volumes.labels.sum()), "chance": 0.5,
                              "probes": {}}
    voxels = voxel_features(volumes)
    result["probes"]["voxels"] = _summary([probe(voxels, volumes, s, "linear")["balanced_accuracy"]
                                           for s in range(splits)])
    print(f"{name}: voxels {result['probes']['voxels']['mean']:.3f}", flush=True)
    for seed in encoder_seeds:
        model = harness.random_encoder(seed)
        tokens = extract_tokens(model, volumes, "cpu", 8, grid=(4, 4, 4), max_tokens=64, dtype=torch.float32)
        mean, concat = tokens.mean(dim=1), tokens.flatten(1)
        readers: dict[str, list[float]] = {}
        chosen: dict[str, list[Any]] = {}
        for s, split in enumerate(split_list):
            readers.setdefault("mean linear l2 1e-2", []).append(probe(mean, volumes, s, "linear")["balanced_accuracy"])
            for reader, features in (("mean linear", mean), ("concat linear", concat)):
                score, l2 = _linear(features, split, L2_GRID)
                readers.setdefault(reader, []).append(score)
                chosen.setdefault(reader, []).append(l2)
            score, position = _best_token(tokens, split)
            readers.setdefault("best token", []).append(score)
            chosen.setdefault("best token", []).append(position)
            if attentive:
                score, val = _attentive(tokens, split, s)
                readers.setdefault("attentive", []).append(score)
                chosen.setdefault("attentive", []).append(round(val, 3))
        for reader, values in readers.items():
            result["probes"][f"random encoder {seed} {reader}"] = {**_summary(values), "chosen": chosen.get(reader)}
        print(f"{name}: encoder {seed} " + "  ".join(f"{r} {sum(v) / len(v):.3f}" for r, v in readers.items()),
              flush=True)
    voxel_mean = result["probes"]["voxels"]["mean"]
    strongest = max(((k, v["mean"]) for k, v in result["probes"].items() if k.startswith("random encoder")),
                    key=lambda item: item[1])
    limit = 0.5 + GIVEN_AWAY * (voxel_mean - 0.5)
    result["rule"] = {"voxels": voxel_mean, "strongest_random": strongest[1], "strongest_reader": strongest[0],
                      "random_limit": round(limit, 4), "visible": voxel_mean >= VISIBLE,
                      "not_given_away": strongest[1] <= limit}
    result["rule"]["passes"] = result["rule"]["visible"] and result["rule"]["not_given_away"]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def line(result: dict[str, Any]) -> str:
    rule = result["rule"]
    verdict = "passes" if rule["passes"] else ("not visible" if not rule["visible"] else "given away")
    return (f"{result['shape']:<12} x{result['finding_scale']:<4} n={result['n_volumes']:<4} voxels {rule['voxels']:.3f}  "
            f"strongest random {rule['strongest_random']:.3f} ({rule['strongest_reader']}; limit "
            f"{rule['random_limit']:.3f})  {verdict}")


def main() -> None:
    import torch

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(shapes()), choices=list(shapes()))
    parser.add_argument("--scale", type=float, default=None, help="override every shape's finding_scale")
    parser.add_argument("--splits", type=int, default=4, help="split seeds 0..N-1 (default 4)")
    parser.add_argument("--encoder-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--n-volumes", type=int, default=200,
                        help="cohort size (default 200 as the other families; the shapes before the reversal: 128)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/octfw-context-task"), help="cohort folders")
    parser.add_argument("--no-attentive", action="store_true", help="linear readers only (a quick look)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    args = parser.parse_args()

    sweep = []
    for name in args.shapes:
        shape, scale = shapes()[name]
        result = measure(name, shape, args.scale or scale, args.work, args.n_volumes, args.splits,
                         args.encoder_seeds, attentive=not args.no_attentive)
        result["options"] = {"splits": args.splits, "encoder_seeds": args.encoder_seeds,
                             "attentive": not args.no_attentive}
        print(line(result), flush=True)
        sweep.append(result)
    if args.no_write:
        return
    # Shapes run in separate processes: keep the other shapes' rows of the file.
    path = RESULTS / "context_task.json"
    kept = json.loads(path.read_text())["sweep"] if path.exists() else []
    ran = {(r["shape"], r["finding_scale"], r["n_volumes"]) for r in sweep}
    sweep = [r for r in kept if (r["shape"], r["finding_scale"], r["n_volumes"]) not in ran] + sweep
    written = write_result("context_task", {
        "machine": {**machine(), "note": "2-core CPU shared with other jobs; one torch thread"},
        "recipe": str(RECIPE.relative_to(ROOT)),
        "rule": {"visible": VISIBLE, "given_away": GIVEN_AWAY, "metric": "balanced_accuracy",
                 "split": "whole patients, half train; a third of the train patients validate",
                 "cohort": {"family": "context", "seed": 1, "n_volumes": "each row's n_volumes"},
                 "l2_grid": L2_GRID, "token_l2_grid": TOKEN_L2_GRID,
                 "attentive": {"learning_rates": ATTENTIVE_LRS, "weight_decays": ATTENTIVE_WDS,
                               "max_epochs": ATTENTIVE_EPOCHS, "patience": 40, "num_heads": 4,
                               "batch_size": 16}},
        "sweep": sweep,
        "history": HISTORY,
    })
    print(f"wrote {Path(written).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
