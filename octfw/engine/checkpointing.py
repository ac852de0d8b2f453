"""Checkpoints written in the background: the training loop pays only for a host copy.

At a checkpoint step the engine copies the training state to host memory
(:class:`octfw.engine.state.TrainingState`) and hands it to :class:`BackgroundSaver`,
whose thread serialises and writes it through the checkpointer (local disk
or an object store) while training goes on. The checkpointer's own rules stay
as they are: atomic files, the ``latest`` pointer written last.

A sharded run (:class:`ShardedSaves`) gathers nothing: every process copies
its own slices and its saver thread writes them, together with the others',
over a gloo group of the saves' own (``save_sharded``). The rules below then
hold for the job: a save is skipped by every process when one is still
writing, and the final save's outcome is the job's.

Rules:

- At most one save is in flight. A save that comes due while the previous
  one is still being written is *skipped*: one warning line when it happens,
  and it counts among the failed saves of the summary (a save that did not
  happen); the next due save tries again. So a slow or unreachable store
  makes checkpoints rarer, never training slower, and never silently.
- A failed save is reported once: one warning line on the console naming
  the cause (no space left, with bytes free and needed; permission denied;
  store unreachable), the traceback in ``octfw.log``, and a line in the run
  summary. Training goes on: the next due save tries again.
- The final save (the end of the run, or a stop on SIGTERM) first waits for
  the save in flight, then writes its own and waits for it, all within
  ``engine.save_deadline_s``, and says whether it was written: the trainer
  turns a failed final save into a fallback copy and a non-zero exit
  (:mod:`octfw.engine.run_end`). What is still being written at the deadline
  is reported as failed; its thread is a daemon, so the process does not
  wait for it, and the pointer-last rule means a write cut short is never
  loaded.
- ``stop_now`` (a second Ctrl-C) ends the wait at once: the checkpointer is
  asked to ``cancel()`` the write in flight, which removes its temporary
  file, and the last complete checkpoint stays the newest.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from octfw.storage.failures import storage_cause
from octfw.types import CancellableCheckpointer, LocatedCheckpointer, ShardedCheckpointer

__all__ = ["BackgroundSaver", "ShardedSaves"]

logger = logging.getLogger(__name__)


# How often a wait for the final save looks at the stop-now request.
_POLL_S = 0.1


def state_nbytes(value: Any) -> int:
    """Bytes of the tensors in a captured state: about what its checkpoint file takes."""
    if hasattr(value, "nbytes") and hasattr(value, "dtype"):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(state_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_nbytes(v) for v in value)
    return 0


def _gloo_group(timeout_s: float) -> Any:
    import datetime

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class ShardedSaves:
    """Every process of a sharded run writes its own slices of each checkpoint, together, over
    ``group``: no process gathers the whole state."""

    def __init__(self, group: Any, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s

    def fresh(self) -> "ShardedSaves":
        """The same over a new group: for the fallback copy, which may follow a save given up at
        its deadline while its thread still waits in a collective of the old group (two
        collectives at once on one group would cross). Every process calls it, together."""
        return ShardedSaves(_gloo_group(self.timeout_s), self.timeout_s)

    @classmethod
    def for_run(cls, sharded: bool, checkpointer: Any, timeout_s: float) -> "ShardedSaves | None":
        """For a sharded run whose checkpointer takes slices (a :class:`~octfw.types.ShardedCheckpointer`);
        None where rank 0 saves a gathered state instead. The group is gloo and the saves' own: a
        save's collectives run off the training thread, beside the training's (as torchtitan's
        asynchronous saves do). Every process calls it at the same point (a group is made together)."""
        if not (sharded and isinstance(checkpointer, ShardedCheckpointer)):
            return None
        return cls(_gloo_group(timeout_s), timeout_s)

    def write(self, checkpointer: Any) -> Callable[[int, Any], str]:
        """The background saver's write: ``(update_step, (slices, plain part))`` into ``checkpointer``."""
        return lambda update_step, state: checkpointer.save_sharded(update_step, *state, self.group)


class _Save:
    """One checkpoint being written on its own daemon thread."""

    def __init__(self, update_step: int, write: Callable[[], str | None], nbytes: int = 0):
        self.update_step = update_step
        self.nbytes = nbytes
        self.location: str | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._write = write
        threading.Thread(target=self._run, name=f"octfw-checkpoint-{update_step}", daemon=True).start()

    def _run(self) -> None:
        try:
            self.location = self._write()
        except BaseException as exc:  # noqa: BLE001 - reported by the saver, training goes on
            self.error = exc
        finally:
            self.finished.set()


class BackgroundSaver:
    """Writes checkpoints with ``checkpointer.save(update_step, state)`` off the training thread,
    or, with ``sharded``, ``checkpointer.save_sharded`` (every process writes its part, together)."""

    def __init__(self, checkpointer: Any, sharded: ShardedSaves | None = None):
        self.checkpointer = checkpointer
        self._write = sharded.write(checkpointer) if sharded else checkpointer.save
        self.latest: str | None = None  #: location of the newest checkpoint written
        self.written_step: int | None = None  #: the update step of that checkpoint
        self.failed: list[str] = []  #: "step N: error", one per failed save
        self.skipped: list[int] = []  #: update steps whose save was skipped (one in flight)
        self._in_flight: _Save | None = None
        self._overrun_cause: str | None = None  #: why saves overrun, until one settles

    @property
    def busy(self) -> bool:
        self.poll()
        return self._in_flight is not None

    def submit(self, update_step: int, capture: Callable[[], Any], *, job_busy: bool | None = None) -> bool:
        """Start writing the state ``capture()`` returns (a host copy the loop no longer
        touches); False, without calling ``capture``, if the save is skipped. ``job_busy``:
        whether any process of the job is still writing (a sharded save, which every process
        writes together, is skipped by all or by none)."""
        if self.busy or job_busy:
            self.skipped.append(update_step)
            writing = (f"the save of update step {self._in_flight.update_step} was" if self._in_flight is not None
                       else "another process's part of the previous save was")
            reason = f"not written: {writing} still being written ({self._store_state()})"
            self.failed.append(f"step {update_step}: {reason}")
            logger.warning("checkpoint at update step %d %s; the next due save tries again", update_step, reason)
            return False
        state = capture()
        self._in_flight = _Save(update_step, lambda: self._write(update_step, state), state_nbytes(state))
        return True

    def poll(self) -> None:
        """Settle the save in flight if it has finished (cheap: no wait)."""
        if self._in_flight is not None and self._in_flight.finished.is_set():
            self._settle()

    def wait(self, timeout_s: float, stop_now: Callable[[], bool] = lambda: False) -> bool:
        """Wait at most ``timeout_s`` for the save in flight, or until ``stop_now()``; False if
        it is still being written."""
        save = self._in_flight
        if save is None:
            return True
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while not save.finished.wait(max(0.0, min(_POLL_S, deadline - time.monotonic()))):
            if stop_now() or time.monotonic() >= deadline:
                return False
        self._settle()
        return True

    def save_final(self, update_step: int, capture: Callable[[], dict[str, Any]], deadline_s: float,
                   stop_now: Callable[[], bool] = lambda: False) -> bool:
        """The last save of a run: wait for the one in flight, write this one, wait for it,
        all within ``deadline_s``; True once it is written. ``capture`` takes the host copy
        only if it will be written. ``stop_now()`` true: cancel and return False at once."""
        started = time.monotonic()
        in_flight = self._in_flight
        if in_flight is None or in_flight.update_step != update_step:  # not already being written
            if not self.wait(deadline_s, stop_now):  # only ever False with a save in flight
                return self._give_up(update_step, stop_now(), f"not written: the save of update step "
                                     f"{in_flight.update_step} was still being written after {deadline_s:g} s "
                                     f"({self._store_state()})")
            if stop_now():
                return self._give_up(update_step, stopping=True)
            self.submit(update_step, capture)
        if not self.wait(deadline_s - (time.monotonic() - started), stop_now):
            return self._give_up(update_step, stop_now(), f"still being written after engine.save_deadline_s "
                                 f"= {deadline_s:g} s; the run ends without it (an unfinished write is never loaded)")
        return self.written_step == update_step

    def _store_state(self) -> str:
        """Why a save overruns, asked once per overrun streak: an unreachable store says so."""
        if self._overrun_cause is None:
            from octfw.storage.reach import unreachable

            where = self._location()  # the built-ins name their folder
            cause = unreachable(where) if isinstance(where, str) else None
            self._overrun_cause = f"the store is unreachable: {cause}" if cause else "a slow store"
        return self._overrun_cause

    def _give_up(self, update_step: int, stopping: bool, reason: str = "") -> bool:
        """Give up the final save (False): on a stop-now request, cancel the write in flight."""
        if stopping:
            self.cancel_in_flight(update_step)
            return self.written_step == update_step  # the write may have completed all the same
        self._in_flight = None
        self._fail(update_step, reason, final=True)
        return False

    def cancel_in_flight(self, update_step: int) -> None:
        """Stop now (a second signal): the write in flight is cancelled (its temporary file
        removed), and the last complete checkpoint stays the newest."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and in_flight.finished.is_set():
            self._in_flight = in_flight
            self._settle()  # it finished after all: it is complete, and counts
            return
        if in_flight is not None and isinstance(self.checkpointer, CancellableCheckpointer):
            self.checkpointer.cancel()
            in_flight.finished.wait(5.0)  # a cancelled write ends at its next block
            if in_flight.finished.is_set() and in_flight.error is None:  # it completed all the same
                self._in_flight = in_flight
                self._settle()
                return
        self.failed.append(f"step {update_step}: cancelled by a second stop signal")
        logger.warning("the checkpoint of update step %d was not written: stopped at once by a second signal "
                       "(the last complete checkpoint, %s, is kept)", update_step, self.latest or "none of this run")

    def _location(self) -> str | None:
        """The checkpointer's folder or URL, for messages (None: it names none)."""
        return self.checkpointer.location if isinstance(self.checkpointer, LocatedCheckpointer) else None

    def _settle(self) -> None:
        save, self._in_flight = self._in_flight, None
        self._overrun_cause = None
        if save.error is None:
            self.latest, self.written_step = save.location or self.latest, save.update_step
            return
        where = self._location() or "the checkpoint folder"
        cause = storage_cause(save.error, where, save.nbytes) or f"{type(save.error).__name__}: {save.error}"
        self._fail(save.update_step, cause, save.error)

    def _fail(self, update_step: int, error: str, exc: BaseException | None = None, final: bool = False) -> None:
        self.failed.append(f"step {update_step}: {error}")
        # One console line; the traceback goes to octfw.log only (see octfw.display.logs).
        logger.warning("%s at update step %d failed%s: %s", "the final checkpoint" if final else "checkpoint",
                       update_step, "" if final else ", training goes on", error, exc_info=exc)
