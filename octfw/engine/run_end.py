"""The end of a run: the final save, the encoder export and the summary.

The final state is never lost: before training, the checkpointer must show
that it can take a checkpoint (a probe write; room on a local disk). If the
final save fails anyway, the state goes to ``<run_dir>/fallback/`` and the
run ends with :data:`SAVE_FAILED_EXIT_CODE`; ``--resume auto`` continues from
that copy and writes it to the checkpointer once it can. A run folder
deleted under the run is put back (its start files, the final state in its
fallback) and the run ends the same way.

The final save's outcome is shared with every process (rank 0 alone
writes), so every process ends alike; after a lost process nothing is
shared, since the others cannot hear it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

from octfw.engine.backend import Backend
from octfw.engine.build import Components
from octfw.engine.checkpointing import BackgroundSaver, ShardedSaves
from octfw.engine.quarantine import Quarantine
from octfw.engine.distributed import PeerLost, Peers
from octfw.engine.heartbeat import Heartbeat
from octfw.engine.preemption import StopRequests
from octfw.engine.sharding import whole_on_main
from octfw.engine.state import TrainingState
from octfw.cli.exit_codes import SAVE_FAILED_EXIT_CODE
from octfw.recipe import Recipe
from octfw.runs.checkpoint import FALLBACK_DIR, fallback_storage
from octfw.runs.folder import record_global_batch
from octfw.storage.checkpoints import CheckpointStorage
from octfw.storage.failures import storage_cause
from octfw.types import EncoderModel, ExportableEncoder

__all__ = ["FALLBACK_DIR", "SAVE_FAILED_EXIT_CODE", "START_FILES_KEPT", "Ending", "RunEnd", "RunSummary",
           "fallback_storage"]

#: What a run folder cannot lose while it trains; gone, the run stops (exit 74) and puts them back.
START_FILES_KEPT = ("recipe.toml", "run.json", "versions.json", "git.json")

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


@attrs.define
class Ending:
    """How the loop ended (after update step ``done``), then what its end made of it."""

    done: int
    stopped: str | None = None  #: see :class:`RunSummary`
    finished_early: str | None = None
    preempted: bool = False
    vanished: bool = False  #: the run folder was deleted under the run
    peer_lost: str | None = None
    final_save_failed: bool = False
    fallback: str | None = None
    encoder: str | None = None
    #: rank 0's failed saves, heard by every process with the final save's outcome (None: this
    #: process's own saver's list, which holds rank 0's alone)
    failed_saves: list[str] | None = None


class RunEnd:
    """A run's end, for the trainer. ``state``: the training state as checkpoints take it; with
    ``sharded_saves`` each process writes its own slices, and the final save and its fallback
    are every process's. ``upload_fallback``: the run continues the fallback copy, so
    the final save must reach the checkpointer, even with no step left. ``unrecorded_batch``: the
    global batch of a run that has not recorded it yet (its first start), which rank 0 records in
    ``RUN/run.json``, where ``--resume auto`` on other devices reads it."""

    def __init__(self, recipe: Recipe, parts: Components, model: torch.nn.Module, backend: Backend, *,
                 peers: Peers, saver: BackgroundSaver, fallback: CheckpointStorage, upload_fallback: bool,
                 state: TrainingState, stop_requests: StopRequests, heartbeat: Heartbeat,
                 quarantine: Quarantine, run_dir: Path, start_step: int, unrecorded_batch: int | None = None,
                 sharded_saves: ShardedSaves | None = None):
        self.recipe, self.parts, self.model, self.backend, self.peers = recipe, parts, model, backend, peers
        self.saver, self.fallback, self.upload_fallback = saver, fallback, upload_fallback
        self.capture, self.capture_shards = state.whole, state.slices
        self.stop_requests, self.heartbeat, self.quarantine = stop_requests, heartbeat, quarantine
        self.run_dir, self.start_step = run_dir, start_step
        self.sharded_saves = sharded_saves
        if unrecorded_batch is not None and backend.is_main_process:  # the run's first start: kept on resumes
            record_global_batch(run_dir, unrecorded_batch)
        #: the run folder's start files, to put a folder deleted under the run back (rank 0)
        self._start_files = {name: (run_dir / name).read_bytes() for name in START_FILES_KEPT
                             if backend.is_main_process and (run_dir / name).exists()}

    def close(self, end: Ending) -> None:
        """The last checkpoint of the run (end, guard stop or preemption), awaited with a deadline,
        and its outcome shared: every process ends the same way. Not after a lost peer: the
        others cannot hear the outcome. Then the encoder of a finished run."""
        stops, done = self.stop_requests, end.done
        saves = end.peer_lost is None and not stops.stop_now and (
            end.vanished or done > self.start_step or self.upload_fallback)
        finished = done == self.parts.ctx.total_update_steps or end.finished_early is not None
        if self.backend.sharded and not self.sharded_saves and end.peer_lost is None and (saves or finished):
            # Gathering a sharded state is a collective: every process, once, here; the saves
            # below (rank 0's) and the encoder export take this copy. After a lost peer no
            # process can gather: the run's newest checkpoint is its last state.
            gathered = self.capture(done)
            self.capture = lambda _done: gathered
        if end.vanished:  # every process: exit 74; rank 0 puts the folder back with the final state
            gone = self.vanished() if self.backend.is_main_process else []
            seen = f"{', '.join(gone)} gone" if gone else "seen by rank 0"
            why = f"the run folder {self.run_dir} vanished during the run ({seen})"
            self.saver.failed.append(f"step {done}: {why}")
            put_back = self.put_run_folder_back(gone, why) if gone else False
            # Sharded saves: every process writes its part of the fallback (rank 0's fails alone if it must).
            end.final_save_failed = True
            end.fallback = self.save_fallback(done, why) if put_back or self.sharded_saves else None
            self._hear_outcome(end)
        elif saves:
            end.final_save_failed, end.fallback = self.save_final(done)  # rank 0's outcome: (False, None) elsewhere
            self._hear_outcome(end)
        elif self.backend.is_main_process and stops.stop_now:
            self.saver.cancel_in_flight(done)
        if finished and not end.final_save_failed and not end.peer_lost:
            end.encoder = self.export_encoder(done)

    def _hear_outcome(self, end: Ending) -> None:
        """Rank 0's final save outcome (and its failed saves) on every process: every process
        ends alike and says the same line."""
        try:
            end.final_save_failed, end.fallback, end.failed_saves = self.peers.broadcast(
                (end.final_save_failed, end.fallback, list(self.saver.failed)))
        except PeerLost as lost:  # rank 0 keeps what it knows; the others cannot know it
            end.peer_lost = end.stopped = str(lost)

    def summarise(self, end: Ending, **measured: Any) -> RunSummary:
        """The run's summary (``measured``: the loss, throughput and other fields the loop
        measured), written to RUN/summary.json (rank 0) and handed to every logger; then every
        process leaves together."""
        from octfw.runs.folder import write_summary

        summary = RunSummary(
            run_dir=self.run_dir, update_steps=end.done, total_update_steps=self.parts.ctx.total_update_steps,
            checkpoint=self.newest_checkpoint(end.peer_lost is not None), failed_saves=end.failed_saves if end.failed_saves is not None else self.saver.failed,
            skipped_saves=len(self.saver.skipped), preempted=end.preempted,
            interrupted=self.stop_requests.stop_now, final_save_failed=end.final_save_failed,
            fallback_checkpoint=end.fallback, encoder=end.encoder, peer_lost=end.peer_lost,
            quarantined=len(self.quarantine), stopped=end.stopped, finished_early=end.finished_early, **measured)
        if self.backend.is_main_process:
            try:
                write_summary(self.run_dir, summary.as_dict(), self.quarantine)
            except OSError as exc:  # out of space or inodes: the exit code and the final line still say it
                log.error("summary.json could not be written: %s",
                          storage_cause(exc, str(self.run_dir)) or f"{type(exc).__name__}: {exc}")
        for logger in self.parts.loggers:
            logger.finish(summary.as_dict())
        if end.peer_lost is None:  # every process leaves together, after rank 0 has written everything
            try:
                self.peers.barrier()
            except PeerLost as lost:  # the run is saved and summarised: a peer gone now changes nothing
                log.warning("%s after the run ended", lost)
        return summary

    def save_final(self, done: int) -> tuple[bool, str | None]:
        """The run's last checkpoint, awaited (rank 0's, or every process's part of a sharded
        save): (whether the checkpointer failed to take it, where the state went instead). A
        second Ctrl-C skips it: the user asked to stop."""
        if not (self.backend.is_main_process or self.sharded_saves):
            return False, None
        self.heartbeat.waiting_on("the checkpoint save")
        stop_now = lambda: self.stop_requests.stop_now  # noqa: E731
        capture = (lambda: self.capture_shards(done)) if self.sharded_saves else (lambda: self.capture(done))
        written = self.saver.save_final(done, capture, self.recipe.engine.save_deadline_s, stop_now)
        stopping = stop_now()
        if self.sharded_saves:  # the job's outcome: a part missing is the whole save missing
            written, stopping = self.peers.all_agree(written), not self.peers.all_agree(not stopping)
        if written:
            if self.upload_fallback and self.backend.is_main_process:  # the checkpointer holds the state now
                self.fallback.remove()
            return False, None
        if stopping:
            return False, None
        return True, self.save_fallback(done, "the final checkpoint could not be written to the checkpointer")

    def save_fallback(self, done: int, why: str) -> str | None:
        """The final state into RUN/fallback (rank 0's whole state, or every process's slices):
        where it went, or None (said why)."""
        try:
            if self.sharded_saves:
                location = self.fallback.save_sharded(done, *self.capture_shards(done), self.sharded_saves.fresh().group)
            else:
                location = self.fallback.save(done, self.capture(done))
        except Exception as exc:  # noqa: BLE001 - said on the console; the exit code says it too
            cause = storage_cause(exc, str(self.fallback.url)) or f"{type(exc).__name__}: {exc}"
            log.error("%s, and the final state could not be written to the fallback folder either: %s; the newest "
                      "complete checkpoint is %s", why, cause, self.newest_checkpoint(False) or "none", exc_info=exc)
            return None
        log.warning("%s; the final state is in %s", why, location)
        return location

    def vanished(self) -> list[str]:
        """The start files gone from the run folder (rank 0; empty while it is whole)."""
        return [name for name in self._start_files if not (self.run_dir / name).exists()]

    def put_run_folder_back(self, gone: list[str], why: str) -> bool:
        """The run folder was deleted under the run (rank 0): put its start files back, so that
        ``--resume auto`` finds it; the final state then goes into its fallback (never a
        checkpointer inside a folder that is being removed) and the run ends with exit 74."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for name, data in self._start_files.items():
                if not (self.run_dir / name).exists():
                    (self.run_dir / name).write_bytes(data)
        except OSError as exc:
            log.error("%s, and it could not be made again: %s", why, storage_cause(exc, str(self.run_dir)) or exc)
            return False
        return True

    def export_encoder(self, done: int) -> str | None:
        """RUN/encoder: the target encoder of a finished run as a Hub-style folder (rank 0,
        ``run.export_encoder``), or None. A model without a ViT3D ``encoder`` has nothing to
        export; a failed write is said and leaves the checkpoint, which ``octfw export`` reads."""
        from octfw.exports.formats import encoder_info
        from octfw.exports.writing import write_export
        from octfw.runs.folder import versions

        encoder = self.model.encoder if isinstance(self.model, EncoderModel) else None
        if not (self.recipe.run.export_encoder and isinstance(encoder, ExportableEncoder)):
            return None
        if self.backend.sharded:  # the whole encoder, rebuilt on rank 0 from the gathered state
            from octfw.exports.checkpoint import rebuild_model

            # Gathering is a collective: every process; rank 0 alone keeps the whole weights.
            state = ({"model": whole_on_main(self.model), "recipe": self.parts.ctx.recipe} if self.sharded_saves
                     else self.capture(done))
            if not self.backend.is_main_process:
                return None
            encoder = rebuild_model(state, str(self.run_dir), self.parts.ctx.registry).encoder
        elif not self.backend.is_main_process:
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

    def newest_checkpoint(self, peer_lost: bool) -> str | None:
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
