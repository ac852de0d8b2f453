"""Progress shown to a person: on a terminal, and in a Jupyter notebook.

One rule decides where a live display goes (:func:`watched`): the console
logger's training bar and the bar of long commands (``prepare``, ``eval``)
use it, so ``octfw.train()`` in a notebook shows the same bar as ``octfw
run`` in a terminal, and a log file or a pipe gets plain lines.
"""

from __future__ import annotations

import contextlib
import time
import sys
from typing import IO, Any, Callable, Iterator

__all__ = ["watched", "progress_bar"]


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


@contextlib.contextmanager
def progress_bar(label: str, unit: str | None = None, text: str = "") -> Iterator[Callable[..., None] | None]:
    """A rich progress bar on stderr when a person watches it (a terminal or a Jupyter
    notebook; stdout keeps tables and JSON); None otherwise, so logs and pipes get no
    control characters.

    Yields ``update(done, total, text="")``; ``text`` is shown until the first update.
    With ``unit`` the bar also shows the rate and an ETA: for work whose items take
    about the same time. The rate is the average since the first update (so neither
    a set-up before it, such as a Dask cluster's start, nor a burst of items
    finishing together skews it), shown once a second has passed.
    """
    if not watched(sys.stderr):
        yield None
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
