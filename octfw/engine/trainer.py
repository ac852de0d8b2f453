"""The training loop. Read it top to bottom: build, check, loop, summarise.

Counting: ``grad_accum_steps`` micro-steps make one *update step*. The
scheduler, EMA, guards, logging and checkpoint intervals all count update
steps. Device-to-host syncs happen at log steps and checkpoint steps only.
"""

from __future__ import annotations

import collections
import json
import random
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from octfw.engine.backend import Backend, select_backend
from octfw.engine.build import Components, build_components
from octfw.engine.data import Quarantine, SampleSource, make_loader, provenance_record
from octfw.engine.state import restore, save
from octfw.engine.update import GuardedStep, grad_norm
from octfw.errors import UserError
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.types import GuardInputs, ModelOutput, StopTraining

__all__ = ["train", "RunSummary"]

PROVENANCE_WINDOW = 8  # update steps whose sample URLs are kept for guard reports


@attrs.define
class RunSummary:
    run_dir: Path
    update_steps: int
    total_update_steps: int
    first_loss: float | None
    last_loss: float | None
    skipped_updates: int
    samples_per_s: float
    checkpoint: str | None
    failed_saves: list[str]
    quarantined: int
    stopped_early: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in attrs.asdict(self).items()}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(model: torch.nn.Module, recipe: Recipe, backend: Backend) -> torch.optim.Optimizer:
    engine = recipe.engine
    if hasattr(model, "param_groups"):
        groups = model.param_groups(engine.weight_decay)
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    # capturable keeps the step counter on the device (xla, cuda), so a skipped
    # update can restore it without a host sync.
    return torch.optim.AdamW(
        groups, lr=engine.base_lr, betas=engine.betas, eps=engine.eps,
        weight_decay=engine.weight_decay, foreach=True, capturable=backend.kind != "cpu",
    )


def check_schedule(recipe: Recipe, parts: Components) -> None:
    from octfw.schedules import validate_schedule

    problems = validate_schedule(parts.schedule, parts.ctx.total_update_steps, recipe.engine.base_lr)
    if problems:
        raise UserError(f"[scheduler] {recipe.scheduler.name}: " + "; ".join(problems))


class GuardLog:
    """Writes which samples fed the update steps around a guard event."""

    def __init__(self, run_dir: Path | None):
        self.path = run_dir / "guard_events.jsonl" if run_dir else None
        self.window: collections.deque = collections.deque(maxlen=PROVENANCE_WINDOW)

    def remember(self, update_step: int, provenance: list) -> None:
        self.window.append((update_step, [provenance_record(p) for p in provenance]))

    def write(self, update_step: int, event: str, skipped_steps: float) -> None:
        if self.path is None:
            return
        record = {"step": update_step, "event": event, "skipped_updates": skipped_steps,
                  "recent_batches": [{"step": s, "samples": samples} for s, samples in self.window]}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def train(recipe: Recipe, registry: Registry, run_dir: Path, *, resume: str | None = None) -> RunSummary:
    from octfw.rundir import write_summary

    seed_everything(recipe.run.seed)
    backend = select_backend(recipe.run.device, recipe.engine.precision)
    if recipe.engine.compile and backend.kind == "xla":
        raise UserError("engine.compile = true is refused on xla (Inductor compile-worker storm); "
                        "torch_xla compiles graphs itself")
    parts = build_components(recipe, run_dir=run_dir, rank=backend.rank, world_size=backend.world_size)
    check_schedule(recipe, parts)
    model = parts.model.to(backend.device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model, recipe, backend)
    guarded_step = GuardedStep(optimizer, parameters)
    forward = torch.compile(model) if recipe.engine.compile else model
    engine, total = recipe.engine, parts.ctx.total_update_steps
    accum, batch_size = engine.grad_accum_steps, engine.per_device_batch

    start_step, samples_done = 0, 0
    if resume is not None:
        start_step, samples_done = restore(resume, parts, model, optimizer)

    source = SampleSource(parts.dataset, parts.transform, recipe.run.seed)
    loader = make_loader(source, batch_size, recipe.run.seed, samples_done,
                         engine.num_workers, backend.rank, backend.world_size)
    batches = iter(backend.device_batches(loader))
    quarantine, guard_log = Quarantine(run_dir), GuardLog(run_dir)
    domain_index = {d: i for i, d in enumerate(parts.domains)}

    # Device accumulators, read on log steps only.
    zeros = lambda *shape: torch.zeros(*shape, device=backend.device)  # noqa: E731
    skipped, loss_sum, applied = zeros(()), zeros(()), zeros(())
    domain_loss, domain_count = zeros(len(domain_index)), zeros(len(domain_index))
    for logger in parts.loggers:
        logger.start(total, run_dir, parts.ctx.recipe)

    first_loss = last_loss = None
    checkpoint, failed_saves, stopped = None, [], None
    last_log_time, last_log_step, skipped_seen = time.perf_counter(), start_step, 0.0
    run_start = time.perf_counter()
    update_step = start_step
    try:
        for update_step in range(start_step, total):
            lr = parts.schedule.lr(update_step)
            lr_now = engine.base_lr if lr is None else lr
            wd = parts.schedule.weight_decay(update_step)
            for group in optimizer.param_groups:
                if lr is not None:
                    group["lr"] = lr
                if wd is not None and group.get("weight_decay", 0.0) > 0.0:
                    group["weight_decay"] = wd

            step_loss = zeros(())
            provenance = []
            for _micro in range(accum):
                batch = next(batches)
                quarantine.record(batch["quarantined"])
                provenance += batch["provenance"]
                with backend.autocast():
                    out: ModelOutput = forward(batch["tensors"])
                (out.loss / accum).backward()
                step_loss += out.loss.detach().float() / accum
                onehot = torch.zeros(len(batch["provenance"]), len(domain_index))
                for row, p in enumerate(batch["provenance"]):
                    onehot[row, domain_index[p.domain]] = 1.0
                onehot = onehot.to(backend.device)
                domain_loss += (out.per_sample_loss.detach().float()[:, None] * onehot).sum(0)
                domain_count += onehot.sum(0)
            samples_done += accum * batch_size
            guard_log.remember(update_step, provenance)

            # Measured once, before clipping and before zero_grad.
            norm = grad_norm(parameters)
            inputs = GuardInputs(update_step, step_loss, norm, tuple(parameters), lr_now)
            verdict = None
            for guard in parts.guards:
                vote = guard.before_step(inputs)
                if vote is not None:
                    verdict = vote if verdict is None else verdict & vote
            guarded_step(verdict)
            ok = torch.ones((), dtype=torch.bool, device=backend.device) if verdict is None else verdict
            momentum = parts.schedule.ema_momentum(update_step)
            if momentum is not None and hasattr(model, "ema_update"):
                # Momentum 1.0 leaves the EMA untouched on a skipped update.
                model.ema_update(torch.where(ok, torch.tensor(momentum, device=backend.device), 1.0))
            optimizer.zero_grad(set_to_none=True)
            skipped += (~ok).float()
            loss_sum += torch.where(ok, step_loss, 0.0)
            applied += ok.float()
            backend.step_boundary()

            done = update_step + 1
            if done % engine.log_every_steps == 0 or done == total:
                host = backend.read({"loss": loss_sum / applied.clamp(min=1.0), "grad_norm": norm,
                                     "skipped_updates": skipped, "applied": applied,
                                     **{f"metric/{k}": v for k, v in out.metrics.items()}})
                domain_means = (domain_loss / domain_count.clamp(min=1.0)).cpu().tolist()
                now = time.perf_counter()
                metrics = {
                    "loss": host["loss"] if host["applied"] > 0 else float("nan"),
                    "lr": lr_now,
                    "grad_norm": host["grad_norm"],
                    "skipped_updates": host["skipped_updates"],
                    "updates_since_log": float(done - last_log_step),
                    "samples_per_s": (done - last_log_step) * accum * batch_size
                    * backend.world_size / max(now - last_log_time, 1e-9),
                    "epoch": samples_done / len(parts.dataset),
                    **{k: v for k, v in host.items() if k.startswith("metric/")},
                    **{f"loss/{d}": domain_means[i] for d, i in domain_index.items()},
                }
                if momentum is not None:
                    metrics["ema_momentum"] = momentum
                if host["skipped_updates"] > skipped_seen:
                    guard_log.write(update_step, "skipped update", host["skipped_updates"])
                    skipped_seen = host["skipped_updates"]
                first_loss = metrics["loss"] if first_loss is None else first_loss
                last_loss = metrics["loss"]
                for logger in parts.loggers:
                    logger.log(done, metrics)
                for guard in parts.guards:
                    guard.at_log_step(done, metrics)
                loss_sum.zero_(), applied.zero_(), domain_loss.zero_(), domain_count.zero_()
                last_log_time, last_log_step = now, done

            every = engine.checkpoint_every_steps
            if (every and done % every == 0) or done == total:
                location, error = save(parts, model, optimizer, done, samples_done, recipe)
                if error:
                    failed_saves.append(f"step {done}: {error}")
                else:
                    checkpoint = location
    except StopTraining as reason:
        stopped = str(reason)
        guard_log.write(update_step, stopped, -1)

    elapsed = time.perf_counter() - run_start
    steps_run = (update_step + 1 if stopped is None else update_step) - start_step
    summary = RunSummary(
        run_dir=run_dir, update_steps=start_step + max(steps_run, 0), total_update_steps=total,
        first_loss=first_loss, last_loss=last_loss, skipped_updates=int(skipped.cpu().item()),
        samples_per_s=max(steps_run, 0) * accum * batch_size * backend.world_size / max(elapsed, 1e-9),
        checkpoint=checkpoint, failed_saves=failed_saves, quarantined=len(quarantine),
        stopped_early=stopped,
    )
    write_summary(run_dir, summary.as_dict(), quarantine)
    for logger in parts.loggers:
        logger.finish(summary.as_dict())
    return summary
