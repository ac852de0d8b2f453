"""Two suspected causes of a failing attentive probe, measured as variants of its fit.

For exported encoders (and the random encoder of the same architecture,
``octfw eval``'s baseline), on a phantom family's labelled task (200 volumes,
cohort seed 1, patient-level splits), the tokens are encoded once per split
and the attentive probe's grid is fitted in these variants of
:mod:`octfw.plugins.evaluators.attentive_probe.algorithm`:

- ``base``: as committed;
- ``steps``: at least 500 AdamW steps (30 epochs of 45 volumes are 85);
- ``value_scale``: the attended values standardised by the spread of the
  volumes' mean tokens rather than by the tokens' own spread (the keys keep
  the per-token standardisation), so that a mean-pooled value varies between
  volumes at unit scale, as the linear probe's features do;
- ``value_scale_steps``: both.

The variants change private functions of the module for the length of one
fit (this is a measurement, not an option of the probe). Prints one row per
(encoder, split, encoder kind) and writes
``benchmarks/results/attentive_variants_<family>.json`` with every row and
the mean test balanced accuracy per variant.

    PJRT_DEVICE=CPU python benchmarks/attentive_variants.py ENCODER.pt [ENCODER.pt ...] --family tuning --splits 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from _common import machine, write_result

VARIANTS = ("base", "steps", "value_scale", "value_scale_steps")
MIN_STEPS = 500


def _value_scaled_forward(original: Any, value_scale: torch.Tensor) -> Any:
    def forward(params: dict[str, torch.Tensor], tokens: torch.Tensor, num_heads: int) -> torch.Tensor:
        x = (tokens.float() - params["mean"]) / params["scale"]
        members, _heads, width = params["query"].shape
        weights = torch.softmax(torch.einsum("bte,ghe->gbht", x, params["query"]), dim=-1)
        values = (tokens.float() - params["mean"]) / value_scale
        mixed = torch.einsum("gbht,bte->gbhe", weights, values)
        w_v = params["w_v"].reshape(members, width, num_heads, width // num_heads)
        pooled = torch.einsum("gbhe,gehd->gbhd", mixed, w_v).reshape(members, -1, width) + params["b_v"][:, None]
        z = F.layer_norm(pooled, (width,))
        return torch.einsum("gbe,gek->gbk", z, params["w_c"]) + params["b_c"][:, None]

    return forward


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The attentive module's fit, changed as ``name`` says, for the ``with`` block."""
    import octfw.plugins.evaluators.attentive_probe.algorithm as attentive

    fit, forward = attentive.fit_attentive_grid, attentive._forward

    def changed_fit(tokens: torch.Tensor, targets: torch.Tensor, n_classes: int, **options: Any):
        if "steps" in name:
            options["epochs"] = max(options["epochs"], math.ceil(MIN_STEPS * options["batch_size"] / len(tokens)))
        if "value_scale" in name:
            spread = tokens.float().mean(dim=1).std(dim=0, correction=0).clamp_min(1e-6)
            attentive._forward = _value_scaled_forward(forward, spread)
        return fit(tokens, targets, n_classes, **options)

    attentive.fit_attentive_grid = changed_fit
    try:
        yield
    finally:
        attentive.fit_attentive_grid, attentive._forward = fit, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("encoders", nargs="+", type=Path, help="exported encoders (octfw export)")
    parser.add_argument("--family", default="tuning", choices=("tuning", "held-out"))
    parser.add_argument("--splits", type=int, default=4)
    args = parser.parse_args()

    import tomli_w

    from octfw.evaluation.target import build_evaluators, load_eval_recipe, load_target
    from octfw.registry import load_registry

    registry = load_registry()
    dataset = {"name": "phantom-oct", "family": args.family, "n_volumes": 200, "labels": True, "seed": 1}
    work = Path(tempfile.mkdtemp(prefix="octfw-attentive-variants-"))
    rows = []
    for path in args.encoders:
        target = load_target(path, 0, registry)
        for split in range(args.splits):
            recipe_path = work / f"eval_{split}.toml"
            recipe_path.write_text(tomli_w.dumps({"run": {"seed": 0, "device": "cpu"}, "evaluator": [
                {"name": name, "dataset": dataset, "split_seed": split, "bootstrap": 0}
                for name in ("linear-probe", "attentive-probe")]}))
            evaluators = dict(build_evaluators(target, load_eval_recipe(recipe_path, [], registry), registry))
            linear, attentive = evaluators["linear-probe"], evaluators["attentive-probe"]
            for kind, model in (("pretrained", target.pretrained), ("random_init", target.random_init)):
                with torch.no_grad():
                    row = {"encoder": path.name, "split": split, "kind": kind,
                           "linear": linear.score(linear.encode(model, "cpu"))["balanced_accuracy"]}
                    tokens = attentive.encode(model, "cpu")
                    for name in VARIANTS:
                        with variant(name):
                            scores = attentive.score(tokens)
                        row[name] = {key: scores[key] for key in ("balanced_accuracy", "val_balanced_accuracy",
                                                                  "selected_lr", "single_class_members")}
                print(json.dumps(row), flush=True)
                rows.append(row)
    means = {kind: {name: round(statistics.fmean(r[name]["balanced_accuracy"] for r in rows if r["kind"] == kind), 4)
                    for name in VARIANTS} for kind in ("pretrained", "random_init")}
    print(json.dumps(means, indent=1))
    path = write_result(f"attentive_variants_{args.family}", {
        "machine": machine(), "family": args.family, "splits": args.splits,
        "encoders": [str(p) for p in args.encoders], "min_steps": MIN_STEPS, "mean_test_balanced_accuracy": means,
        "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
