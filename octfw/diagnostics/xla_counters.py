"""XLA graph hygiene of the real engine: compilations and device-to-host
transfers counted before every update step.

Used by ``tests/xla/engine_hygiene.py`` (the hygiene test) and
``benchmarks/engine/xla_hygiene.py``. It imports torch_xla, which patches torch for
the whole process: call it only in a process of its own, e.g.
``PJRT_DEVICE=CPU python -m octfw.diagnostics.xla_counters RECIPE STEPS [LOG_EVERY]``,
which prints the result as one JSON line.

The run: the recipe on ``run.device = "xla"`` with gradient accumulation 2,
three guards (nan-skip, grad-clip, lr-positive), EMA (the model's own) and
logging every ``log_every`` update steps; a one-layer model keeps it fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["HYGIENE_OVERRIDES", "counted_run", "summarize"]

HYGIENE_OVERRIDES = (
    "run.device=xla", "engine.grad_accum_steps=2", "engine.checkpoint_every_steps=100000",
    'guard=[{name="nan-skip"},{name="grad-clip"},{name="lr-positive"}]',
    "model.depth=1", "model.predictor_depth=1",
)


def counted_run(recipe_path: Path, steps: int, log_every: int = 10, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train ``steps`` update steps; rows of counters taken before each update step."""
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl

    from octfw.engine.trainer import Trainer
    from octfw.engine.plan import plan_for_folder
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry
    from octfw.runs.folder import create_run_dir

    registry = load_registry()
    recipe = load_recipe(recipe_path, [*HYGIENE_OVERRIDES, f"run.max_steps={steps}",
                                       f"engine.log_every_steps={log_every}", *overrides], registry)
    loaders = []
    original_init = pl.MpDeviceLoader.__init__

    def counting_init(self, *args, **kwargs):
        loaders.append(self)
        original_init(self, *args, **kwargs)

    def counters() -> dict[str, int]:
        compiles = met.metric_data("CompileTime")
        transfers = met.metric_data("TransferFromDeviceTime")
        return {"compiles": compiles[0] if compiles else 0,
                "transfers": transfers[0] if transfers else 0,
                "item_calls": met.counter_value("aten::_local_scalar_dense") or 0}

    pl.MpDeviceLoader.__init__ = counting_init
    try:
        trainer = Trainer(plan_for_folder(recipe, registry, create_run_dir(recipe, registry)), registry)
        rows: list[dict[str, int]] = []
        update = trainer.update

        def recorded_update(update_step: int):
            rows.append({"step": update_step, **counters()})
            return update(update_step)

        trainer.update = recorded_update
        summary = trainer.run()
    finally:
        pl.MpDeviceLoader.__init__ = original_init
    return {"rows": rows, "end": counters(), "mp_device_loaders": len(loaders),
            "update_steps": summary.update_steps, "log_every": log_every}


def summarize(result: dict[str, Any], warm_up: int | None = None) -> dict[str, Any]:
    """Compilations after warm-up and transfers on log and non-log steps.

    Row i holds the counters before update step i (0-based), so step i's own
    work is ``rows[i + 1] - rows[i]`` (the last step against ``end``). Warm-up
    is the first ``log_every + 2`` steps: the first steps (optimizer state
    appears at step 1) and the first log step (its read graph, and the step
    after it). The last update step also ends the run (final log, checkpoint,
    summary); its counts are reported apart as ``end_of_run_*``."""
    rows, log_every = result["rows"], result["log_every"]
    warm_up = log_every + 2 if warm_up is None else warm_up
    after = [*rows[1:], {"step": len(rows), **result["end"]}]
    per_step = [{"done": r["step"] + 1, "compiles": a["compiles"] - r["compiles"],
                 "transfers": a["transfers"] - r["transfers"], "item_calls": a["item_calls"] - r["item_calls"]}
                for r, a in zip(rows, after)]
    steady, last = per_step[warm_up:-1], per_step[-1]
    log_steps = [s for s in steady if s["done"] % log_every == 0]
    other = [s for s in steady if s["done"] % log_every]
    return {
        "update_steps": len(per_step), "warm_up_steps": warm_up,
        "compiles_in_warm_up": sum(s["compiles"] for s in per_step[:warm_up]),
        "compiles_after_warm_up": sum(s["compiles"] for s in steady),
        "compiles_per_step_after_warm_up": sum(s["compiles"] for s in steady) / max(len(steady), 1),
        "transfers_per_log_step": sum(s["transfers"] for s in log_steps) / max(len(log_steps), 1),
        "transfers_per_non_log_step": sum(s["transfers"] for s in other) / max(len(other), 1),
        "non_log_steps_with_transfers": sum(1 for s in other if s["transfers"]),
        "end_of_run_compiles": last["compiles"], "end_of_run_transfers": last["transfers"],
        "item_calls_in_loop": sum(s["item_calls"] for s in per_step[:-1]),
        "mp_device_loaders": result["mp_device_loaders"],
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    out = counted_run(Path(args[0]), int(args[1]), int(args[2]) if len(args) > 2 else 10)
    print(json.dumps(out))
