"""The training loop. Read it top to bottom: build, loop, summarise.

Counting: ``grad_accum_steps`` micro-steps make one *update step*. The
scheduler, EMA, guards, logging and checkpoint intervals all count update
steps. Device-to-host syncs happen at log steps and checkpoint steps only.

The final state is never lost: before training, the checkpointer must show
that it can take a checkpoint (a probe write; room on a local disk). If the
final save fails anyway, the state goes to ``<run_dir>/fallback/`` and the
run ends with :data:`SAVE_FAILED_EXIT_CODE`; ``--resume auto`` continues from
that copy and writes it to the checkpointer once it can.

Many processes train as one run: every decision that stops, skips or
resumes it (a signal on any process, a guard's stop or done, which
checkpoint to continue, the final save's outcome) is agreed through
:class:`~octfw.engine.distributed.Peers` before anyone acts on it, so every
process stops after the same update step, and rank 0 alone writes.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import attrs
import torch

from octfw.engine.attention import record_attention
from octfw.engine.backend import Backend, select_backend, single_process_backend
from octfw.engine.build import build_components, check_schedule
from octfw.engine.checkpointing import BackgroundSaver
from octfw.engine.data import (Quarantine, SampleSource, domain_report, loader_workers, make_loader,
                               provenance_record, stating_shared_memory)
from octfw.engine.distributed import (Peers, PeerLost, Processes, all_reduce_, min_across_ranks,
                                     step_time)
from octfw.engine.heartbeat import Heartbeat
from octfw.engine.metrics import log_metrics, mfu
from octfw.engine.optim import apply_schedule, make_optimizer, seed_everything
from octfw.engine.preemption import StopNow, StoppedBeforeTraining, StopRequests
from octfw.engine.state import capture, checkpoint_nbytes, dataset_fingerprint, restore
from octfw.engine.throughput import device_peak_flops, flops_per_sample
from octfw.engine.update import grad_norm, step_unless_vetoed
from octfw.recipe import Recipe, to_toml
from octfw.schedules import effective_lr
from octfw.registry import Registry
from octfw.storage.checkpoints import CheckpointStorage
from octfw.storage.failures import storage_cause
from octfw.errors import RecipeError, UserError
from octfw.recipe.changes import recipe_changes
from octfw.tables import counted
from octfw.exit_codes import SAVE_FAILED_EXIT_CODE
from octfw.types import (DOMAIN_ID_KEY, ClaimingCheckpointer, EMAModel, EncoderModel, ExportableEncoder, GuardInputs,
                         ModelOutput, StepListener, StopTraining, TrainingDone, WarmupSchedule)

__all__ = ["train", "Trainer", "RunSummary", "SAVE_FAILED_EXIT_CODE", "FALLBACK_DIR", "make_optimizer",
           "training_forward"]

PROVENANCE_WINDOW = 8  # update steps whose sample URLs are kept for guard reports
#: An update step estimated to take longer than this is announced (with its time) at the start.
SLOW_UPDATE_S = 60.0
#: What a run folder cannot lose while it trains; gone, the run stops (exit 74) and puts them back.
START_FILES_KEPT = ("recipe.toml", "run.json", "versions.json", "git.json")
#: Folder of the run directory that takes the final state when the checkpointer cannot.
FALLBACK_DIR = "fallback"

log = logging.getLogger(__name__)


@attrs.define
class RunSummary:
    run_dir: Path
    update_steps: int
    total_update_steps: int
    first_loss: float | None
    last_loss: float | None
    skipped_updates: int
    samples_per_s: float
    elapsed_s: float
    checkpoint: str | None
    failed_saves: list[str]
    quarantined: int
    stopped: str | None = None  #: why a guard or logger stopped the run (a problem)
    finished_early: str | None = None  #: why a guard or logger ended it as done (a target reached)
    device: str = ""
    mfu: float | str | None = None  #: model FLOPs utilisation, or "unknown peak"
    skipped_saves: int = 0  #: checkpoints skipped because the previous save was still being written
    preempted: bool = False  #: stopped by SIGTERM/SIGINT or a TPU preemption notice, after saving
    interrupted: bool = False  #: stopped at once by a second signal, without the final save
    #: a process of the job died or stopped answering (the line names it); nothing saved after ``checkpoint``
    peer_lost: str | None = None
    final_save_failed: bool = False  #: the checkpointer could not take the final state
    fallback_checkpoint: str | None = None  #: where the final state went instead (None: nowhere)
    encoder: str | None = None  #: RUN/encoder, the exported target encoder of a finished run
    #: the share of the run's time spent waiting on the data loader (0: never starved; near 1:
    #: the loader is the bottleneck, give it workers: engine.num_workers, octfw bench --data-only)
    data_wait_share: float | None = None
    #: the scaled-dot-product attention kernel(s) the model's attention ran ("cudnn", "flash",
    #: "efficient", "math"), seen in the first update step; None: compiled or no attention
    attention: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in attrs.asdict(self).items()}


class GuardLog:
    """Writes which samples fed the update steps around a guard event.

    Step numbers here, as in metrics.jsonl, count updates from 1: step N is
    the N-th update (``octfw replay RUN_DIR --step N`` rebuilds it)."""

    def __init__(self, run_dir: Path | None):
        self.path = run_dir / "guard_events.jsonl" if run_dir else None
        self.window: collections.deque = collections.deque(maxlen=PROVENANCE_WINDOW)

    def remember(self, update_step: int, provenance: list) -> None:
        self.window.append((update_step, provenance))  # formatted only when written

    def write(self, update_step: int, event: str) -> None:
        if self.path is None:
            return
        record = {"step": update_step, "event": event,
                  "recent_batches": [{"step": s, "samples": [provenance_record(p) for p in batch]}
                                     for s, batch in self.window]}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class DeviceTotals:
    """Running sums kept on the device between log steps (no sync until read)."""

    def __init__(self, device: torch.device, n_domains: int):
        zeros = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        self.skipped = zeros(())  # whole run
        self.loss, self.applied = zeros(()), zeros(())  # since the last log step
        self.domain_loss, self.domain_count = zeros(n_domains), zeros(n_domains)

    def reset_interval(self) -> None:
        for t in (self.loss, self.applied, self.domain_loss, self.domain_count):
            t.zero_()

    def read(self, backend: Backend, **extra: torch.Tensor) -> dict[str, Any]:
        """The interval's means, summed over DDP ranks, and ``extra``, in one
        device-to-host transfer. Note: a sync point (log steps only)."""
        ranks = 1
        if backend.ddp:  # sums over the processes; SPMD's are global already
            all_reduce_(self.loss, self.applied, self.domain_loss, self.domain_count)
            ranks = backend.world_size
        return backend.read({
            "loss": self.loss / self.applied.clamp(min=1.0),
            "applied": self.applied / ranks,
            "skipped_updates": self.skipped,
            "domain_loss": self.domain_loss / self.domain_count.clamp(min=1.0),
            "domain_count": self.domain_count,
            **extra,
        })


def training_forward(model: torch.nn.Module, *, compile: bool, ddp: bool) -> torch.nn.Module:
    """What an update step calls: ``model``, compiled and wrapped in DDP as asked.

    Compiled, then wrapped: ``DDP(torch.compile(model))``, as PyTorch's "Where
    to apply torch.compile?" advises (compile the module passed to the wrapper;
    ``torch.compile`` does not handle DDP's own forward well). DDPOptimizer
    still splits the graph at DDP's gradient buckets, so all-reduces overlap
    the backward: dynamo compiles the model's frame inside DDP's forward, where
    it finds the active DDP module and its bucket size. Wrapped the other way
    round, dynamo breaks the graph twice in ``DDP.forward`` (its logger and
    ``_inside_ddp_forward``) and splits the model's graph the same
    (``tests/test_compile.py`` checks the split). A separate compiled module rather
    than ``model.compile()``: ``model`` stays eager for the FLOP count on meta
    tensors, the evaluators and export.
    """
    forward = torch.compile(model) if compile else model
    if ddp:  # gradients averaged across the processes
        forward = torch.nn.parallel.DistributedDataParallel(forward)
    return forward


class Trainer:
    """``processes`` and ``peers``: who this process is and the job's other processes, from
    :func:`octfw.engine.distributed.join` (default: this process alone, on ``run.device``).
    ``stop_requests``: the signal handling of the command (default: one for the training loop).
    ``compare_recipe``: False for a replay, which changes the device and precision on purpose."""

    def __init__(self, recipe: Recipe, registry: Registry, run_dir: Path, resume: str | None = None, *,
                 processes: Processes | None = None, peers: Peers | None = None,
                 stop_requests: StopRequests | None = None, allow_recipe_change: bool = False,
                 compare_recipe: bool = True):
        seed_everything(recipe.run.seed)
        self.recipe, self.run_dir = recipe, run_dir
        engine = recipe.engine
        self.backend = backend = (select_backend(processes, engine.precision, engine.compile) if processes
                                  else single_process_backend(recipe.run.device, engine.precision, engine.compile))
        self.peers = peers or Peers(Processes(backend.kind, backend.device))
        #: the global batch arithmetic, worked out once: build, resume, data position, throughput
        self.layout = layout = backend.batch_layout(engine.per_device_batch, engine.grad_accum_steps,
                                                    engine.global_batch)
        self.parts = parts = build_components(recipe, registry, run_dir=run_dir, rank=backend.rank, layout=layout)
        check_schedule(recipe, parts)
        self.model = parts.model.to(backend.device)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.model, recipe, backend)
        self.forward = training_forward(self.model, compile=recipe.engine.compile, ddp=backend.ddp)
        self.total = parts.ctx.total_update_steps
        #: samples one update step consumes on every device of the run (throughput, MFU)
        self.samples_per_update = layout.global_batch
        #: this process's share of them (its data loader's position, ``samples_done``)
        self.local_samples_per_update = layout.process_batch
        self.fingerprint = dataset_fingerprint(parts.dataset)
        self.start_step, self.samples_done, run_record = 0, 0, {}
        #: the final state, when the checkpointer could not take it (a full disk, a store away)
        self.fallback = CheckpointStorage(str(run_dir / FALLBACK_DIR), keep_last=1)
        fallback, location = self._resume_location(resume)
        #: resumed from the fallback: the final save must reach the checkpointer, even with no step left
        self.upload_fallback = fallback is not None
        if fallback is not None:
            log.warning("--resume auto: continuing from %s, the final state the checkpointer could not take; "
                        "it is written to the checkpointer at the end of this run", fallback)
        if resume == "auto" and location is None:  # a new run, or one killed before its first save
            log.info("--resume auto: no complete checkpoint yet; training from the start")
        if location is not None:
            self.start_step, run_record = restore(location, parts, self.model, self.optimizer,
                                                  global_batch_size=self.samples_per_update,
                                                  fingerprint=self.fingerprint)
            # From the update step, not the checkpoint's per-process count: the global batch is the
            # checkpoint's (restore refuses another), so this is exact with any number of hosts.
            self.samples_done = self.start_step * self.local_samples_per_update
        self.resumed_from = location  #: the checkpoint this run continues (None: from the start)
        if location is not None and compare_recipe:
            self.check_recipe_change(run_record.get("recipe"), registry, allow_recipe_change)

        source = SampleSource(parts.dataset, parts.transform, recipe.run.seed, parts.domains)
        self.loader_workers = loader_workers(recipe.engine.num_workers, backend.kind)
        loader = make_loader(source, recipe.engine.per_device_batch * backend.local_devices,
                             recipe.run.seed, self.samples_done,
                             self.loader_workers[0], backend.rank, backend.world_size,
                             domain_sampling=recipe.engine.domain_sampling,
                             views_to_device=backend.kind != "cpu", pin_memory=backend.kind == "cuda")
        self.batches = iter(backend.device_batches(stating_shared_memory(loader), parts.transform.batch_spec()))
        writes = run_dir if backend.is_main_process else None  # only rank 0 writes files
        self.quarantine, self.guard_log = Quarantine(writes), GuardLog(writes)
        self.totals = DeviceTotals(backend.device, len(parts.domains))
        self._applied = torch.ones((), dtype=torch.bool, device=backend.device)  # the verdict without guards
        self._vetoed = torch.zeros((), dtype=torch.bool, device=backend.device)  # a guard that stopped the run
        self.heartbeat = Heartbeat(recipe.engine.heartbeat_s)
        #: the run folder's start files, to put a folder deleted under the run back (rank 0)
        self._start_files = {name: (run_dir / name).read_bytes() for name in START_FILES_KEPT
                             if backend.is_main_process and (run_dir / name).exists()}
        #: the run's first logged loss (carried by its checkpoints across attempts) and its latest
        self.first_loss, self.last_loss = run_record.get("first_loss"), None
        self.saver = BackgroundSaver(parts.checkpointer)
        #: the command's signal handling, or one of the loop's own (``octfw.train`` in a notebook)
        self.stop_requests, self._own_stop_requests = ((stop_requests, False) if stop_requests
                                                       else (StopRequests(), True))
        #: a guard's or logger's StopTraining/TrainingDone on this process, acted on once every
        #: process has heard of it (end of the update step)
        self._pending: StopTraining | None = None
        self._last_log = (time.perf_counter(), self.start_step)
        self._skipped_seen = 0.0
        self._step_listeners = [lg for lg in parts.loggers if isinstance(lg, StepListener)]
        self._data_wait_s = 0.0  # host time blocked on the data loader since the last log step
        self._data_wait_total_s = 0.0  # ... and since the run (this attempt) started
        self.peak_flops, self.device_name = device_peak_flops(
            backend.kind, backend.device, recipe.engine.peak_flops_per_device)
        self.flops_per_sample: int | None = None  # counted once, on meta tensors, at the first log
        self._batch_shapes: Any = None
        self.attention_kernels: str | None = None  # seen in the first eager micro-step

    def _resume_location(self, resume: str | None) -> tuple[str | None, str | None]:
        """(the fallback copy to continue, or None; the checkpoint to load, or None), decided by
        rank 0 (its disk holds the run folder) and the same on every process. Every process must
        be able to read it, or the run is refused before anyone loads anything."""
        fallback = location = None
        if self.backend.is_main_process:
            fallback = self.fallback.latest() if resume == "auto" else None
            location = fallback or (self.parts.checkpointer.latest() if resume == "auto" else resume)
        fallback, location = self.peers.broadcast((fallback, location))
        if location is not None and not self.peers.all_agree(_readable(location)):
            raise UserError(f"the checkpoint to resume, {location}, cannot be read by every process of the job; "
                            "put checkpointer.dir on storage that every node reads (gs://, a shared file system)")
        return fallback, location

    def check_recipe_change(self, trained_with: dict[str, Any] | None, registry: Registry, allow: bool) -> None:
        """A resumed run is the run that was started. The recipe is compared key by key with the
        one that trained the checkpoint (:mod:`octfw.recipe.changes`); every process holds that
        checkpoint, so every process decides alike. A change that shapes training is refused, one
        line per key with the old and new value, unless ``allow`` (``--allow-recipe-change``), and
        then the whole schedule (the old one up to the resumed step, the new one after it) must
        pass the pre-flight check: a longer cosine that would rise again is still refused. Every
        change is listed; the run folder keeps each recipe it ran with, by the update step it
        began at (``RUN/recipes/step_N.toml``)."""
        if not trained_with:  # a checkpoint of an octfw that did not record its recipe
            return
        changes = recipe_changes(trained_with, self.recipe.to_dict())
        trains = [str(c) for c in changes if c.trains]
        where = f"--resume {self.resumed_from}"
        if trains and not allow:
            raise RecipeError(f"{where}: the checkpoint was trained with another recipe; these changes would change "
                              "its training (resume with the recipe it began with, start a new run, or accept them "
                              "with --allow-recipe-change)", trains)
        if trains:
            problem = _changed_schedule_problem(trained_with, self.recipe, registry, self.parts, self.layout,
                                                self.start_step)
            if problem is not None:
                raise UserError(f"{where} --allow-recipe-change: {problem}")
        if not changes:
            return
        if self.backend.is_main_process:
            for change in changes:
                (log.warning if change.trains else log.info)("resumed with a changed recipe: %s%s", change,
                                                             " (changes training; accepted)" if change.trains else "")
            history = self.run_dir / "recipes"
            history.mkdir(exist_ok=True)
            if not any(history.iterdir()):  # the recipe the run began with
                (history / "step_00000000.toml").write_text(to_toml(trained_with), encoding="utf-8")
            text = to_toml(self.recipe.to_dict())
            (history / f"step_{self.start_step:08d}.toml").write_text(text, encoding="utf-8")
            (self.run_dir / "recipe.toml").write_text(text, encoding="utf-8")

    # --- one update step ------------------------------------------------

    def is_log_step(self, done: int) -> bool:
        return done % self.recipe.engine.log_every_steps == 0 or done == self.total

    def update(self, update_step: int) -> tuple[torch.Tensor | None, ModelOutput]:
        """grad_accum micro-steps, one guarded optimizer step, EMA. No host sync.

        Returns the gradient norm (None when neither a guard nor this step's
        log needs it) and the last micro-step's model output."""
        engine, schedule, backend = self.recipe.engine, self.parts.scheduler, self.backend
        apply_schedule(self.optimizer, schedule.lr(update_step), schedule.weight_decay(update_step))

        step_loss = torch.zeros((), device=backend.device)
        provenance = []
        accum = self.layout.grad_accum_steps
        for micro in range(accum):
            self.heartbeat.waiting_on("the data loader")
            wait_started = time.perf_counter()
            batch = next(self.batches)
            waited = time.perf_counter() - wait_started
            self._data_wait_s += waited
            self._data_wait_total_s += waited
            self.heartbeat.waiting_on("forward/backward (tracing or compiling on xla)")
            self.quarantine.record(batch["quarantined"])
            provenance += batch["provenance"]
            self._batch_shapes = batch["tensors"]
            last_micro = micro == accum - 1
            # DDP all-reduces gradients on the last micro-step only.
            sync = self.forward.no_sync() if backend.ddp and not last_micro else contextlib.nullcontext()
            # The attention kernel that really ran, named in the summary: seen in the run's first
            # eager micro-step (a dispatch mode, too slow to keep on; compiled code is not watched).
            first = update_step == self.start_step and micro == 0 and not engine.compile
            with sync, (record_attention() if first else contextlib.nullcontext()) as seen:
                with backend.forward_context():
                    out: ModelOutput = self.forward(batch["tensors"])
                (out.loss / accum).backward()
            step_loss += out.loss.detach().float() / accum
            if seen is not None:
                self.attention_kernels = ", ".join(sorted(seen.kernels)) or None
            if update_step == self.start_step and micro == 0:
                self._announce_step_time(time.perf_counter() - wait_started)
            self._add_domain_losses(out, batch["tensors"][DOMAIN_ID_KEY])
            if not last_micro:
                # One XLA graph per micro-step, so that a graph holds one
                # micro-batch's activations, as accumulation intends: with the
                # whole update in one graph XLA:CPU planned twice the memory
                # for `small` at the seeds' size (docs/performance.md).
                backend.step_boundary()
        self.samples_done += self.local_samples_per_update
        self.guard_log.remember(update_step + 1, provenance)
        if backend.ddp:  # every rank's guards see the same (mean) loss; SPMD's is global already
            all_reduce_(step_loss)
            step_loss /= backend.world_size

        # Measured before clipping and zero_grad, when guards or the log read it.
        guards = self.parts.guards
        norm = grad_norm(self.parameters) if guards or self.is_log_step(update_step + 1) else None
        inputs = GuardInputs(update_step, step_loss, norm, tuple(self.parameters),
                             effective_lr(schedule, update_step, engine.base_lr))
        verdict = None
        for guard in guards:
            vote = self._deferring_stops(guard.before_step, inputs, veto=self._vetoed)
            if vote is not None:
                verdict = vote if verdict is None else verdict & vote
        if verdict is not None and backend.ddp:
            verdict = min_across_ranks(verdict)  # every rank takes the same decision
        step_unless_vetoed(self.optimizer, verdict)
        ok = self._applied if verdict is None else verdict
        momentum = schedule.ema_momentum(update_step)
        if momentum is not None and isinstance(self.model, EMAModel):
            # Momentum 1.0 leaves the EMA untouched when the update was skipped.
            self.model.ema_update(torch.where(ok, backend.scalar(momentum), 1.0))
        self.optimizer.zero_grad(set_to_none=True)
        totals = self.totals
        totals.skipped += (~ok).float()
        totals.loss += torch.where(ok, step_loss, 0.0)
        totals.applied += ok.float()
        backend.step_boundary()
        return norm, out

    def _deferring_stops(self, call: Any, *args: Any, veto: Any = None) -> Any:
        """``call(*args)``, keeping a StopTraining (or TrainingDone) it raises for the end of the
        update step, when every process acts on it together; ``veto`` is then its result."""
        try:
            return call(*args)
        except StopTraining as reason:
            self._pending = self._pending or reason
            return veto

    def _announce_step_time(self, micro_step_s: float) -> None:
        """After the run's first micro-step: what one update step will take, where it is long or
        the global batch is pinned (a recipe written for more devices than this machine has)."""
        engine = self.recipe.engine
        slow = micro_step_s * self.layout.grad_accum_steps > SLOW_UPDATE_S
        if self.backend.is_main_process and (engine.global_batch is not None or slow):
            log.warning("%s; the first micro-step includes compilation and warm-up",
                        step_time(self.layout, engine.global_batch, micro_step_s))

    def _add_domain_losses(self, out: ModelOutput, domain_ids: torch.Tensor) -> None:
        per_sample = out.per_sample_loss.detach().float()
        self.totals.domain_loss.index_add_(0, domain_ids, per_sample)
        self.totals.domain_count.index_add_(0, domain_ids, torch.ones_like(per_sample))

    # --- log and checkpoint steps ----------------------------------------

    def log(self, done: int, norm: torch.Tensor, out: ModelOutput) -> None:
        """Read every metric from the device in one transfer; hand host floats to loggers."""
        self.heartbeat.waiting_on("the device (reading metrics)")
        host = self.totals.read(self.backend, grad_norm=norm,
                                **{f"metric/{k}": v for k, v in out.metrics.items()})
        now = time.perf_counter()
        last_time, last_step = self._last_log
        if self.flops_per_sample is None and self._batch_shapes is not None:
            self.flops_per_sample = flops_per_sample(self.model, self._batch_shapes) or 0
        schedule, engine = self.parts.scheduler, self.recipe.engine
        metrics = log_metrics(
            host, interval_s=now - last_time, updates=done - last_step,
            samples_per_update=self.samples_per_update, device_count=self.backend.device_count,
            data_wait_s=self._data_wait_s,
            epoch=self.samples_done * self.backend.world_size / len(self.parts.dataset),
            lr=effective_lr(schedule, done - 1, engine.base_lr),
            ema_momentum=schedule.ema_momentum(done - 1), domains=self.parts.domains,
            flops_per_sample=self.flops_per_sample, peak_flops=self.peak_flops,
        )
        self._data_wait_s = 0.0
        if host["skipped_updates"] > self._skipped_seen:
            self.guard_log.write(done, "skipped update (non-finite loss or gradient) since the last log step")
            self._skipped_seen = host["skipped_updates"]
        if host["applied"] > 0:
            self.first_loss = metrics["loss"] if self.first_loss is None else self.first_loss
            self.last_loss = metrics["loss"]
        for logger in self.parts.loggers:
            self._deferring_stops(logger.log, done, metrics)
        for guard in self.parts.guards:
            self._deferring_stops(guard.at_log_step, done, metrics)
        self.totals.reset_interval()
        self._last_log = (now, done)

    def evaluate(self, done: int) -> None:
        """Run the evaluators due at this step; they never touch the training RNG stream."""
        due = [(spec, ev) for spec, ev in zip(self.recipe.evaluators, self.parts.evaluators)
               if (ev.every_steps and done % ev.every_steps == 0) or done == self.total]
        if not due:
            return
        self.heartbeat.waiting_on("evaluation")
        started = time.perf_counter()
        results: dict[str, float] = {}
        devices = [self.backend.device] if self.backend.kind == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for spec, evaluator in due:
                for key, value in evaluator.evaluate(self.model, self.backend.device, done).items():
                    results[f"eval/{spec.name}/{key}"] = float(value)
        for logger in self.parts.loggers:
            logger.log(done, results)
        # Evaluation time is not training time: leave it out of the throughput clock.
        last_time, last_step = self._last_log
        self._last_log = (last_time + time.perf_counter() - started, last_step)

    def _capture(self, done: int) -> dict[str, Any]:
        """The host copy of the training state: all a checkpoint step costs the loop."""
        return capture(self.parts, self.model, self.optimizer, done, done * self.local_samples_per_update,
                       global_batch_size=self.samples_per_update, fingerprint=self.fingerprint,
                       run={"first_loss": self.first_loss})

    def save_checkpoint(self, done: int) -> None:
        """Hand a checkpoint to the background saver (rank 0 only); skipped, without a copy,
        while the previous save is still being written."""
        if self.backend.is_main_process:
            self.heartbeat.waiting_on("the checkpoint save")
            self.saver.submit(done, lambda: self._capture(done))

    def save_final(self, done: int) -> tuple[bool, str | None]:
        """The run's last checkpoint, awaited (rank 0 only): (whether the checkpointer failed to
        take it, where the state went instead). A second Ctrl-C skips it: the user asked to stop."""
        if not self.backend.is_main_process:
            return False, None
        self.heartbeat.waiting_on("the checkpoint save")
        stop_now = lambda: self.stop_requests.stop_now  # noqa: E731
        if self.saver.save_final(done, lambda: self._capture(done), self.recipe.engine.save_deadline_s, stop_now):
            if self.upload_fallback:  # the checkpointer holds the state now
                self.fallback.remove()
            return False, None
        if stop_now():
            return False, None
        return True, self.save_fallback(done, "the final checkpoint could not be written to the checkpointer")

    def save_fallback(self, done: int, why: str) -> str | None:
        """The final state into RUN/fallback (rank 0): where it went, or None (said why)."""
        try:
            location = self.fallback.save(done, self._capture(done))
        except Exception as exc:  # noqa: BLE001 - said on the console; the exit code says it too
            cause = storage_cause(exc, str(self.fallback.url)) or f"{type(exc).__name__}: {exc}"
            log.error("%s, and the final state could not be written to the fallback folder either: %s; the newest "
                      "complete checkpoint is %s", why, cause, self._newest_checkpoint(False) or "none", exc_info=exc)
            return None
        log.warning("%s; the final state is in %s", why, location)
        return location

    def _vanished(self) -> list[str]:
        """The start files gone from the run folder (rank 0; empty while it is whole)."""
        return [name for name in self._start_files if not (self.run_dir / name).exists()]

    def _restore_run_folder(self, done: int, gone: list[str]) -> str | None:
        """The run folder was deleted under the run: put its start files back, so that
        ``--resume auto`` finds it, and the final state into its fallback (never a checkpointer
        inside a folder that is being removed); the run then ends with exit 74."""
        why = f"the run folder {self.run_dir} vanished during the run ({', '.join(gone)} gone)"
        self.saver.failed.append(f"step {done}: {why}")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for name, data in self._start_files.items():
                if not (self.run_dir / name).exists():
                    (self.run_dir / name).write_bytes(data)
        except OSError as exc:
            log.error("%s, and it could not be made again: %s", why, storage_cause(exc, str(self.run_dir)) or exc)
            return None
        return self.save_fallback(done, why)

    def export_encoder(self, done: int) -> str | None:
        """RUN/encoder: the target encoder of a finished run as a Hub-style folder (rank 0,
        ``run.export_encoder``), or None. A model without a ViT3D ``encoder`` has nothing to
        export; a failed write is said and leaves the checkpoint, which ``octfw export`` reads."""
        from octfw.formats import encoder_info, write_export
        from octfw.rundir import versions

        encoder = self.model.encoder if isinstance(self.model, EncoderModel) else None
        if not (self.backend.is_main_process and self.recipe.run.export_encoder
                and isinstance(encoder, ExportableEncoder)):
            return None
        folder = self.run_dir / "encoder"
        info = encoder_info(encoder.architecture(), self.parts.ctx.recipe, self.saver.latest or "", done, versions())
        try:
            write_export("safetensors", folder, encoder, info)
        except Exception as exc:  # noqa: BLE001 - the run's checkpoint is safe; say why the copy is not there
            log.warning("the encoder could not be exported to %s (%s: %s); export it from the checkpoint with "
                        "`octfw export %s --out encoder.pt`", folder, type(exc).__name__, exc, self.run_dir)
            return None
        log.info("encoder: %s (load it with octfw.load_encoder)", folder)
        return str(folder)

    # --- the loop ----------------------------------------------------------

    def run(self) -> RunSummary:
        """Hold the checkpoint folder (rank 0), train, summarise."""
        checkpointer = self.parts.checkpointer
        claiming = isinstance(checkpointer, ClaimingCheckpointer)
        if self.backend.is_main_process and claiming:  # before an hour is spent
            checkpointer.claim(checkpoint_nbytes(self.model, self.parameters))
        try:
            if self._own_stop_requests:
                with self.stop_requests:
                    return self.train_loop()
            return self.train_loop()
        finally:
            if claiming:
                checkpointer.release()

    def agree_to_stop(self, done: int) -> tuple[str | None, str]:
        """After update step ``done``: (why every process stops now, or None; what stops it:
        "guard", "target" (a target reached), "signal" or "vanished" (the run folder was
        deleted)). One tiny all-reduce of host values over the peers' own gloo group: the device
        stream is never waited on. The reason travels only when there is one."""
        pending = self._pending
        signal_vote = self.stop_requests.local_vote(done)
        gone = self._vanished() if self.backend.is_main_process else []  # a stat per file: cheap
        stop, finished, signalled, vanished = self.peers.max([
            int(pending is not None and not isinstance(pending, TrainingDone)),
            int(isinstance(pending, TrainingDone)), signal_vote, int(bool(gone))])
        if vanished:
            return f"the run folder {self.run_dir} vanished at update step {done}", "vanished"
        if signalled > signal_vote:  # a peer's signal: this process stops as if it had it
            self.stop_requests.signals = max(self.stop_requests.signals, signalled)
            self.stop_requests.signal_name = self.stop_requests.signal_name or "a stop request on another process"
        if stop or finished:  # the reason of the lowest rank that has one, named where it is another's
            reasons = self.peers.gather(None if pending is None else str(pending))
            rank, reason = next((rank, r) for rank, r in enumerate(reasons) if r is not None)
            if not self.peers.alone:
                reason = f"{reason} (on rank {rank})"
            self.guard_log.write(done, reason)
            return reason, "guard" if stop else "target"
        if signalled:
            return f"{self.stop_requests.signal_name} at update step {done}", "signal"
        return None, ""

    def train_loop(self) -> RunSummary:
        from octfw.rundir import write_summary

        engine, total = self.recipe.engine, self.total
        if self.backend.is_main_process:
            # Where the run is and what it trains, before the first step: a long run is watched
            # from another terminal, and the resolved recipe is what --set made of the file.
            log.info("run folder: %s (resolved recipe: %s)", self.run_dir, self.run_dir / "recipe.toml")
            if self.resumed_from is not None:
                log.info("resuming at update step %d of %d from %s", self.start_step, total, self.resumed_from)
            log.info(domain_report(self.parts.dataset, engine.domain_sampling))
            log.info(self.layout.describe())
            workers, why = self.loader_workers
            log.info("data loader: %s per process (%s)", counted(workers, "worker"), why)
        for logger in self.parts.loggers:
            logger.start(total, self.run_dir, self.parts.ctx.recipe)
        started, done, stopped, finished_early, peer_lost = time.perf_counter(), self.start_step, None, None, None
        preempted = False
        stops = self.stop_requests
        vanished = False
        with self.heartbeat:
            try:
                for update_step in range(self.start_step, total):
                    norm, out = self.update(update_step)
                    done = update_step + 1
                    if done == self.start_step + 1:  # compiled, warmed up: a signal now stops after a step
                        stops.start_training(self.backend.kind)
                    self.heartbeat.beat(done)
                    for logger in self._step_listeners:
                        self._deferring_stops(logger.on_step, done)
                    if self.is_log_step(done):
                        self.log(done, norm, out)
                    self.evaluate(done)
                    self.saver.poll()  # reports a finished background save (no wait)
                    reason, by = self.agree_to_stop(done)
                    if reason is not None:
                        finished_early, stopped = (reason, None) if by == "target" else (None, reason)
                        preempted, vanished = by == "signal", by == "vanished"
                        break
                    every = engine.checkpoint_every_steps
                    if every and done % every == 0 and done != total:
                        self.save_checkpoint(done)
            except StopNow as why:
                preempted, stopped = True, f"{why} during update step {done + 1} (abandoned; step {done} is the last)"
            except StoppedBeforeTraining as why:  # in the first update step: nothing of it to save
                for logger in self.parts.loggers:
                    logger.finish({"update_steps": self.start_step, "stopped": str(why)})
                raise
            except PeerLost as lost:
                peer_lost = stopped = str(lost)
            except RuntimeError as exc:  # DDP's own collectives: a lost peer, or a bug (re-raised)
                lost = self.peers.lost(exc)
                if lost is None:
                    raise
                log.debug("the collective that lost a peer", exc_info=exc)
                peer_lost = stopped = str(lost)
            stops.closing()
            # The last checkpoint of the run (end, guard stop or preemption), awaited with a deadline,
            # and its outcome shared: every process ends the same way. Not after a lost peer: the
            # others cannot hear the outcome.
            final_save_failed, fallback = False, None
            if vanished:  # every process: exit 74; rank 0 puts the folder back with the final state
                gone = self._vanished() if self.backend.is_main_process else []
                final_save_failed, fallback = True, self._restore_run_folder(done, gone) if gone else None
            elif peer_lost is None and not stops.stop_now and (done > self.start_step or self.upload_fallback):
                final_save_failed, fallback = self.save_final(done)  # rank 0's outcome: (False, None) elsewhere
                try:
                    final_save_failed, fallback = self.peers.broadcast((final_save_failed, fallback))
                except PeerLost as lost:  # rank 0 keeps what it knows; the others cannot know it
                    peer_lost = stopped = str(lost)
            elif self.backend.is_main_process and stops.stop_now:
                self.saver.cancel_in_flight(done)
            finished = done == total or finished_early is not None
            encoder = self.export_encoder(done) if finished and not final_save_failed and not peer_lost else None

        elapsed = time.perf_counter() - started
        samples_per_s = (done - self.start_step) * self.samples_per_update / max(elapsed, 1e-9)
        summary = RunSummary(
            run_dir=self.run_dir, update_steps=done, total_update_steps=total,
            first_loss=self.first_loss, last_loss=self.last_loss,
            skipped_updates=int(self.totals.skipped.cpu().item()),
            samples_per_s=samples_per_s, elapsed_s=elapsed,
            checkpoint=self._newest_checkpoint(peer_lost is not None),
            failed_saves=self.saver.failed,
            skipped_saves=len(self.saver.skipped), preempted=preempted,
            interrupted=stops.stop_now, final_save_failed=final_save_failed,
            fallback_checkpoint=fallback, encoder=encoder, peer_lost=peer_lost,
            data_wait_share=round(min(self._data_wait_total_s / elapsed, 1.0), 4) if elapsed > 0 else None,
            quarantined=len(self.quarantine), stopped=stopped, finished_early=finished_early,
            device=self.device_name, attention=self.attention_kernels,
            mfu=mfu(self.flops_per_sample, samples_per_s, self.peak_flops, self.backend.device_count),
        )
        if self.backend.is_main_process:
            try:
                write_summary(self.run_dir, summary.as_dict(), self.quarantine)
            except OSError as exc:  # out of space or inodes: the exit code and the final line still say it
                log.error("summary.json could not be written: %s",
                          storage_cause(exc, str(self.run_dir)) or f"{type(exc).__name__}: {exc}")
        for logger in self.parts.loggers:
            logger.finish(summary.as_dict())
        if peer_lost is None:  # every process leaves together, after rank 0 has written everything
            try:
                self.peers.barrier()
            except PeerLost as lost:  # the run is saved and summarised: a peer gone now changes nothing
                log.warning("%s after the run ended", lost)
        stops.done()
        return summary

    def _newest_checkpoint(self, peer_lost: bool) -> str | None:
        """The newest complete checkpoint, for the summary and the final line: the one this run
        wrote last, else the newest on disk (a resumed run, a stop before the first save). After a
        lost process, read from the disk once a save still in flight has settled (checked, not
        assumed), by any rank: rank 0 may be the one lost."""
        if peer_lost:
            self.saver.wait(self.recipe.engine.save_deadline_s)
        elif self.saver.latest or not self.backend.is_main_process:
            return self.saver.latest
        try:
            return self.parts.checkpointer.latest()
        except Exception:  # noqa: BLE001 - the store is away: the summary says none was found
            return None


class _ResumedSchedule:
    """The schedule a resumed run follows: the old one before ``start``, the new one from it
    (LRs of None resolved to each recipe's base LR), for the pre-flight check."""

    def __init__(self, old: Any, old_base_lr: float, new: Any, new_base_lr: float, start: int):
        self.parts, self.start = ((old, old_base_lr), (new, new_base_lr)), start
        self.warmup_steps = old.warmup_steps if isinstance(old, WarmupSchedule) else None

    def _at(self, step: int) -> tuple[Any, float]:
        return self.parts[step >= self.start]

    def lr(self, step: int) -> float:
        schedule, base = self._at(step)
        value = schedule.lr(step)
        return base if value is None else value

    def weight_decay(self, step: int) -> float | None:
        return self._at(step)[0].weight_decay(step)

    def ema_momentum(self, step: int) -> float | None:
        return self._at(step)[0].ema_momentum(step)


def _changed_schedule_problem(trained_with: dict[str, Any], recipe: Recipe, registry: Registry, parts: Any,
                              layout: Any, start: int) -> str | None:
    """None when the old schedule up to ``start`` and the new one after it make a schedule that
    the pre-flight check takes; else why not, in one line."""
    from octfw.engine.build import plan_update_steps
    from octfw.recipe import validate
    from octfw.schedules import validate_schedule

    old_recipe = validate(trained_with, registry, recipe.source)
    _per_epoch, old_total = plan_update_steps(old_recipe, len(parts.dataset), layout)
    old = old_recipe.scheduler.build(attrs.evolve(parts.ctx, total_update_steps=old_total))
    combined = _ResumedSchedule(old, old_recipe.engine.base_lr, parts.scheduler, recipe.engine.base_lr, start)
    problems = validate_schedule(combined, parts.ctx.total_update_steps, recipe.engine.base_lr,
                                 combined.warmup_steps)
    if not problems:
        return None
    return (f"the run's schedule up to update step {start} followed by the new one is refused: "
            f"{'; '.join(problems)}")


def _readable(location: str) -> bool:
    """Whether this process sees the checkpoint file ``location`` (a path or an fsspec URL)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(location)
        return bool(fs.exists(path))
    except Exception:  # noqa: BLE001 - unreachable counts as unreadable; the refusal says where
        return False


def train(recipe: Recipe, registry: Registry, run_dir: Path, *, resume: str | None = None,
          processes: Processes | None = None, peers: Peers | None = None,
          stop_requests: StopRequests | None = None, allow_recipe_change: bool = False) -> RunSummary:
    return Trainer(recipe, registry, run_dir, resume, processes=processes, peers=peers,
                   stop_requests=stop_requests, allow_recipe_change=allow_recipe_change).run()
