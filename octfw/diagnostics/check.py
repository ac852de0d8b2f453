"""``octfw check``: build every component and push one real batch through the
pipeline on the CPU, verifying each stage boundary before an accelerator hour
is spent."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from octfw.engine.build import build_components, check_schedule
from octfw.engine.collate import collate, float_views, view_keys
from octfw.engine.data import SampleSource
from octfw.engine.domains import domain_counts, listed
from octfw.engine.distributed import layout_for, step_time
from octfw.engine.update import grad_norm
from octfw.display.errors import ContractError
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.display.tables import counted
from octfw.types import BatchKey, CountingModel, ModelOutput, mask_keys

__all__ = ["check_recipe"]



def _describe(t: Any) -> str:
    if torch.is_tensor(t) or isinstance(t, np.ndarray):
        return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
    return type(t).__name__


def check_batch_contract(tensors: dict[str, torch.Tensor], spec: dict[str, BatchKey],
                         num_patches: int | None, mask_pairs: tuple[str, ...] = ("",)) -> None:
    """The collated batch against the transform's declaration, as the model will get it: views
    float32, every key of its declared shape and dtype; each mask configuration's patch indices
    (:func:`octfw.types.mask_keys` of ``mask_pairs``) inside the grid (a ``[D, H, W]`` voxel
    mask is refused here)."""
    index_keys = [key for pair in mask_pairs for key in mask_keys(pair)]
    for key, field in spec.items():
        t = tensors[key]
        dtype = "float32" if field.view else field.dtype
        if str(t.dtype).replace("torch.", "") != dtype or tuple(t.shape[1:]) != tuple(field.shape):
            raise ContractError(
                f"batch {key!r} must be {dtype} [B, {', '.join(map(str, field.shape))}] as the transform's "
                f"batch_spec declares, got {_describe(t)}"
                + ("; this looks like a voxel mask [D, H, W]: masks are patch indices, never volumes"
                   if key in index_keys and t.dim() >= 4 else ""))
    present = [key for key in index_keys if key in tensors]
    if num_patches is not None and present:
        both = torch.cat([tensors[key] for key in present], dim=1)
        if both.min() < 0 or both.max() >= num_patches:
            raise ContractError(f"patch indices must lie in [0, {num_patches}), got "
                                f"[{int(both.min())}, {int(both.max())}]")


def schedule_line(recipe: Recipe, schedule: Any, total: int, length: str) -> str:
    """The schedule's length (``length`` says where it comes from) and its LR at a few steps."""
    from octfw.engine.schedules import effective_lr

    steps = sorted({0, 1, 2, max(total // 2, 0), total - 1})
    return (f"schedule  {recipe.scheduler.name}: {total} update steps ({length}); lr "
            + ", ".join(f"step {s}: {effective_lr(schedule, s, recipe.engine.base_lr):.3g}" for s in steps))


def check_recipe(recipe: Recipe, registry: Registry, report: Callable[[str], None] = print, *,
                 processes: int = 1, devices_per_process: int = 1, device_kind: str | None = None,
                 device_bytes: int | None = None) -> dict[str, Any]:
    """Build, run one batch forward and backward on the CPU, and report each boundary.

    ``processes`` and ``devices_per_process`` describe the run to check (a TPU
    v4-32: 4 hosts x 4 devices); the global batch and the schedule's length
    follow from them. ``device_kind`` (default: the recipe's ``run.device``)
    and ``device_bytes`` (default: what :func:`device_memory` finds) size
    the memory estimate for the device the run is meant for.
    """
    from octfw.engine.backend import refuse_compile_on_xla, resolve_device, resolved_precision

    kind = device_kind or resolve_device(recipe.run.device)  # the device the run is meant for
    refuse_compile_on_xla(recipe.engine.compile, kind)  # the Trainer's rule, before an accelerator hour
    torch.manual_seed(recipe.run.seed)
    layout = layout_for(recipe.engine.per_device_batch, recipe.engine.grad_accum_steps, recipe.engine.global_batch,
                        processes=processes, devices_per_process=devices_per_process)
    parts = build_components(recipe, registry, run_dir=None, layout=layout, with_loggers=False)
    ctx = parts.ctx
    init = getattr(parts.model, "init_report", None)  # [model] init: what the published weights became
    for line in (init.lines() if init is not None else ()):
        report(line)
    counts = domain_counts(parts.dataset)
    report(f"dataset   {recipe.dataset.name}: {listed(parts.dataset)}; domains "
           + ", ".join(f"{d} {n}" for d, n in counts.items()))

    source = SampleSource(parts.dataset, parts.transform, recipe.run.seed, parts.domains)
    items = [source[(0, i % len(parts.dataset))] for i in range(recipe.engine.per_device_batch)]
    first = items[0]
    for url, reason in (q for item in items for q in item["quarantined"]):
        report(f"quarantine {url}: {reason}")
    volume_shape = first["provenance"].original_shape
    report(f"sample    volume {list(volume_shape)} spacing {list(first['provenance'].spacing)} mm "
           f"domain {first['provenance'].domain}")
    arrays = first["arrays"]
    spec = parts.transform.batch_spec()
    report(f"transform {recipe.transform.name}: " + ", ".join(f"{k} {_describe(arrays[k])}" for k in spec
                                                              if k in arrays))
    batch = float_views(collate(items, spec)["tensors"], view_keys(spec))  # as the engine hands it to the model
    num_patches = None
    if ctx.image_size and ctx.patch_size:
        num_patches = int(np.prod([s // p for s, p in zip(ctx.image_size, ctx.patch_size)]))
    check_batch_contract(batch, spec, num_patches, ctx.mask_pairs)
    report("batch     " + ", ".join(f"{k} {_describe(batch[k])}" for k in spec))

    model = parts.model
    # The one slow step of a check: a full-size model on the CPU takes minutes (the multi-domain
    # recipe's 9,216 patches: about a minute per sample on two cores). Say so rather than look stuck.
    patches = f", {num_patches:,} patches each" if num_patches is not None else ""
    logging.getLogger(__name__).info("one forward and backward of %s on the CPU (%s%s): a full-size model "
                                     "takes minutes here", recipe.model.name,
                                     counted(recipe.engine.per_device_batch, "sample"), patches)
    started = time.perf_counter()
    out = model(batch)
    if not isinstance(out, ModelOutput):
        raise ContractError(f"model {recipe.model.name!r} returned {type(out).__name__}; "
                            "it must return octfw.types.ModelOutput")
    if out.loss.dim() != 0 or not torch.isfinite(out.loss):
        raise ContractError(f"model loss must be a finite scalar, got {_describe(out.loss)} = {out.loss}")
    out.loss.backward()
    micro_step_s = time.perf_counter() - started
    parameters = [p for p in model.parameters() if p.requires_grad]
    norm = float(grad_norm(parameters))
    if not norm > 0:
        raise ContractError(f"gradient norm after one backward is {norm}; no gradient reaches the parameters")
    params = (model.count_parameters() if isinstance(model, CountingModel)
              else {"trainable": sum(p.numel() for p in parameters)})
    report(f"model     {recipe.model.name}: loss {float(out.loss.detach()):.4f}, grad norm {norm:.4g}, "
           + ", ".join(f"{k} parameters {v:,}" for k, v in params.items()))

    # --- memory (octfw.diagnostics.memory): estimated per device, warned before the run ---
    from octfw.diagnostics.device_memory import device_memory
    from octfw.diagnostics.memory import batch_advice, estimate_memory, memory_report, xla_attention_line

    precision = resolved_precision(recipe.engine.precision, kind)
    # engine.parallelism = "fsdp": the model's state split over every device of the run
    shards = processes * devices_per_process if recipe.engine.parallelism == "fsdp" else 1
    estimate = estimate_memory(model, batch, device=kind, precision=precision, shards=shards)
    memory = (device_bytes, "--device-memory") if device_bytes else device_memory(kind)
    memory_line, memory_warning = memory_report(estimate, *memory)
    report(memory_line)
    if kind == "xla":
        report(xla_attention_line(model, batch, estimate, precision, shards))
    if memory[0]:
        report(batch_advice(model, batch, memory[0], kind, precision, shards))
    if memory_warning:  # a verdict of the report (stdout, before "check passed"), not a log record
        report(f"warning: {memory_warning}")

    # FLOPs per sample, counted by FlopCounterMode on shape-only tensors (octfw.models.flops).
    from octfw.models.flops import forward_flops_per_sample, training_flops_per_sample

    flops = {"forward": forward_flops_per_sample(model, batch),
             "training_step": training_flops_per_sample(model, batch)}
    report(f"flops     forward {flops['forward'] / 1e9:.4g} GFLOP/sample, "
           f"training step {flops['training_step'] / 1e9:.4g} GFLOP/sample")

    report(f"layout    {layout.describe()}")
    where = "on this CPU" + ("" if kind == "cpu" else f"; a {kind} device is faster: measure it with octfw bench")
    report(f"step time {step_time(layout, recipe.engine.global_batch, micro_step_s)}, {where}")
    compiled = None
    if recipe.engine.compile:  # what torch.compile makes of the step, before an accelerator hour compiles it
        from octfw.diagnostics.graph_breaks import compile_report

        compiled = compile_report(model, batch)
        model.zero_grad(set_to_none=True)
        report(f"compile   {compiled.summary()}")
        for where_broken in compiled.breaks:
            report(f"          graph break at {where_broken}")
        if not compiled.clean:
            report("warning: torch.compile splits or recompiles the training step; each graph break runs "
                   "Python between compiled graphs, and code resumed after one can recompile every step")
    total = ctx.total_update_steps
    check_schedule(recipe, parts)
    report(schedule_line(recipe, parts.scheduler, total, f"{parts.steps_per_epoch} per epoch"))
    return {"total_update_steps": total, "parameters": params, "loss": float(out.loss.detach()),
            "flops": flops, "memory": {**estimate.parts, "total": estimate.total},
            "global_batch": layout.global_batch, "process_micro_batch": layout.process_micro_batch,
            "compile": None if compiled is None else {"graphs": compiled.graphs,
                                                      "graph_breaks": [str(b) for b in compiled.breaks],
                                                      "recompilations": compiled.recompilations}}
