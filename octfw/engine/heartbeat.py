"""Says so when training makes no progress.

The seeds watched validation metrics arrive for minutes while training had
silently stopped. A background thread warns when no update step completes
within ``engine.heartbeat_s`` (from the start, or between two steps), naming
what the loop is waiting on, and again if it is then waiting on something
else: a warning of the ``octfw.engine.heartbeat``
logger, shown on the console as ``octfw heartbeat: no update step completed
...`` (see :mod:`octfw.display.logs`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from octfw.display.logs import LABEL

__all__ = ["Heartbeat"]

logger = logging.getLogger(__name__)


def _warn(message: str) -> None:
    logger.warning(message, extra={LABEL: "octfw heartbeat"})


class Heartbeat:
    def __init__(self, timeout_s: float, report: Callable[[str], None] = _warn):
        self.timeout_s = timeout_s
        self.report = report
        self.phase = "start-up"
        self.last_step: int | None = None
        self._last_beat = time.monotonic()
        #: (beat, phase) last warned about: one warning per silence and phase, so a silence that
        #: moves on (from a slow first device step to a stalled data loader) is named again
        self._warned_for: tuple[float, str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="octfw-heartbeat", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._last_beat = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def waiting_on(self, phase: str) -> None:
        self.phase = phase

    def beat(self, update_step: int) -> None:
        self.last_step = update_step
        self._last_beat = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 5.0)):
            beat, phase = self._last_beat, self.phase
            silent = time.monotonic() - beat
            if silent >= self.timeout_s and self._warned_for != (beat, phase):
                self._warned_for = (beat, phase)
                since = "since start" if self.last_step is None else f"since update step {self.last_step}"
                self.report(f"no update step completed in {silent:.0f} s {since}; "
                            f"waiting on {phase}")
