"""``octfw replay RUN_DIR --step N``: rebuild the batch of update step N and
run it on the CPU from the nearest checkpoint at or before it.

Every sample's order, views and masks derive from (seed, epoch, index), so
the batch of step N is rebuilt exactly. The model state is rebuilt by
resuming from the nearest earlier checkpoint (or from the seeded
initialisation) and replaying the steps in between on the CPU. Step N then
runs with per-stage statistics: the inputs, the loss, the gradient norm per
parameter group and what the guards decide.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from octfw.display.errors import UserError
from octfw.recipe import load_recipe
from octfw.registry import Registry
from octfw.runs.checkpoint import run_checkpoints
from octfw.display.tables import render_table
from octfw.types import GuardInputs
from octfw.display.tables import counted

__all__ = ["replay"]

# On the CPU, with nothing written anywhere but a scratch folder.
REPLAY_OVERRIDES = ["run.device=cpu", "engine.num_workers=0", "engine.precision=fp32", "logger=[]",
                    "evaluator=[]", "engine.checkpoint_every_steps=1000000000"]


def _nearest_checkpoint(recipe: Any, registry: Registry, run_dir: Path, step: int) -> tuple[int, str | None]:
    """(update step, location) of the newest checkpoint before ``step``, among the run's
    (:func:`octfw.runs.checkpoint.run_checkpoints`: its fallback copy included); (0, None) when none is."""
    checkpointer = recipe.checkpointer.build(recipe.build_context(registry=registry, run_dir=run_dir))
    usable = [(s, loc) for s, loc in run_checkpoints(run_dir, checkpointer) if s < step]
    return max(usable) if usable else (0, None)


class _GradStats:
    """A guard-shaped probe: records per-group gradient norms before the optimizer step."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.seen = optimizer, None

    def before_step(self, inputs: GuardInputs):
        groups = {}
        for i, group in enumerate(self.optimizer.param_groups):
            grads = [p.grad.detach().float().norm() for p in group["params"] if p.grad is not None]
            groups[group.get("name", f"group {i}")] = float(torch.stack(grads).norm()) if grads else 0.0
        self.seen = {"loss": float(inputs.loss), "grad_norm": float(inputs.grad_norm), "groups": groups}
        return None

    def at_log_step(self, update_step: int, metrics: Any) -> None:
        return None


def _tensor_row(micro_step: int, name: str, t: torch.Tensor) -> list[str]:
    """One row of the inputs table: micro-step, key, shape, dtype, min, max, mean, non-finite."""
    t = t.detach()
    head = [str(micro_step), name, str(list(t.shape)), str(t.dtype).replace("torch.", "")]
    if not t.is_floating_point():
        return head + [str(int(t.min())), str(int(t.max())), "", ""]
    finite = torch.isfinite(t)
    shown = t[finite] if finite.any() else torch.zeros(1)
    return head + [f"{float(shown.min()):.4g}", f"{float(shown.max()):.4g}", f"{float(shown.mean()):.4g}",
                   str(int((~finite).sum()))]


def replay(run_dir: Path, step: int, registry: Registry, report: Callable[[str], None] = print) -> dict[str, Any]:
    from octfw.engine.trainer import Trainer
    from octfw.engine.plan import plan_for_folder

    recipe_file = run_dir / "recipe.toml"
    if not recipe_file.exists():
        raise UserError(f"{run_dir}: not a run directory (no recipe.toml)")
    recipe = load_recipe(recipe_file, REPLAY_OVERRIDES, registry)
    start, location = _nearest_checkpoint(recipe, registry, run_dir, step)
    with tempfile.TemporaryDirectory(prefix="octfw-replay-") as scratch:
        trainer = Trainer(plan_for_folder(recipe, registry, Path(scratch), location), registry, compare_recipe=False)
        if step > trainer.total:
            raise UserError(f"--step {step}: the run has {trainer.total} update steps")
        report(f"replay of update step {step} on the CPU, from "
               + (f"the checkpoint of step {start} ({location})" if location else "the seeded initialisation")
               + f"; replaying {counted(step - 1 - start, 'step')} first")
        for update_step in range(trainer.start_step, step - 1):
            trainer.update(update_step)

        batches: list[dict[str, Any]] = []
        source = trainer.batches
        trainer.batches = (batches.append(b) or b for b in source)
        probe = _GradStats(trainer.optimizer)
        trainer.parts.guards.insert(0, probe)
        _, out = trainer.update(step - 1)

    samples = [p for b in batches for p in b["provenance"]]
    report("samples")
    for p in samples:
        report(f"  {p.source} (domain {p.domain}, spacing {list(p.spacing)} mm)")
    report("inputs")
    rows = [_tensor_row(i + 1, key, tensor) for i, batch in enumerate(batches)
            for key, tensor in batch["tensors"].items()]
    report(render_table(["micro-step", "input", "shape", "dtype", "min", "max", "mean", "non-finite"], rows,
                        right=(0, 4, 5, 6, 7), indent=2))
    seen = probe.seen
    report(f"loss         {seen['loss']:.6g} (last micro-step per sample: "
           + ", ".join(f"{v:.4g}" for v in out.per_sample_loss.detach().tolist()) + ")")
    report(f"grad norm    {seen['grad_norm']:.6g} before clipping; per group: "
           + ", ".join(f"{k} {v:.4g}" for k, v in seen["groups"].items()))
    finite = torch.isfinite(torch.tensor([seen["loss"], seen["grad_norm"]])).all()
    report("verdict      " + ("finite loss and gradients: the update applies" if finite
                              else "non-finite loss or gradient: nan-skip skips this update"))
    return {"samples": [p.source for p in samples], "loss": seen["loss"], "grad_norm": seen["grad_norm"],
            "groups": seen["groups"], "applied": bool(finite), "from_step": start}
