"""Record V-JEPA's learning-rate, weight-decay and EMA-momentum schedules step by step.

Runs facebookresearch/vjepa2's own code at the commit in ``_reference.REFERENCES``:
``app.vjepa.utils.init_opt`` (which builds ``WarmupCosineSchedule`` or, for a
cooldown, ``LinearDecaySchedule``, and ``CosineWDSchedule``) on a two-layer
stand-in network, and the EMA momentum generator of ``app/vjepa/train.py``
(that one expression, read from the file and evaluated, so nothing is
retyped). The loop steps them as ``train.py`` does: the LR and weight-decay
schedulers once before each update, the momentum once after it.

The configurations are the published optimisation tables, shortened the way
the reference sizes a run, through ``ipe`` (iterations per epoch); everything
else is as published:

- ``vitl16-pretrain``: configs/train/vitl16/pretrain-256px-16f.yaml, ipe 6. As
  published (10 epochs, a 40-epoch warmup) the run never leaves its warmup;
- ``vitl16-pretrain-50ep``: the same with 50 epochs, so the run passes the
  warmup into the constant phase (lr = final_lr);
- ``vitl16-cooldown``: configs/train/vitl16/cooldown-256px-64f.yaml, ipe 8
  (the linear anneal);
- ``vjepa1-vitl16``: facebookresearch/jepa's configs/pretrain/vitl16.yaml
  optimisation table (cosine LR to final_lr, weight decay 0.04 -> 0.4, EMA
  0.998 -> 1.0), ipe 1, run through vjepa2's same code.

Usage (the reference's imports beyond octfw's venv in a folder of their own)::

    PYTHONPATH=/tmp/refdeps .venv/bin/python tools/parity/schedules.py --vjepa2 /tmp/ref/vjepa2
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import yaml

from _reference import REFERENCES, checkout, write_fixture

# The V-JEPA (1) ViT-L/16 optimisation table, facebookresearch/jepa configs/pretrain/vitl16.yaml.
JEPA_VITL16 = {
    "ipe": 300, "ipe_scale": 1.25, "weight_decay": 0.04, "final_weight_decay": 0.4, "epochs": 300,
    "warmup": 40, "start_lr": 0.0002, "lr": 0.000625, "final_lr": 1.0e-06, "ema": [0.998, 1.0],
}

CONFIGURATIONS = {
    "vitl16-pretrain": ("vjepa2:configs/train/vitl16/pretrain-256px-16f.yaml", {"ipe": 6}),
    "vitl16-pretrain-50ep": ("vjepa2:configs/train/vitl16/pretrain-256px-16f.yaml", {"ipe": 6, "epochs": 50}),
    "vitl16-cooldown": ("vjepa2:configs/train/vitl16/cooldown-256px-64f.yaml", {"ipe": 8}),
    "vjepa1-vitl16": ("jepa:configs/pretrain/vitl16.yaml", {"ipe": 1}),
}


def momentum_expression(root: Path) -> ast.Expression:
    """The right-hand side of ``momentum_scheduler = ...`` in app/vjepa/train.py."""
    tree = ast.parse((root / "app" / "vjepa" / "train.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "momentum_scheduler" for t in node.targets
        ):
            return ast.Expression(body=node.value)
    raise SystemExit("app/vjepa/train.py: no momentum_scheduler assignment")


def record(root: Path, opt: dict) -> dict:
    import torch
    from app.vjepa.utils import init_opt

    encoder, predictor = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    ipe, epochs, ipe_scale = opt["ipe"], opt["epochs"], opt["ipe_scale"]
    _, _, scheduler, wd_scheduler = init_opt(
        is_anneal=opt.get("is_anneal", False), encoder=encoder, predictor=predictor,
        wd=float(opt["weight_decay"]), final_wd=float(opt["final_weight_decay"]),
        start_lr=opt["start_lr"], ref_lr=opt["lr"], final_lr=opt["final_lr"],
        iterations_per_epoch=ipe, warmup=opt["warmup"], num_epochs=epochs, ipe_scale=ipe_scale,
    )
    momentum = eval(compile(momentum_expression(root), "train.py", "eval"),
                    # one namespace: a generator expression does not see eval's locals
                    {"range": range, "int": int, "ema": opt["ema"], "ipe": ipe, "num_epochs": epochs,
                     "ipe_scale": ipe_scale})
    lr, wd, ema = [], [], []
    for _ in range(epochs * ipe):  # train.py: for epoch ...: for itr in range(ipe)
        lr.append(float(scheduler.step()))
        wd.append(float(wd_scheduler.step()))
        ema.append(float(next(momentum)))
    return {"steps": epochs * ipe, "lr": lr, "weight_decay": wd, "ema_momentum": ema}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vjepa2", required=True, help="a checkout of facebookresearch/vjepa2")
    args = parser.parse_args()
    root = Path(args.vjepa2).resolve()
    reference = checkout("vjepa2", root)
    configurations = {}
    for name, (source, overrides) in CONFIGURATIONS.items():
        repo, path = source.split(":", 1)
        opt = dict(JEPA_VITL16) if repo == "jepa" else yaml.safe_load((root / path).read_text())["optimization"]
        opt.update(overrides)
        keys = ("ipe", "ipe_scale", "epochs", "warmup", "start_lr", "lr", "final_lr",
                "weight_decay", "final_weight_decay", "ema", "is_anneal")
        configurations[name] = {
            "source": f"{REFERENCES[repo][0]} {path}", "overrides": overrides,
            "optimization": {k: opt[k] for k in keys if k in opt},
            **record(root, opt),
        }
    write_fixture("schedules.json", {
        "what": "V-JEPA's LR (WarmupCosineSchedule / LinearDecaySchedule), weight decay "
                "(CosineWDSchedule) and EMA momentum (app/vjepa/train.py) at each update step, "
                "from app.vjepa.utils.init_opt; regenerate with tools/parity/schedules.py",
        "reference": reference,
        "configurations": configurations,
    })


if __name__ == "__main__":
    main()
