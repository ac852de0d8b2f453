"""How much can an encoder gain on the reversal task at all? An encoder trained with the labels.

Issue #39's targets on the context family's reversal task ask a pretrained
encoder to beat a random one by 0.15 balanced accuracy under the attentive
probe and 10-shot fine-tuning, and by 0.10 Dice under the frozen dense probe.
Every pretraining method missed them (``family_gain.py``, ``docs/evaluation.md``).
This measures what the same readers make of an encoder that *does* know the
finding: the ``tiny`` encoder of a ``family_gain.py`` export, randomly
initialised with a run's seed (the same network the probes compare against),
trained **supervised** on labels and finding masks (``--volumes`` of the
context family, cohort seed 0 like the pretraining cohort's 240, no volume
shared with the probed cohort; a fifth of its patients held out to show the
training generalises) with an attentive classification head and a token and
voxel mask head, then probed exactly as ``family_gain.py probe`` probes a
pretrained encoder (the context family's 200 labelled volumes, cohort seed 1,
``--splits`` patient-level splits, every reader, one torch thread).

If the readers give a supervised encoder the target's gains, the targets are
within what these readers can show and pretraining is what falls short; if
they do not, no pretraining method can meet them on this task with these
readers.

    cd benchmarks
    PJRT_DEVICE=CPU python supervised_ceiling.py --template /tmp/fg/encoders/vjepa3d_context_seed0.pt \
        --volumes 2000 --epochs 60 --out /tmp/supervised --name v2000
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import machine, write_result  # noqa: E402
from family_gain import PRETRAIN_VOLUMES, PROBES, eval_recipe, format_table, score_encoder, summarise  # noqa: E402

FAMILY = "context"
PRETRAIN_SEED = 0  # family_gain's pretraining cohort of every setting
HOLD_OUT = 0.2  # of the supervised cohort's patients, to show the training generalises


class Supervised(nn.Module):
    """The encoder under an attentive class head (fine-tuning's) and linear token and voxel mask heads."""

    def __init__(self, encoder: nn.Module, patch_voxels: int, num_heads: int, generator: torch.Generator):
        from octfw.evaluation.attentive import AttentiveHead

        super().__init__()
        width = encoder.embed_dim
        self.encoder = encoder
        self.classify = AttentiveHead(width, 2, num_heads, generator)
        self.norm = nn.LayerNorm(width)
        self.token = nn.Linear(width, 1)
        self.voxel = nn.Linear(width, patch_voxels)

    def forward(self, volumes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = self.encoder(volumes)
        normed = self.norm(tokens)
        return self.classify(tokens), self.token(normed)[..., 0], self.voxel(normed)


def supervised_cohort(target: Any, registry: Any, work: Path,
                      volumes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """(volumes [N, C, D, H, W], labels [N], patchified masks [N, T, P] bool, patient groups) of
    ``volumes`` of the pretraining cohort's family and seed, prepared as the encoder's training
    prepared its volumes."""
    from octfw.evaluation.segmentation import load_masked
    from octfw.evaluation.target import build_evaluators, load_eval_recipe
    from octfw.plugins.evaluators.dense_probe.algorithm import patchify

    recipe_path = eval_recipe(work, 0, 0, volumes, {}, ["dense-probe"], FAMILY, cohort_seed=PRETRAIN_SEED)
    ((_, dense),) = build_evaluators(target, load_eval_recipe(recipe_path, [], registry), registry)
    cohort = load_masked(dense.train_dataset, dense.transform, where="supervised cohort")
    masks = patchify(torch.from_numpy(np.stack(cohort.masks)), dense.patch_size)
    return (torch.from_numpy(np.stack(cohort.volumes)), torch.from_numpy(cohort.labels), masks,
            cohort.groups or [str(i) for i in range(len(cohort))])


def train_supervised(encoder: nn.Module, data: tuple, seed: int, epochs: int, batch_size: int,
                     lr: float) -> tuple[nn.Module, list[dict[str, float]]]:
    """Train a copy of ``encoder`` on the cohort's labels and masks; (encoder, per-epoch log)."""
    from octfw.evaluation.metrics import balanced_accuracy
    from octfw.plugins.evaluators.dense_probe.algorithm import _soft_dice_loss as dice_loss, token_truth

    volumes, labels, patches, groups = data
    rng = np.random.default_rng(seed)
    patients = sorted(set(groups))
    held = set(rng.permutation(patients)[:round(HOLD_OUT * len(patients))].tolist())
    fit = torch.tensor([g not in held for g in groups])
    generator = torch.Generator().manual_seed(seed)
    network = Supervised(copy.deepcopy(encoder).train().requires_grad_(True), patches.shape[-1], 12, generator)
    with torch.no_grad():
        network.classify.standardise_on(network.encoder(volumes[fit][:32]))
    optimiser = torch.optim.AdamW(network.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * math.ceil(int(fit.sum()) / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda k: min(1.0, (k + 1) / (0.05 * steps)) * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps)))
    fit_index = torch.nonzero(fit)[:, 0]
    held_index = torch.nonzero(~fit)[:, 0]
    log = []
    for epoch in range(epochs):
        network.train()
        order = fit_index[torch.randperm(len(fit_index), generator=generator)]
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            class_logits, token_logits, voxel_logits = network(volumes[batch])
            voxels = patches[batch].float()
            tokens = token_truth(patches[batch], "any").float()  # the dense probe's default
            loss = (F.cross_entropy(class_logits, labels[batch])
                    + F.binary_cross_entropy_with_logits(voxel_logits, voxels) + dice_loss(voxel_logits, voxels)
                    + F.binary_cross_entropy_with_logits(token_logits, tokens) + dice_loss(token_logits, tokens))
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
        if (epoch + 1) % 10 == 0 or epoch + 1 == epochs:
            network.eval()
            scores = {}
            for name, index in (("fit", fit_index), ("held_out", held_index)):
                with torch.no_grad():
                    logits = torch.cat([network(volumes[chunk])[0] for chunk in index.split(16)])
                scores[name] = round(balanced_accuracy(labels[index].numpy(), logits.argmax(dim=1).numpy()), 3)
            log.append({"epoch": epoch + 1, "loss": round(float(loss.detach()), 4), **scores})
            print(f"seed {seed} epoch {epoch + 1}: loss {float(loss.detach()):.3f}, balanced accuracy fit "
                  f"{scores['fit']:.3f}, held-out patients {scores['held_out']:.3f}", flush=True)
    return network.encoder.eval().requires_grad_(False), log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", type=Path, required=True,
                        help="an encoder family_gain.py exported (its architecture, transform and recipe)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--volumes", type=int, default=PRETRAIN_VOLUMES,
                        help="labelled volumes to train on (the pretraining cohort's family and seed)")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--probes", nargs="+", default=list(PROBES), choices=PROBES)
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the trained encoders (supervised_seed<N>.pt); one already there is "
                             "probed again rather than trained again (default: a new temporary folder)")
    parser.add_argument("--name", default="", help="result file suffix")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from octfw.exports.pretrained import load_encoder
    from octfw.evaluation.target import build_evaluators, load_eval_recipe, load_target
    from octfw.exports.writing import write_export
    from octfw.registry import load_registry

    started = time.perf_counter()
    registry = load_registry()
    work = args.out or Path(tempfile.mkdtemp(prefix="octfw-supervised-"))
    work.mkdir(parents=True, exist_ok=True)
    info = {k: v for k, v in load_encoder(args.template).info.items()}
    records, training = [], []
    data = None
    for seed in args.seeds:
        path = work / f"supervised_seed{seed}.pt"
        if path.exists():
            print(f"seed {seed}: probing {path} again (its training log is in the earlier result)", flush=True)
        else:
            template = load_target(args.template, seed, registry)
            data = data or supervised_cohort(template, registry, work, args.volumes)
            print(f"seed {seed}: training on {len(data[0])} volumes ({int(data[1].sum())} with the finding)",
                  flush=True)
            encoder, log = train_supervised(template.random_init.encoder, data, seed, args.epochs,
                                            args.batch_size, args.lr)
            write_export("octfw", path, encoder, {**info, "update_step": args.epochs})
            training.append({"seed": seed, "log": log})
        target = load_target(path, seed, registry)  # random_init: the same seed's network as family_gain's
        for split_seed in range(args.splits):
            recipe = load_eval_recipe(eval_recipe(work, split_seed, seed, 200, {}, args.probes, FAMILY), [], registry)
            evaluators = build_evaluators(target, recipe, registry)
            records.append({"method": "supervised", "setting": FAMILY, "seed": seed, "split_seed": split_seed,
                            "pretrained": score_encoder(target.pretrained, evaluators, split_seed, 10),
                            "random_init": score_encoder(target.random_init, evaluators, split_seed, 10)})
            print(f"probed seed {seed} split {split_seed} ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = summarise(records)
    print(format_table(rows))
    path = write_result("supervised_ceiling" + (f"_{args.name}" if args.name else ""), {
        "machine": machine(), "template": str(args.template), "template_job_update_step": info.get("update_step"),
        "training": {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "hold_out": HOLD_OUT,
                     "cohort": {"family": FAMILY, "volumes": args.volumes, "seed": PRETRAIN_SEED},
                     "runs": training},
        "eval": {"family": FAMILY, "volumes": 200, "splits": args.splits, "fine_tune_shots": 10,
                 "probes": args.probes},
        "table": rows, "records": records, "seconds": round(time.perf_counter() - started, 1)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
