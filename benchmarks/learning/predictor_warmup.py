"""What a new predictor costs a pretrained encoder, with and without ``model.predictor_warmup_steps``.

The situation of a published encoder continued on OCT with its predictor left new, made
in-domain and small enough for the CPU:

1. ``pretrain``: ``recipes/pretrain_cpu.toml`` (the tiny model on its 240-volume synthetic
   cohort, labels unused) trained for ``--pretrain-updates`` update steps: the encoder.
2. ``continue``: for each LR, seed and arm of ``--arms``, the same recipe continued from that
   encoder (its EMA encoder, what octfw exports, copied into both encoders, as a published file
   without a target encoder starts them) with a new predictor (the run's seed) held for no step
   (``none``) or ``--warmup`` steps (``warmup``), or, as a control, with the pretrained predictor
   (``continued``: what continuing moves without a new predictor), on the continue recipe's
   schedule (``recipes/continue_vjepa21.toml``: no LR warm-up, the LR straight down over 1.25 x
   the run, EMA momentum 0.99925). At each step of ``--at`` it measures, against
   the start:

   - the encoder's own token change: ``|t - t0| / |t0|`` per token, averaged over the tokens
     of ``--token-volumes`` fixed held-out volumes, for the context encoder (the one the
     gradients reach) and the EMA encoder (the one exported and evaluated);
   - the linear probe (``linear-probe``'s own code, both readings) on the held-out four-class
     ``finding`` task (``--probe-volumes``, cohort seed 1: no volume seen in training), balanced
     accuracy, one fit per split of ``--splits``, for both encoders.

Prints a table per LR (mean over seeds and splits) and writes
``benchmarks/results/predictor_warmup[_NAME].json`` with every number and the machine.

    PJRT_DEVICE=CPU OMP_NUM_THREADS=1 python benchmarks/learning/predictor_warmup.py --out /tmp/pw \\
        --pretrain-updates 12000 --lrs 3e-5 1e-4 --seeds 0 1 2 3 --splits 0 1 2 --probe-volumes 480 \\
        --at 100 300 450 600 --name 12k
    ... the same with --arms continued --name 12k_continued (the pretraining run is reused)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import ROOT, machine, write_result  # noqa: E402

RECIPE = ROOT / "recipes" / "pretrain_cpu.toml"
PROBE_DATASET = {"name": "synthetic-oct", "labels": True, "seed": 1, "task": "finding"}
#: recipes/continue_vjepa21.toml's schedule for continued training.
CONTINUE_SCHEDULE = ["scheduler.warmup=0.0", 'scheduler.decay="linear"', "scheduler.min_lr=1e-7",
                     "scheduler.horizon_scale=1.25", "scheduler.ema_start=0.99925", "scheduler.ema_end=0.99925"]
READINGS = {"mean": "balanced_accuracy", "tokens": "tokens_balanced_accuracy"}
#: A new predictor without and with the warm-up; the pretrained predictor continued (a control:
#: what continuing moves without a new predictor, the optimizer's moments new all the same).
ARMS = ("none", "warmup", "continued")


def pretrain(out: Path, updates: int) -> Path:
    """The pretraining run's folder (made once: an existing one is reused)."""
    from octfw.cli.main import main

    folder = out / "pretrain"
    runs = sorted((folder / "pretrain_cpu").glob("*/summary.json")) if folder.exists() else []
    if runs:
        return runs[-1].parent
    sets = ["run.seed=0", f"run.max_steps={updates}", "run.epochs=100000", f"run.output_dir={json.dumps(str(folder))}",
            'logger=[{name="jsonl"}]', "evaluator=[]"]
    if main(["run", str(RECIPE), *[a for s in sets for a in ("--set", s)]]) != 0:
        raise SystemExit("pretraining failed")
    return sorted((folder / "pretrain_cpu").glob("*/summary.json"))[-1].parent


def pretrained(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The run's EMA encoder (what octfw exports) and predictor, from the checkpoint it stands at."""
    from octfw.exports.checkpoint import find_checkpoint
    from octfw.registry import load_registry

    _, state = find_checkpoint(run_dir, load_registry())
    return {part: {key[len(prefix):]: value for key, value in state["model"].items() if key.startswith(prefix)}
            for part, prefix in (("encoder", "target_encoder."), ("predictor", "predictor."))}


class Meter:
    """Token change and probe scores of a model's two encoders, against their first measurement."""

    def __init__(self, ctx: Any, splits: list[int], token_volumes: int, probe_volumes: int):
        from octfw.plugins.evaluators.linear_probe import LinearProbeConfig, build

        dataset = {**PROBE_DATASET, "n_volumes": probe_volumes}
        self.probes = [build(LinearProbeConfig(dataset=dataset, split_seed=s), ctx) for s in splits]
        test = self.probes[0].split()[1]
        arrays = [array for array, _ in zip(test.arrays(), range(token_volumes))]
        self.volumes = torch.from_numpy(np.stack(arrays))
        self.first: dict[str, torch.Tensor] = {}

    def __call__(self, model: Any, step: int) -> dict[str, Any]:
        row: dict[str, Any] = {"step": step}
        for name, encoder in (("context", model.context_encoder), ("ema", model.target_encoder)):
            encoder.eval()
            with torch.no_grad():
                tokens = encoder(self.volumes).float()
            encoder.train()
            first = self.first.setdefault(name, tokens)
            change = (tokens - first).norm(dim=-1) / first.norm(dim=-1)
            row[f"{name}_token_change"] = round(float(change.mean()), 6)
            row.update({f"{name}_{reading}_probe": scores for reading, scores in self.probe(encoder).items()})
        return row

    def probe(self, encoder: Any) -> dict[str, list[float]]:
        """Balanced accuracy of each reading, one per split."""
        scores = [probe.evaluate(encoder, torch.device("cpu"), 0) for probe in self.probes]
        return {reading: [round(s[key], 4) for s in scores] for reading, key in READINGS.items()}


def continue_run(out: Path, weights: dict[str, dict[str, torch.Tensor]], lr: float, seed: int, arm: str,
                 warmup: int, steps: int, at: list[int], meter_args: tuple[list[int], int, int]) -> dict[str, Any]:
    """One continuation from the pretrained encoder with a new predictor (held ``warmup`` steps,
    0 for none), or with the pretrained one (``arm`` "continued": the control); its measurements
    and losses."""
    from octfw.engine.plan import planned_folder
    from octfw.engine.trainer import Trainer
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    registry = load_registry()
    sets = [f"run.seed={seed}", f"run.max_steps={steps}", "run.epochs=100000", f"engine.base_lr={lr}",
            f"run.output_dir={json.dumps(str(out / 'continue'))}", 'logger=[{name="jsonl"}]', "evaluator=[]",
            f"engine.checkpoint_every_steps={steps}", f"model.predictor_warmup_steps={warmup}", *CONTINUE_SCHEDULE]
    recipe = load_recipe(RECIPE, sets, registry)
    run_dir = create_run_dir(recipe, registry)
    started = time.perf_counter()
    with planned_folder(recipe, registry, run_dir) as plan:
        trainer = Trainer(plan, registry)
        model = trainer.model
        meter = Meter(trainer.parts.ctx, *meter_args)
        random_init = meter.probe(model.context_encoder)  # the network before the pretrained weights
        model.context_encoder.load_state_dict(weights["encoder"])
        model.target_encoder.load_state_dict(weights["encoder"])
        if arm == "continued":
            model.predictor.load_state_dict(weights["predictor"])
        rows, losses, measuring = [meter(model, 0)], [], 0.0
        update = trainer.update

        def measured(update_step: int):
            nonlocal measuring
            norm, output = update(update_step)
            losses.append(round(float(output.loss.detach()), 5))
            if update_step + 1 in at:
                begun = time.perf_counter()
                rows.append(meter(model, update_step + 1))
                measuring += time.perf_counter() - begun
            return norm, output

        trainer.update = measured
        trainer.run()
    return {"lr": lr, "seed": seed, "arm": arm, "warmup": warmup, "random_init": random_init, "rows": rows, "losses": losses,
            "elapsed_s": round(time.perf_counter() - started, 1), "measuring_s": round(measuring, 1)}


def report(runs: list[dict[str, Any]]) -> None:
    def mean(values: list[float]) -> float:
        return statistics.fmean(values)

    random_init = {k: mean([v for r in runs for v in r["random_init"][k]]) for k in READINGS}
    print(f"random init (the continuations' fresh encoders): probe {random_init['mean']:.3f}/{random_init['tokens']:.3f}")
    for lr in sorted({r["lr"] for r in runs}):
        print(f"\nLR {lr:g} (mean over seeds and splits; probe: balanced accuracy, mean / tokens reading)")
        print(f"{'arm':>9} {'step':>5} {'loss':>7} {'ctx tok':>8} {'ema tok':>8} {'ctx probe':>13} {'ema probe':>13}")
        for arm in [a for a in ARMS if any(r["arm"] == a for r in runs)]:
            group = [r for r in runs if r["lr"] == lr and r["arm"] == arm]
            for i, row in enumerate(group[0]["rows"]):
                rows = [g["rows"][i] for g in group]
                step = row["step"]
                loss = mean([g["losses"][step - 1] for g in group]) if step else float("nan")
                probe = {f"{n}_{k}": mean([v for r in rows for v in r[f"{n}_{k}_probe"]])
                         for n in ("context", "ema") for k in READINGS}
                print(f"{arm:>9} {step:>5} {loss:>7.4f} {mean([r['context_token_change'] for r in rows]):>8.4f} "
                      f"{mean([r['ema_token_change'] for r in rows]):>8.4f} "
                      f"{probe['context_mean']:>6.3f}/{probe['context_tokens']:.3f} "
                      f"{probe['ema_mean']:>6.3f}/{probe['ema_tokens']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="work folder (the pretraining run is kept there)")
    parser.add_argument("--pretrain-updates", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=600, help="update steps of each continuation")
    parser.add_argument("--warmup", type=int, default=300, help="the warm-up measured against none")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-5, 1e-4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--token-volumes", type=int, default=32)
    parser.add_argument("--probe-volumes", type=int, default=240, help="the held-out four-class cohort's size")
    parser.add_argument("--at", type=int, nargs="+", default=[100, 200, 300, 450, 600])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=["none", "warmup"])
    parser.add_argument("--name", default="", help="suffix of the result file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine (docs: 2 threads made a step 20x slower)

    started = time.perf_counter()
    run_dir = pretrain(args.out, args.pretrain_updates)
    pretrain_summary = json.loads((run_dir / "summary.json").read_text())
    weights = pretrained(run_dir)
    runs = []
    for lr in args.lrs:
        for seed in args.seeds:
            for arm in args.arms:
                warmup = args.warmup if arm == "warmup" else 0
                runs.append(continue_run(args.out, weights, lr, seed, arm, warmup, args.steps, args.at,
                                         (args.splits, args.token_volumes, args.probe_volumes)))
                print(json.dumps({k: runs[-1][k] for k in ("lr", "seed", "arm", "elapsed_s")}), flush=True)
    report(runs)
    path = write_result("predictor_warmup" + (f"_{args.name}" if args.name else ""), {
        "machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "pretraining": {"run_dir": str(run_dir), "update_steps": pretrain_summary["update_steps"],
                        "elapsed_s": pretrain_summary["elapsed_s"]},
        "wall_s": round(time.perf_counter() - started, 1), "runs": runs})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
