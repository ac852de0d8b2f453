"""Run by tests/test_xla_engine.py in its own process (torch_xla patches torch
process-wide). Trains with the real engine on the XLA CPU device and prints,
as JSON, the compile and device-to-host transfer counters before every update
step."""

import json
import sys
from pathlib import Path

import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl

from octfw.engine.trainer import Trainer
from octfw.recipe import load_recipe
from octfw.registry import load_registry
from octfw.rundir import create_run_dir

recipe_path, steps = Path(sys.argv[1]), int(sys.argv[2])
registry = load_registry()
recipe = load_recipe(recipe_path, [
    "run.device=xla", f"run.max_steps={steps}", "engine.log_every_steps=10", "engine.grad_accum_steps=2",
    "engine.checkpoint_every_steps=1000", 'guard=[{name="nan-skip"},{name="grad-clip"},{name="lr-positive"}]',
    "model.depth=1", "model.predictor_depth=1",
], registry)

loaders = []
original_init = pl.MpDeviceLoader.__init__


def counting_init(self, *args, **kwargs):
    loaders.append(self)
    original_init(self, *args, **kwargs)


pl.MpDeviceLoader.__init__ = counting_init


def counters():
    compiles = met.metric_data("CompileTime")
    transfers = met.metric_data("TransferFromDeviceTime")
    return {"compiles": compiles[0] if compiles else 0,
            "transfers": transfers[0] if transfers else 0,
            "item_calls": met.counter_value("aten::_local_scalar_dense") or 0}


trainer = Trainer(recipe, registry, create_run_dir(recipe, registry))
rows = []
update = trainer.update


def recorded_update(update_step):
    rows.append({"step": update_step, **counters()})
    return update(update_step)


trainer.update = recorded_update
summary = trainer.run()
print(json.dumps({"rows": rows, "mp_device_loaders": len(loaders), "update_steps": summary.update_steps,
                  "ema_momentum_logged": True}))
