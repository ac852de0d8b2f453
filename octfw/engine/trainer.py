"""The training loop. Read it top to bottom: build, loop, summarise.

Counting: ``grad_accum_steps`` micro-steps make one *update step*. The
scheduler, EMA, guards, logging and checkpoint intervals all count update
steps. Device-to-host syncs happen at log steps and checkpoint steps only.

Many processes train as one run: every decision that stops, skips or
resumes it (a signal on any process, a guard's stop or done, which
checkpoint to continue, the final save's outcome) is agreed through
:class:`~octfw.engine.distributed.Peers` before anyone acts on it, so every
process stops after the same update step, and rank 0 alone writes.

Around the loop: resuming (:mod:`~octfw.engine.resume`), the run's end, its
final save and summary (:mod:`~octfw.engine.run_end`), throughput and MFU
(:mod:`~octfw.engine.throughput`), the sums kept between log steps
(:mod:`~octfw.engine.records`) and the optimizer (:mod:`~octfw.engine.optim`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from octfw.engine.attention import record_attention
from octfw.engine.backend import select_backend, training_forward
from octfw.engine.build import build_components, check_schedule
from octfw.engine.checkpointing import BackgroundSaver, ShardedSaves
from octfw.engine.data import SampleSource, loader_workers, make_loader, stating_shared_memory
from octfw.engine.distributed import Peers, PeerLost, all_reduce_, min_across_ranks
from octfw.engine.domains import domain_report
from octfw.engine.heartbeat import Heartbeat
from octfw.engine.metrics import log_metrics
from octfw.engine.optim import apply_schedule, held_momentum, make_optimizer, seed_everything
from octfw.engine.preemption import StopNow, StoppedBeforeTraining, StopRequests
from octfw.engine.quarantine import Quarantine
from octfw.engine.records import DeviceTotals, GuardLog, device_metrics, model_metrics
from octfw.engine.plan import RunPlan, planned_folder
from octfw.engine.resume import check_recipe_change
from octfw.engine.run_end import FALLBACK_DIR, SAVE_FAILED_EXIT_CODE, Ending, RunEnd, RunSummary, fallback_storage
from octfw.engine.state import TrainingState, checkpoint_nbytes, dataset_fingerprint, restore
from octfw.engine.throughput import Throughput
from octfw.engine.sharding import meta_twin, replicated_scalars, whole_outside_blocks
from octfw.engine.update import grad_norm, step_unless_vetoed
from octfw.recipe import Recipe
from octfw.registry import Registry
from octfw.engine.schedules import effective_lr
from octfw.display.tables import counted
from octfw.types import (DOMAIN_ID_KEY, ClaimingCheckpointer, EMAModel, GuardInputs, ModelOutput, StepListener,
                         StopTraining, TrainingDone)

__all__ = ["train", "Trainer", "RunSummary", "SAVE_FAILED_EXIT_CODE", "FALLBACK_DIR"]

log = logging.getLogger(__name__)


class Trainer:
    """Trains the run ``plan`` describes (:mod:`octfw.engine.plan`: its folder, the checkpoint
    it continues, this process among the job's). ``peers``: the job's other processes (default:
    this process alone). ``stop_requests``: the signal handling of the command (default: one for
    the training loop). ``compare_recipe``: False for a replay, which changes the device and
    precision on purpose."""

    def __init__(self, plan: RunPlan, registry: Registry, *, peers: Peers | None = None,
                 stop_requests: StopRequests | None = None, compare_recipe: bool = True):
        recipe, run_dir = plan.recipe, plan.run_dir
        seed_everything(recipe.run.seed)
        self.recipe, self.run_dir = recipe, run_dir
        engine = recipe.engine
        self.backend = backend = select_backend(plan.processes, engine.precision, engine.compile, engine.parallelism)
        self.peers = peers or Peers(plan.processes)
        #: the global batch arithmetic, worked out once: build, resume, data position, throughput
        self.layout = layout = backend.batch_layout(engine.per_device_batch, engine.grad_accum_steps,
                                                    engine.global_batch, kept=plan.trained_batch)
        # A resumed run's checkpoint restores the weights: [model] init is not read again.
        self.parts = parts = build_components(recipe, registry, run_dir=run_dir, rank=backend.rank, layout=layout,
                                              apply_init=plan.resume_from is None)
        check_schedule(recipe, parts)
        self.model = parts.model.to(backend.device)
        self.forward = training_forward(self.model, backend, compile=engine.compile,  # sharded: before the optimizer
                                        reshard_after_forward=engine.reshard_after_forward)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.model, recipe, backend)
        self.total = parts.ctx.total_update_steps
        self.fingerprint = dataset_fingerprint(parts.dataset)

        self.resumed_from = plan.resume_from
        self.start_step, run_record = 0, {}
        if self.resumed_from is not None:
            self.start_step, run_record = restore(self.resumed_from, parts, self.model, self.optimizer,
                                                  layout=layout, fingerprint=self.fingerprint, sharded=backend.sharded)
            if compare_recipe:
                check_recipe_change(run_record.get("recipe"), recipe, registry, plan.allow_recipe_change,
                                    resumed_from=self.resumed_from, start_step=self.start_step, parts=parts,
                                    layout=layout, run_dir=run_dir, writes=backend.is_main_process,
                                    trained_batch=run_record.get("global_batch"))
        self.throughput = Throughput(backend, layout, engine, self.start_step)
        self.flop_model = meta_twin(recipe, registry) if backend.sharded else self.model  # FLOPs: on meta tensors

        source = SampleSource(parts.dataset, parts.transform, recipe.run.seed, parts.domains)
        self.loader_workers = loader_workers(engine.num_workers, backend.kind)
        loader = make_loader(source, engine.per_device_batch * backend.local_devices, recipe.run.seed,
                             self.throughput.samples_done(self.start_step), self.loader_workers[0],
                             backend.rank, backend.world_size, domain_sampling=engine.domain_sampling,
                             views_to_device=backend.kind != "cpu", pin_memory=backend.kind == "cuda")
        self.batches = iter(backend.device_batches(stating_shared_memory(loader), parts.transform.batch_spec()))
        writes = run_dir if backend.is_main_process else None  # only rank 0 writes files
        self.quarantine, self.guard_log = Quarantine(writes), GuardLog(writes)
        self.totals = DeviceTotals(backend.device, len(parts.domains))
        self._applied = torch.ones((), dtype=torch.bool, device=backend.device)  # the verdict without guards
        self._vetoed = torch.zeros((), dtype=torch.bool, device=backend.device)  # a guard that stopped the run
        self.heartbeat = Heartbeat(engine.heartbeat_s)
        #: the run's first logged loss (carried by its checkpoints across attempts) and its latest
        self.first_loss, self.last_loss = run_record.get("first_loss"), None
        #: sharded, and the checkpointer takes slices: every process writes its own (else rank 0 the whole state)
        self.sharded_saves = ShardedSaves.for_run(backend.sharded, parts.checkpointer, engine.collective_timeout_s)
        self.state = TrainingState(parts, self.model, self.optimizer, layout=layout, fingerprint=self.fingerprint,
                                   samples_done=self.throughput.samples_done, first_loss=lambda: self.first_loss,
                                   main=backend.is_main_process)
        self.saver = BackgroundSaver(parts.checkpointer, self.sharded_saves)
        #: the command's signal handling, or one of the loop's own (``octfw.train`` in a notebook)
        self.stop_requests, self._own_stop_requests = (stop_requests or StopRequests(), stop_requests is None)
        self.run_end = RunEnd(recipe, parts, self.model, backend, peers=self.peers, saver=self.saver,
                              fallback=fallback_storage(run_dir), upload_fallback=plan.from_fallback,
                              state=self.state, stop_requests=self.stop_requests, heartbeat=self.heartbeat,
                              sharded_saves=self.sharded_saves, quarantine=self.quarantine, run_dir=run_dir,
                              start_step=self.start_step,
                              unrecorded_batch=None if plan.trained_batch else layout.global_batch)
        #: a guard's or logger's StopTraining/TrainingDone here, acted on once every process heard it
        self._pending: StopTraining | None = None
        self._skipped_seen = 0.0
        self._step_listeners = [lg for lg in parts.loggers if isinstance(lg, StepListener)]
        self.attention_kernels: str | None = None  # seen in the first eager micro-step

    # --- the loop ----------------------------------------------------------

    def run(self) -> RunSummary:
        """Hold the checkpoint folder (rank 0), train, summarise."""
        checkpointer = self.parts.checkpointer
        claiming = isinstance(checkpointer, ClaimingCheckpointer)
        if claiming:  # before an hour is spent; a refusal (a folder in use, no room) is every process's
            self.peers.decide(lambda: checkpointer.claim(checkpoint_nbytes(self.model, self.parameters)))
        try:
            if self._own_stop_requests:
                with self.stop_requests:
                    return self.train_loop()
            return self.train_loop()
        finally:
            if claiming:
                checkpointer.release()

    def train_loop(self) -> RunSummary:
        """Every update step until the last or a stop every process agrees on; then the run's end."""
        engine, total, stops = self.recipe.engine, self.total, self.stop_requests
        self.say_what_runs()
        for logger in self.parts.loggers:
            logger.start(total, self.run_dir, self.parts.ctx.recipe)
        started, end = time.perf_counter(), Ending(done=self.start_step)
        with self.heartbeat:
            try:
                for update_step in range(self.start_step, total):
                    norm, out = self.update(update_step)
                    end.done = done = update_step + 1
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
                        end.finished_early, end.stopped = (reason, None) if by == "target" else (None, reason)
                        end.preempted, end.vanished = by == "signal", by == "vanished"
                        break
                    if (every := engine.checkpoint_every_steps) and done % every == 0 and done != total:
                        self.save_checkpoint(done)
            except StopNow as why:
                end.preempted = True
                end.stopped = f"{why} during update step {end.done + 1} (abandoned; step {end.done} is the last)"
            except StoppedBeforeTraining as why:  # in the first update step: nothing of it to save
                for logger in self.parts.loggers:
                    logger.finish({"update_steps": self.start_step, "stopped": str(why)})
                raise
            except PeerLost as lost:
                end.peer_lost = end.stopped = str(lost)
            except RuntimeError as exc:  # DDP's own collectives: a lost peer, or a bug (re-raised)
                lost = self.peers.lost(exc)
                if lost is None:
                    raise
                log.debug("the collective that lost a peer", exc_info=exc)
                end.peer_lost = end.stopped = str(lost)
            stops.closing()
            self.run_end.close(end)  # the final save (or its fallback), the encoder export
        elapsed = time.perf_counter() - started
        summary = self.run_end.summarise(
            end, first_loss=self.first_loss, last_loss=self.last_loss,
            skipped_updates=int(self.totals.skipped.cpu().item()), attention=self.attention_kernels,
            **self.throughput.run_figures(end.done - self.start_step, elapsed))
        stops.done()
        return summary

    def say_what_runs(self) -> None:
        """Where the run is and what it trains, before the first step (rank 0): a long run is
        watched from another terminal, and the resolved recipe is what --set made of the file."""
        if not self.backend.is_main_process:
            return
        log.info("run folder: %s (resolved recipe: %s)", self.run_dir, self.run_dir / "recipe.toml")
        if self.resumed_from is not None:
            log.info("resuming at update step %d of %d from %s", self.start_step, self.total, self.resumed_from)
        log.info(domain_report(self.parts.dataset, self.recipe.engine.domain_sampling))
        log.info(self.layout.describe())
        workers, why = self.loader_workers
        log.info("data loader: %s per process (%s)", counted(workers, "worker"), why)

    def agree_to_stop(self, done: int) -> tuple[str | None, str]:
        """After update step ``done``: (why every process stops now, or None; what stops it:
        "guard", "target" (a target reached), "signal" or "vanished" (the run folder was
        deleted)). One tiny all-reduce of host values over the peers' own gloo group: the device
        stream is never waited on. The reason travels only when there is one, and so do the
        files another process quarantined."""
        pending = self._pending
        signal_vote = self.stop_requests.local_vote(done)
        gone = self.run_end.vanished() if self.backend.is_main_process else []  # a stat per file: cheap
        stop, finished, signalled, vanished, quarantined = self.peers.max([
            int(pending is not None and not isinstance(pending, TrainingDone)),
            int(isinstance(pending, TrainingDone)), signal_vote, int(bool(gone)), len(self.quarantine.unshared)])
        if quarantined:  # files another process met: rank 0 lists them, every process counts them
            for entries in self.peers.gather(self.quarantine.take_unshared()):
                self.quarantine.record(entries, heard=True)
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

    # --- one update step ------------------------------------------------

    def is_log_step(self, done: int) -> bool:
        return done % self.recipe.engine.log_every_steps == 0 or done == self.total

    def update(self, update_step: int) -> tuple[torch.Tensor | None, ModelOutput]:
        """grad_accum micro-steps, one guarded optimizer step, EMA. No host sync.

        Returns the gradient norm (None when neither a guard nor this step's
        log needs it) and the last micro-step's model output."""
        engine, schedule, backend = self.recipe.engine, self.parts.scheduler, self.backend
        apply_schedule(self.optimizer, schedule.lr(update_step), schedule.weight_decay(update_step), update_step)

        step_loss = torch.zeros((), device=backend.device)
        provenance = []
        accum = self.layout.grad_accum_steps
        for micro in range(accum):
            self.heartbeat.waiting_on("the data loader")
            batch = self.throughput.next_batch(self.batches)  # the wait is counted: data_wait_share
            self.heartbeat.waiting_on("forward/backward (tracing or compiling on xla)")
            self.quarantine.record(batch["quarantined"])
            provenance += batch["provenance"]
            last_micro = micro == accum - 1
            sync = backend.accumulating(self.forward, last_micro)  # gradients reduced on the last micro-step only
            # The attention kernel that really ran, named in the summary: seen in the first eager micro-step
            # (a dispatch mode, too slow to keep on; not in compiled code, nor sharded: FSDP swaps storage).
            first = update_step == self.start_step and micro == 0 and not (engine.compile or backend.sharded)
            with sync, (record_attention() if first else contextlib.nullcontext()) as seen:
                with backend.forward_context():
                    out: ModelOutput = self.forward(batch["tensors"])
                (out.loss / accum).backward()
            step_loss += out.loss.detach().float() / accum
            if seen is not None:
                self.attention_kernels = ", ".join(sorted(seen.kernels)) or None
            if update_step == self.start_step and micro == 0:
                self.throughput.announce_step_time()
            self.totals.add_domain_losses(out, batch["tensors"][DOMAIN_ID_KEY])
            if not last_micro:
                # One XLA graph per micro-step, so that a graph holds one
                # micro-batch's activations, as accumulation intends: with the
                # whole update in one graph XLA:CPU planned twice the memory
                # for `small` at the seeds' size (benchmarks/accelerators/README.md).
                backend.step_boundary()
        self.guard_log.remember(update_step + 1, provenance)
        if backend.across_processes:  # every rank's guards see the same (mean) loss; SPMD's is global already
            all_reduce_(step_loss)
            step_loss /= backend.world_size

        # Measured before clipping and zero_grad, when guards or the log read it.
        guards = self.parts.guards
        norm = grad_norm(self.parameters) if guards or self.is_log_step(update_step + 1) else None
        inputs = GuardInputs(update_step, step_loss, norm, tuple(self.parameters),
                             effective_lr(schedule, update_step, engine.base_lr))
        verdict = None
        with replicated_scalars(backend.sharded):  # the job's norm, verdict and momentum meet sharded tensors
            for guard in guards:
                vote = self._deferring_stops(guard.before_step, inputs, veto=self._vetoed)
                if vote is not None:
                    verdict = vote if verdict is None else verdict & vote
            if verdict is not None and backend.across_processes:
                verdict = min_across_ranks(verdict)  # every rank takes the same decision
            step_unless_vetoed(self.optimizer, verdict)
            ok = self._applied if verdict is None else verdict
            momentum = held_momentum(self.optimizer, update_step, schedule.ema_momentum(update_step))
            if momentum is not None and isinstance(self.model, EMAModel):
                # Momentum 1.0 leaves the EMA untouched when the update was skipped.
                self.model.ema_update(torch.where(ok, backend.scalar(momentum), 1.0))
        self.optimizer.zero_grad(set_to_none=True)
        self.totals.add_update(ok, step_loss)
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

    # --- log and checkpoint steps ----------------------------------------

    def log(self, done: int, norm: torch.Tensor, out: ModelOutput) -> None:
        """Read every metric from the device in one transfer; hand host floats to loggers."""
        self.heartbeat.waiting_on("the device (reading metrics)")
        host = model_metrics(self.totals.read(self.backend, grad_norm=norm, **device_metrics(out)), out)
        schedule, engine = self.parts.scheduler, self.recipe.engine
        metrics = log_metrics(
            host, **self.throughput.interval(done, self.flop_model),
            epoch=self.throughput.samples_done(done) * self.backend.world_size / len(self.parts.dataset),
            lr=effective_lr(schedule, done - 1, engine.base_lr),
            ema_momentum=schedule.ema_momentum(done - 1), domains=self.parts.domains,
        )
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

    def evaluate(self, done: int) -> None:
        """Run the evaluators due at this step on rank 0, which logs them (sharded, on every process: each
        forward needs all); the others wait at the next collective. Never on the training RNG stream."""
        due = [(spec, ev) for spec, ev in zip(self.recipe.evaluators, self.parts.evaluators)
               if (ev.every_steps and done % ev.every_steps == 0) or done == self.total]
        if not due or not (self.backend.is_main_process or self.backend.sharded):  # sharded: every rank's forward
            return
        self.heartbeat.waiting_on("evaluation")
        started = time.perf_counter()
        results: dict[str, float] = {}
        devices = [self.backend.device] if self.backend.kind == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), \
                whole_outside_blocks(self.model, self.backend.sharded):
            for spec, evaluator in due:
                for key, value in evaluator.evaluate(self.model, self.backend.device, done).items():
                    results[f"eval/{spec.name}/{key}"] = float(value)
        for logger in self.parts.loggers:
            logger.log(done, results)
        # Evaluation time is not training time: leave it out of the throughput clock.
        self.throughput.leave_out(time.perf_counter() - started)

    def save_checkpoint(self, done: int) -> None:
        """Hand a checkpoint to the background saver; skipped, without a copy, while the previous
        one is still being written. Rank 0 saves the whole state (sharded: every process gathers it
        first), or every process its own slices (:class:`ShardedSaves`), skipped by all if one still writes."""
        self.heartbeat.waiting_on("the checkpoint save")
        if self.sharded_saves:
            job_busy = not self.peers.all_agree(not self.saver.busy)
            self.saver.submit(done, lambda: self.state.slices(done), job_busy=job_busy)
        else:
            state = self.state.whole(done) if self.backend.sharded else None  # a collective: every rank, every save
            if self.backend.is_main_process:
                self.saver.submit(done, lambda: state or self.state.whole(done))

def train(recipe: Recipe, registry: Registry, run_dir: Path, *, resume: str | None = None,
          stop_requests: StopRequests | None = None, allow_recipe_change: bool = False) -> RunSummary:
    """Train ``recipe`` in ``run_dir``, a folder already made, as this process alone (tests,
    notebooks with their own folders; ``octfw run`` and ``octfw.train`` plan the folder too).
    The folder is held while it trains, as ``octfw run`` holds it: a second trainer into it is
    refused (:class:`~octfw.storage.owner.FolderInUse`)."""
    with planned_folder(recipe, registry, run_dir, resume, allow_recipe_change=allow_recipe_change) as plan:
        return Trainer(plan, registry, stop_requests=stop_requests).run()
