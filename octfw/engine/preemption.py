"""Stopping cleanly when the machine is about to go: SIGTERM, SIGINT, TPU preemption notices.

Spot and preemptible VMs get a SIGTERM about 30 s before they stop; Slurm's
``scancel``, a Kubernetes pod stop and Ctrl-C reach every process of the job.
:class:`StopRequests` owns SIGTERM and SIGINT (and SIGHUP and SIGQUIT, which
mean the same: :data:`STOP_SIGNALS`) from the first instruction of
``octfw run`` to its last, and what a signal means depends on where the run
is (:attr:`StopRequests.phase`):

- **starting** (imports, build, cohort, resume, and the first update step
  with its compilation): the start is abandoned at once: exit 75, "stopped
  before training began; nothing to save". ``octfw run`` ends the process
  from the handler, after its clean-up hooks (a run folder the start made is
  removed): an exception raised into an import half done would leave the
  interpreter broken. In a notebook (``octfw.train``)
  :class:`StoppedBeforeTraining` is raised instead;
- **training**: the first signal is a request that the loop reads after each
  update step. Every process agrees on it before acting
  (:class:`octfw.engine.distributed.Peers`), so all stop after the same update
  step; rank 0 writes a checkpoint within ``engine.save_deadline_s`` and the
  run ends with exit 75, naming the command that resumes. A second signal
  means "stop now": it interrupts the update step in progress
  (:class:`StopNow`, so a long CPU step does not delay it), the final save is
  skipped, the last complete checkpoint stays the newest, exit 130;
- **closing** (the final save, the summary): a second signal cancels the final
  save (its temporary file removed);
- **done**: signals are ignored. A launcher that tears down the last processes
  of a job that already ended must not change how they end.

A third Ctrl-C always raises KeyboardInterrupt, the way out of anything.

**A forwarded signal is not a second signal.** torchrun, srun and
``octfw run --nproc-per-node`` forward the signal they receive to their
workers, which usually got it from the process group already. A process that
is one of several counts a repeat of the same signal within
:data:`DUPLICATE_WINDOW_S` once.

**TPU pods.** torch_xla's preemption sync manager owns SIGTERM where it is
active (a TPU): its C++ handler records the signal and every host learns it at
the same step (``_sync_point_reached``). octfw then handles SIGINT only: one
SIGTERM path, never two, so the hosts agree on the stop step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from octfw.cli.exit_codes import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE

__all__ = ["StopRequests", "StoppedBeforeTraining", "StopNow", "PREEMPTED_EXIT_CODE", "INTERRUPTED_EXIT_CODE",
           "STARTING", "TRAINING", "CLOSING", "DONE", "STOP_SIGNALS"]

logger = logging.getLogger(__name__)

STARTING, TRAINING, CLOSING, DONE = "starting", "training", "closing", "done"
#: The signals that ask a run to stop. SIGHUP (the terminal closed) and SIGQUIT (Ctrl-\\, a stop some
#: schedulers send) mean what SIGTERM means: their default, death on the spot, would lose the step
#: in progress and, in a launcher, leave its workers behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: A repeat of the same signal within this many seconds, in a process that is one of several,
#: is the launcher forwarding what the process group already delivered: counted once.
DUPLICATE_WINDOW_S = 1.0


class StoppedBeforeTraining(BaseException):
    """A stop signal arrived before the first update step: there is nothing to save.
    (A BaseException: no ``except Exception`` on the way up may swallow it.)"""

    def __init__(self, signal_name: str):
        self.signal_name = signal_name
        super().__init__(f"stopped by {signal_name} before training began; nothing to save")


class StopNow(BaseException):
    """A second stop signal during an update step: the step is abandoned, nothing more is saved."""


def _launched() -> bool:
    """Whether this process is one of a job's processes (a launcher may forward signals to it)."""
    return any(key in os.environ for key in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"))


class StopRequests:
    """The stop signals while ``octfw run`` lives (main thread only); see the module docstring.

    Use as a context manager around the whole command; :meth:`start_training`,
    :meth:`closing` and :meth:`done` move it through the phases.
    """

    def __init__(self, duplicate_window_s: float | None = None, exit_before_training: bool = False):
        self.signal_name: str | None = None
        #: end the process (exit 75) on a signal while starting, after :attr:`abandon_hooks`
        self.exit_before_training = exit_before_training
        #: called with the StoppedBeforeTraining when a start is abandoned (clean-up, the final line)
        self.abandon_hooks: list[Any] = []
        self.signals = 0  #: how many stop signals arrived; 2 or more: stop now, without the final save
        self.phase = STARTING
        self.duplicate_window_s = (DUPLICATE_WINDOW_S if _launched() else 0.0) if duplicate_window_s is None \
            else duplicate_window_s
        self._owner_pid = os.getpid()
        self._last: tuple[int, float] | None = None  # (signal, monotonic time) of the last one counted
        self._previous: dict[int, Any] = {}
        self._xla_sync = False

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            if sig == signal.SIGTERM and self._xla_sync:  # torch_xla's handler stays torch_xla's
                continue
            # A process of a job that has ended keeps ignoring signals while the interpreter shuts
            # down: a launcher closing the last processes must not turn exit 75 into -15.
            ended = self.phase == DONE and self.duplicate_window_s > 0
            signal.signal(sig, signal.SIG_IGN if ended else handler)
        self._previous.clear()

    # --- phases -----------------------------------------------------------

    def start_training(self, backend_kind: str) -> None:
        """The first update step is next: signals now stop after a step. On a TPU, torch_xla's
        preemption sync manager takes SIGTERM over (see the module docstring)."""
        if backend_kind == "xla" and _activate_xla_preemption_sync():
            self._xla_sync = True  # its sigaction replaced ours: never install ours over it again
        self.phase = TRAINING
        self.abandon_hooks.clear()

    def closing(self) -> None:
        self.phase = CLOSING

    def done(self) -> None:
        self.phase = DONE

    @property
    def stop_now(self) -> bool:
        """A second signal arrived: stop without waiting for the final save."""
        return self.signals >= 2

    # --- the handler ----------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._owner_pid:
            return  # a forked data-loader worker: the training process decides, and ends it
        if self.phase == DONE:
            logger.debug("%s received after the run ended: ignored", signal.Signals(signum).name)
            return
        now = time.monotonic()
        if self._last and self._last[0] == signum and now - self._last[1] < self.duplicate_window_s:
            logger.debug("%s received again within %g s: the same request, forwarded by a launcher",
                         signal.Signals(signum).name, self.duplicate_window_s)
            return
        self._last = (signum, now)
        self.request(signal.Signals(signum).name, from_signal=signum)

    def request(self, name: str, from_signal: int | None = None) -> None:
        """Count one stop request (a signal, or a launcher's forwarded one) and act on the phase."""
        self.signals += 1
        if self.signals == 1:
            self.signal_name = self.signal_name or name
        if self.phase == STARTING:
            self._abandon(StoppedBeforeTraining(self.signal_name or name))
        if self.signals == 1:
            logger.warning("%s received: finishing this update step, then saving a checkpoint and stopping "
                           "(Ctrl-C again to stop at once, keeping the last complete checkpoint)", name)
        elif self.signals == 2:
            if self.phase == TRAINING:
                logger.warning("%s received again: stopping now, without the final save; the last complete "
                               "checkpoint is kept", name)
                raise StopNow(f"{name} twice")
            logger.warning("%s received again: the final save is cancelled; the last complete checkpoint "
                           "is kept", name)
        elif from_signal == signal.SIGINT:  # a step that never ends (a hung collective): the way out
            raise KeyboardInterrupt

    def _abandon(self, stopped: StoppedBeforeTraining) -> None:
        if not self.exit_before_training:
            raise stopped
        for hook in reversed(self.abandon_hooks):
            try:
                hook(stopped)
            except Exception as exc:  # noqa: BLE001 - the process ends now whatever a hook did
                logger.debug("a clean-up hook failed while abandoning the start", exc_info=exc)
        logging.shutdown()  # flush the run log
        os._exit(PREEMPTED_EXIT_CODE)

    def local_vote(self, update_step: int) -> int:
        """This process's stop vote after ``update_step``: 0 go on, 1 stop after it, 2 stop now.
        On a TPU the sync manager's verdict counts as a signal (the same step on every host)."""
        if self._xla_sync and self.signals == 0:
            import torch_xla

            if torch_xla._XLAC._sync_point_reached(update_step):
                self.signal_name = "TPU preemption notice"
                self.signals = 1
        return min(self.signals, 2)


def _activate_xla_preemption_sync() -> bool:
    """Turn on torch_xla's preemption sync manager on a TPU; False where it is not offered."""
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        if xm.xla_device_hw(torch_xla.device()) != "TPU":
            return False
        torch_xla._XLAC._ensure_xla_coordinator_initialized(
            xr.process_index(), xr.process_count(), xr.get_master_ip())
        torch_xla._XLAC._activate_preemption_sync_manager()
        return True
    except Exception as exc:  # noqa: BLE001 - without it, octfw's own SIGTERM handler stays in charge
        logger.debug("torch_xla preemption sync manager not available", exc_info=exc)
        return False
