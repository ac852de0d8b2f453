"""Run by tests/test_xla_update_step.py in its own process (torch_xla patches
torch process-wide), with PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4 (four virtual
SPMD devices) and XLA_FLAGS asking XLA to dump every compiled module as text
into DUMP (octfw.tools.xla_hlo.dump_flags).

The real engine, as the hygiene run of octfw.tools.xla_counters builds it
(gradient accumulation 2, three guards, EMA), for STEPS update steps logging
every LOG_EVERY. Recorded for each update step: the modules XLA compiled
during it and the graphs it executed. Then each compiled module's
collectives, paired with the trainable gradients, and the attention buffers
of TOKENS x TOKENS it materialises. Prints one JSON object.

    python update_step_hlo.py RECIPE STEPS LOG_EVERY DUMP TOKENS [OVERRIDE ...]
"""

import json
import sys
from pathlib import Path

import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from octfw.engine.trainer import Trainer
from octfw.tools.xla_counters import counted_run
from octfw.tools.xla_hlo import (collective_totals, collectives, compiled_modules, gradient_rounds, match_gradients,
                                 trailing_square_buffers, unoptimized)

recipe, steps, log_every, dump, tokens = (Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                          Path(sys.argv[4]), int(sys.argv[5]))
overrides = tuple(sys.argv[6:])


def executions() -> int:
    """Graphs executed so far (SPMD programs count as ExecuteReplicated)."""
    return sum((met.metric_data(name) or (0,))[0] for name in ("ExecuteTime", "ExecuteReplicatedTime"))


records: list[dict] = []
trainers: list[Trainer] = []
real_update = Trainer.update


def recorded_update(self, update_step):
    if not trainers:
        trainers.append(self)
    known, ran = set(compiled_modules(dump)), executions()
    result = real_update(self, update_step)
    # Executions are counted when they finish; compilation already happened in the sync.
    xm.wait_device_ops()
    records.append({"step": update_step, "executions": executions() - ran,
                    "compiled": [p.name for p in compiled_modules(dump) if p not in known]})
    return result


Trainer.update = recorded_update  # counted_run's own per-instance wrapper calls this one
hygiene = counted_run(recipe, steps, log_every, overrides)

trainer = trainers[0]
sizes = [p.numel() for p in trainer.parameters]
compiled_in = {name: r["step"] for r in records for name in r["compiled"]}
modules = []
for path in compiled_modules(dump):
    text = path.read_text()
    ops = collectives(text)
    all_reduces = [op for op in ops if op.opcode.startswith("all-reduce")]
    rounds = gradient_rounds(all_reduces, sizes)
    match = match_gradients(all_reduces, sizes, rounds=max(rounds, 1))
    scores_before = [op for op in trailing_square_buffers(unoptimized(path).read_text(), tokens) if op.opcode == "dot"]
    modules.append({
        "name": path.name, "compiled_in_update_step": compiled_in.get(path.name),
        "collectives": collective_totals(ops),
        "all_reduce_dtypes": sorted({a.dtype for op in all_reduces for a in op.arrays}),
        "gradient_rounds": rounds, "missing": match.missing, "gradient_bytes": match.gradient_bytes,
        "extra": [{"dims": [list(a.dims) for a in op.arrays], "dtype": op.arrays[0].dtype, "op_type": op.op_type}
                  for op in match.extra],
        "extra_bytes": match.extra_bytes,
        "all_gathers": [{"dims": list(op.arrays[0].dims), "op_type": op.op_type}
                        for op in ops if op.opcode == "all-gather"],
        "attention_buffers": [{"opcode": op.opcode, "dtype": op.arrays[0].dtype, "dims": list(op.arrays[0].dims),
                               "op_type": op.op_type} for op in trailing_square_buffers(text, tokens)],
        "attention_score_dots_before_optimization": [{"dtype": op.arrays[0].dtype, "dims": list(op.arrays[0].dims)}
                                                     for op in scores_before],
    })

backend = trainer.backend
print(json.dumps({
    "hygiene": hygiene, "update_steps": records, "modules": modules,
    "gradients": {"count": len(sizes), "sizes": sizes,
                  "bytes": sum(p.numel() * p.element_size() for p in trainer.parameters),
                  "dtypes": sorted({str(p.dtype) for p in trainer.parameters})},
    "spmd": {"device_count": backend.device_count, "local_devices": backend.local_devices,
             "mesh_shape": list(backend.mesh.mesh_shape), "precision": backend.precision},
    "grad_accum_steps": trainer.recipe.engine.grad_accum_steps,
    "per_device_batch": trainer.recipe.engine.per_device_batch,
    "heads": {"encoder": trainer.model.context_encoder.blocks[0].attn.num_heads,
              "predictor": trainer.model.predictor.blocks[0].attn.num_heads},
}))
