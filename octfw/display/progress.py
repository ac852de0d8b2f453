"""Progress shown to a person: on a terminal, and in a Jupyter notebook.

One rule decides where a live display goes (:func:`watched`): the console
logger's training bar and the bar of long commands (``prepare``, ``eval``)
use it, so ``octfw.train()`` in a notebook shows the same bar as ``octfw
run`` in a terminal, and a log file or a pipe gets plain lines (with
``log_every``: an INFO line every so many seconds while the work lasts, so a
long command in a batch job's log is seen to move).

A long fit inside a unit of work (an evaluator training a decoder for a
thousand steps) reports its steps through :func:`fit_step`; whoever shows
progress listens with :func:`fit_steps` and adds them to the bar's text.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import sys
from typing import IO, Any, Callable, Iterator

__all__ = ["watched", "progress_bar", "fit_step", "fit_steps"]

logger = logging.getLogger(__name__)


def watched(stream: IO[str]) -> bool:
    """True when ``stream`` is a terminal, or when this process is a Jupyter kernel
    (rich then draws its live displays as notebook output)."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return True
    return "ipykernel" in sys.modules and _in_jupyter()


def _in_jupyter() -> bool:
    from rich.console import Console

    return Console().is_jupyter


#: The bar's clock (a test replaces it).
clock = time.monotonic


def rate_text(done: int, seconds: float, unit: str) -> str:
    """``4.1 volumes/s``, or ``2.5 s per volume`` below one a second (three figures at most)."""
    per_second = done / seconds
    if per_second >= 1.0:
        return f"{per_second:.3g} {unit}/s"
    return f"{seconds / done:.3g} s per {unit.rstrip('s')}"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}" if minutes < 60 else f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"


class _Logged:
    """``update(done, total, text)`` for a log: an INFO line ``label: done/total (elapsed) text``
    once ``every`` seconds have passed since the last line (or the start), and the last update's
    once the work ends after a line was written. A watcher thread writes the newest state when
    no update came for ``every`` seconds (a long first unit, volumes still loading): a job's log
    shows it moving, while a command that ends (or fails) within ``every`` seconds writes
    nothing, so a one-line error stays one line."""

    def __init__(self, label: str, text: str, every: float):
        self.label, self.every = label, every
        self.start = self.last = clock()
        self.state: tuple[int | None, int | None, str] = (None, None, text)
        self.lock = threading.Lock()
        self.logged = False
        self.stopped = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="octfw-progress-log", daemon=True)
        self.watcher.start()

    def _line(self, now: float) -> None:  # under self.lock
        done, total, text = self.state
        counted = "" if done is None else f" {done}/{total}"
        logger.info("%s:%s (%s) %s", self.label, counted, _duration(now - self.start), text)
        self.last, self.logged = now, True

    def __call__(self, done: int, total: int, text: str = "") -> None:
        with self.lock:
            self.state = (done, total, text)
            now = clock()
            if now - self.last >= self.every or (done >= total and self.logged):
                self._line(now)

    def _watch(self) -> None:
        while not self.stopped.wait(self.every):
            with self.lock:
                now = clock()
                if now - self.last >= self.every:
                    self._line(now)

    def close(self) -> None:
        self.stopped.set()
        self.watcher.join()


@contextlib.contextmanager
def progress_bar(label: str, unit: str | None = None, text: str = "",
                 log_every: float | None = None) -> Iterator[Callable[..., None] | None]:
    """A rich progress bar on stderr when a person watches it (a terminal or a Jupyter
    notebook; stdout keeps tables and JSON); None otherwise, so logs and pipes get no
    control characters, or with ``log_every`` an update that logs plain lines, at most one
    every ``log_every`` seconds (:class:`_Logged`).

    Yields ``update(done, total, text="")``; ``text`` is shown until the first update.
    With ``unit`` the bar also shows the rate and an ETA: for work whose items take
    about the same time. The rate is the average since the first update (so neither
    a set-up before it, such as a Dask cluster's start, nor a burst of items
    finishing together skews it), shown once a second has passed.
    """
    if not watched(sys.stderr):
        if log_every is None:
            yield None
            return
        logged = _Logged(label, text, log_every)
        try:
            yield logged
        finally:
            logged.close()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    columns: list[Any] = [TextColumn(label), BarColumn(bar_width=30), MofNCompleteColumn(), TimeElapsedColumn()]
    if unit:
        columns += [TextColumn("{task.fields[rate]}"), TextColumn("ETA"), TimeRemainingColumn()]
    columns.append(TextColumn("{task.description}", markup=False))
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(text, total=None, rate="")
        first: tuple[float, int] | None = None  # (time, done) of the first update: the work's own start

        def update(done: int, total: int, text: str = "") -> None:
            nonlocal first
            now = clock()
            first = (now, done) if first is None else first
            seconds, items = now - first[0], done - first[1]
            rate = rate_text(items, seconds, unit) if unit and items > 0 and seconds >= 1.0 else ""
            bar.update(task, completed=done, total=total, description=text, rate=rate)

        yield update


#: The listener of :func:`fit_step` in this context (None: nobody shows a fit's steps).
_fit_listener: contextvars.ContextVar[Callable[[int, int], None] | None] = contextvars.ContextVar(
    "octfw_fit_listener", default=None)


def fit_step(done: int, total: int) -> None:
    """Called by a long fit after each of its ``total`` steps; shown by the progress that listens
    (:func:`fit_steps`), else nothing. Costs a context lookup: no host sync, no output."""
    listener = _fit_listener.get()
    if listener is not None:
        listener(done, total)


@contextlib.contextmanager
def fit_steps(listener: Callable[[int, int], None]) -> Iterator[None]:
    """Route :func:`fit_step` calls made inside the block to ``listener(done, total)``."""
    token = _fit_listener.set(listener)
    try:
        yield
    finally:
        _fit_listener.reset(token)
