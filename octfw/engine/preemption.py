"""Stopping cleanly when the machine is about to go: SIGTERM, SIGINT, TPU preemption notices.

Spot and preemptible VMs get a SIGTERM about 30 s before they stop. While
training, :class:`StopRequests` turns SIGTERM and the first SIGINT (Ctrl-C)
into a request that the loop reads after each update step: it finishes that
step, writes a checkpoint within ``engine.save_deadline_s`` and ends with
:data:`PREEMPTED_EXIT_CODE`, naming the command that resumes. A second
SIGINT or SIGTERM means "stop now": the loop stops after the update step in
progress, the final save is cancelled (its temporary file removed), the last
complete checkpoint stays the newest, and the run ends with
:data:`INTERRUPTED_EXIT_CODE`. It never aborts the process in the middle of a
write. A third Ctrl-C raises KeyboardInterrupt, for a step that never ends.

Every process must stop at the same update step, or collectives would hang
and ranks would save different states:

- under torchrun (DDP) the request is combined across ranks each update step
  with one tiny all-reduce of a CPU tensor over a gloo group of its own, so
  the GPU stream is never waited on (a NCCL all-reduce of a GPU flag read
  with ``.item()`` would stall the device every step);
- on a TPU pod, torch_xla's preemption sync manager, which learns of the
  maintenance event from the TPU runtime, answers ``True`` on every host at the
  same step (``_sync_point_reached``); a host's own SIGTERM is combined with it.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

__all__ = ["StopRequests", "PREEMPTED_EXIT_CODE", "INTERRUPTED_EXIT_CODE"]

logger = logging.getLogger(__name__)

#: Exit code of a run stopped by SIGTERM/SIGINT after saving: EX_TEMPFAIL,
#: "try again later", which is what a job scheduler should do with it.
PREEMPTED_EXIT_CODE = 75
#: Exit code of a run stopped at once by a second Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED_EXIT_CODE = 130


class StopRequests:
    """Installs the signal handlers while training (main thread only) and says when to stop."""

    def __init__(self, backend_kind: str = "cpu"):
        from octfw.engine.distributed import is_ddp

        self.signal_name: str | None = None
        self.signals = 0  #: how many stop signals arrived; 2 or more: stop now, without the final save
        self._previous: dict[int, Any] = {}
        self._xla_sync = backend_kind == "xla" and _activate_xla_preemption_sync()
        self._ddp_group = None
        if is_ddp():  # every rank builds its Trainer, so every rank joins here
            import torch.distributed as dist

            self._ddp_group = dist.new_group(backend="gloo")

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def stop_now(self) -> bool:
        """A second signal arrived: stop without waiting for the final save."""
        return self.signals >= 2

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.signals += 1
        if self.signals == 1:
            self.signal_name = self.signal_name or name
            logger.warning("%s received: finishing this update step, then saving a checkpoint and stopping "
                           "(Ctrl-C again to stop at once, keeping the last complete checkpoint)", name)
        elif self.signals == 2:
            logger.warning("%s received again: stopping after this update step without the final save; "
                           "the last complete checkpoint is kept", name)
        elif signum == signal.SIGINT:  # a step that never ends (a hung collective): the way out
            raise KeyboardInterrupt

    def should_stop(self, update_step: int) -> bool:
        """Whether every process stops after ``update_step`` (called once per update step)."""
        requested = self.signal_name is not None
        if self._xla_sync:
            import torch_xla

            if torch_xla._XLAC._sync_point_reached(update_step):
                self.signal_name = self.signal_name or "TPU preemption notice"
                requested = True
        if self._ddp_group is None:
            return requested
        import torch
        import torch.distributed as dist

        flag = torch.tensor(float(requested))  # on the CPU: no device sync
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ddp_group)
        if flag.item() > 0 and self.signal_name is None:
            self.signal_name = "a stop request on another rank"
        return flag.item() > 0


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
    except Exception as exc:  # noqa: BLE001 - without it, SIGTERM still works on each host
        logger.debug("torch_xla preemption sync manager not available", exc_info=exc)
        return False
