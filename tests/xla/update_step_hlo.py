"""Run by tests/test_xla_update_step.py in its own process (torch_xla patches
torch process-wide), with PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4 (four virtual
SPMD devices) and XLA_FLAGS asking XLA to dump every compiled module as text
into DUMP (octfw.diagnostics.xla_hlo.dump_flags).

The real engine, as the hygiene run of octfw.diagnostics.xla_counters builds it
(gradient accumulation 2, three guards, EMA), for STEPS update steps logging
every LOG_EVERY. Recorded for each update step: the modules XLA compiled
during it and the graphs it executed. Then each compiled module's
collectives, paired with the trainable gradients, and the attention buffers
of TOKENS x TOKENS it materialises; the schedule's values at each update
step; and octfw's LayerNorm on an xla tensor against F.layer_norm on the
CPU (output and gradients). Prints one JSON object.

    python update_step_hlo.py RECIPE STEPS LOG_EVERY DUMP TOKENS [OVERRIDE ...]
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from octfw.diagnostics.xla_counters import counted_run
from octfw.diagnostics.xla_hlo import compiled_modules, module_report, record_update_steps
from octfw.models.vit3d import LayerNorm

recipe, steps, log_every, dump, tokens = (Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                          Path(sys.argv[4]), int(sys.argv[5]))

with record_update_steps(dump) as records:  # counted_run's own per-instance wrapper calls this one
    hygiene = counted_run(recipe, steps, log_every, tuple(sys.argv[6:]))
trainer = records[0].pop("trainer")
sizes = [p.numel() for p in trainer.parameters]
compiled_in = {name: r["step"] for r in records for name in r["compiled"]}
modules = [{**module_report(path, sizes, [tokens]), "compiled_in_update_step": compiled_in.get(path.name)}
           for path in compiled_modules(dump)]


def layer_norm_on_xla(device) -> dict:
    """Largest differences between octfw's LayerNorm on ``device`` (written
    out there) and F.layer_norm's fused CPU kernel: output, input and
    parameter gradients, in float32; and the output dtype under bf16 autocast."""
    torch.manual_seed(0)
    norm = LayerNorm(48)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1.0, 1.0)
    x = torch.randn(2, 12, 48) * 3.0 + 1.5
    upstream = torch.randn(2, 12, 48)
    cpu_x = x.clone().requires_grad_()
    weight, bias = norm.weight.detach().clone().requires_grad_(), norm.bias.detach().clone().requires_grad_()
    expected = F.layer_norm(cpu_x, (48,), weight, bias, norm.eps)
    expected.backward(upstream)
    norm.to(device)
    xla_x = x.to(device).requires_grad_()
    out = norm(xla_x)
    out.backward(upstream.to(device))
    with torch.autocast("xla", dtype=torch.bfloat16):
        autocast_dtype = norm(xla_x.detach().bfloat16()).dtype
    pairs = {"output": (out, expected), "input_grad": (xla_x.grad, cpu_x.grad),
             "weight_grad": (norm.weight.grad, weight.grad), "bias_grad": (norm.bias.grad, bias.grad)}
    return {"max_abs_diff": {k: (a.cpu() - b).abs().max().item() for k, (a, b) in pairs.items()},
            "dtype": str(out.dtype), "autocast_dtype": str(autocast_dtype)}


backend = trainer.backend
schedule = trainer.parts.scheduler
print(json.dumps({
    "hygiene": hygiene, "update_steps": records, "modules": modules,
    "gradients": {"count": len(sizes), "sizes": sizes,
                  "bytes": sum(p.numel() * p.element_size() for p in trainer.parameters),
                  "dtypes": sorted({str(p.dtype) for p in trainer.parameters})},
    "spmd": {"device_count": backend.device_count, "local_devices": backend.local_devices,
             "mesh_shape": list(backend.mesh.mesh_shape), "precision": backend.precision},
    "schedule": {"ema_momentum": [schedule.ema_momentum(s) for s in range(steps)],
                 "lr": [schedule.lr(s) for s in range(steps)]},
    "layer_norm": layer_norm_on_xla(backend.device),
    "grad_accum_steps": trainer.recipe.engine.grad_accum_steps,
    "per_device_batch": trainer.recipe.engine.per_device_batch,
    "embed_dim": trainer.model.context_encoder.norm.weight.numel(),
    "heads": {"encoder": trainer.model.context_encoder.blocks[0].attn.num_heads,
              "predictor": trainer.model.predictor.blocks[0].attn.num_heads},
}))
