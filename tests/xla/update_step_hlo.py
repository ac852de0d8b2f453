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

from octfw.tools.xla_counters import counted_run
from octfw.tools.xla_hlo import compiled_modules, module_report, record_update_steps

recipe, steps, log_every, dump, tokens = (Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                          Path(sys.argv[4]), int(sys.argv[5]))

with record_update_steps(dump) as records:  # counted_run's own per-instance wrapper calls this one
    hygiene = counted_run(recipe, steps, log_every, tuple(sys.argv[6:]))
trainer = records[0].pop("trainer")
sizes = [p.numel() for p in trainer.parameters]
compiled_in = {name: r["step"] for r in records for name in r["compiled"]}
modules = [{**module_report(path, sizes, [tokens]), "compiled_in_update_step": compiled_in.get(path.name)}
           for path in compiled_modules(dump)]

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
