"""Optimizer step: octfw's GatedAdamW against torch.optim.AdamW on the same
parameters and gradients (the quickstart's vjepa3d ``tiny``), in one process.

Sides, each timed in alternating blocks of ``--block`` steps (host tracing
and execution, synchronised at block ends):

- ``torch-default``: ``torch.optim.AdamW`` as one writes it, torch's defaults
  for the device (per-tensor on the CPU and on xla);
- ``torch-foreach`` (CPU) / ``torch-capturable`` (xla): torch's AdamW as octfw
  built it before GatedAdamW: multi-tensor on the CPU, per-tensor with device
  step counts on xla;
- ``gated``: GatedAdamW without a verdict (a run without guards);
- ``gated-verdict``: GatedAdamW given a device verdict (a run with guards).

On xla it also times the host-side tracing of single ops over the 83
parameter tensors, in place against out of place: the reason GatedAdamW and
the EMA update are written with out-of-place ops and one copy back.

Prints one line per figure, ratios against ``torch-default``, and writes
``benchmarks/results/optimizer_step.json``.

    PJRT_DEVICE=CPU python benchmarks/engine/optimizer_step.py [--device both|cpu|xla] [--rounds 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common.py, shared by every group

from _common import ROOT, alternate, make_trainer, median, publish, xla_side  # noqa: E402

RECIPE = ROOT / "recipes" / "quickstart.toml"


def make_sides(device: str):
    """The timed sides, the device's synchronize, and the parameter tensors."""
    import copy

    import torch

    from octfw.engine.optim import GatedAdamW

    trainer, _ = make_trainer(RECIPE, [f"run.device={device}", "guard=[]"])
    engine, dev, boundary = trainer.recipe.engine, trainer.backend.device, trainer.backend.step_boundary
    hyper = {"lr": engine.base_lr, "betas": engine.betas, "eps": engine.eps}
    applied = torch.ones((), dtype=torch.bool, device=dev)
    builders = {
        "torch-default": lambda groups: torch.optim.AdamW(groups, **hyper),
        ("torch-capturable" if device == "xla" else "torch-foreach"):
            (lambda groups: torch.optim.AdamW(groups, **hyper, foreach=False, capturable=True)) if device == "xla"
            else (lambda groups: torch.optim.AdamW(groups, **hyper, foreach=True)),
        "gated": lambda groups: GatedAdamW(groups, **hyper),
        "gated-verdict": lambda groups: GatedAdamW(groups, **hyper),
    }
    sides = {}
    for name, build in builders.items():
        generator = torch.Generator().manual_seed(0)
        model = copy.deepcopy(trainer.model)
        for p in model.parameters():
            if p.requires_grad:  # the same fixed gradients on every side, kept across steps
                p.grad = (torch.randn(p.shape, generator=generator) * 1e-3).to(dev)
        optimizer = build(model.param_groups(engine.weight_decay))
        step = (lambda o=optimizer: o.step(applied)) if name == "gated-verdict" else optimizer.step
        sides[name] = lambda update, log, step=step: (step(), boundary())  # one graph per step on xla
    return sides, trainer.backend.synchronize, trainer.parameters


def op_tracing(parameters: list) -> dict[str, float]:
    """Host microseconds per tensor to trace one op over every parameter tensor."""
    import torch
    import torch_xla

    a = [p.detach().clone() for p in parameters]
    b = [p.detach().clone() + 1 for p in parameters]
    c = [p.detach().clone() + 2 for p in parameters]
    torch_xla.sync()
    ops = {
        "mul in place (_foreach_mul_)": lambda: torch._foreach_mul_(a, 0.999),
        "mul out of place (_foreach_mul)": lambda: torch._foreach_mul(b, 0.999),
        "addcmul in place (_foreach_addcmul_)": lambda: torch._foreach_addcmul_(a, b, c, value=0.1),
        "addcmul out of place (mul, add)": lambda: torch._foreach_add(b, torch._foreach_mul(b, c), alpha=0.1),
        "lerp in place (_foreach_lerp_)": lambda: torch._foreach_lerp_(a, b, 0.1),
        "lerp out of place (sub, mul, add)": lambda: torch._foreach_add(b, torch._foreach_mul(torch._foreach_sub(c, b), 0.1)),
        "copy back (_foreach_copy_)": lambda: torch._foreach_copy_(a, b),
    }
    result = {}
    for name, op in ops.items():
        best = float("inf")
        for _ in range(6):
            started = time.perf_counter()
            with torch.no_grad():
                op()
            best = min(best, time.perf_counter() - started)
            torch_xla.sync()
        result[name] = best / len(parameters) * 1e6
    return result


def measure(device: str, rounds: int, block: int) -> dict:
    sides, sync, parameters = make_sides(device)
    times = alternate(sides, rounds=rounds, block=block, log_every=10**9, sync=sync)
    base = times["torch-default"]
    figures = {name: {"step_s": median(t), "ratio_to_torch_default": median([x / y for x, y in zip(t, base)]),
                      "blocks_s": t} for name, t in times.items()}
    result = {"device": device, "rounds": rounds, "block": block, "figures": figures}
    if device == "xla":
        result["op_tracing_us_per_tensor"] = op_tracing(parameters)
        result["tensors"] = len(parameters)
    return result


def report(result: dict) -> None:
    for name, f in result["figures"].items():
        print(f"optimizer step [{result['device']}, {name}]: {f['step_s'] * 1e3:.2f} ms/step, "
              f"{f['ratio_to_torch_default']:.3f}x torch-default (median of paired blocks)")
    for name, us in result.get("op_tracing_us_per_tensor", {}).items():
        print(f"xla op tracing [{name}]: {us:.1f} us per tensor ({result['tensors']} tensors)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["both", "cpu", "xla"], default="both")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    results = []
    if args.device in ("both", "cpu"):
        results.append(measure("cpu", args.rounds, args.block))
    if args.device == "xla":
        results.append(measure("xla", args.rounds, args.block))
    if args.device == "both":
        results += xla_side(__file__, ["--rounds", str(args.rounds), "--block", str(args.block)])
    publish("optimizer_step", results, args.json_only, report)


if __name__ == "__main__":
    main()
