"""Where octfw's log records go: one line each on the console, full detail in the run's file.

Modules report through ``logging.getLogger(__name__)`` (every name under
``octfw.``); what the user asked for (``octfw list``'s table, ``octfw show``'s
TOML, the console logger's metric lines and summary) stays on stdout.

- :func:`setup_console_logging` (``octfw``'s ``main``) puts one handler on the
  ``octfw`` logger that writes each record of level INFO and up to stderr as
  one line: ``octfw: warning: <message>``, ``octfw: error: <message>``, the
  bare message for INFO. No traceback, unless ``debug`` (``octfw --debug``),
  which also shows DEBUG records. The libraries of :data:`THIRD_PARTY_LEVELS`
  get a null handler, so that Python's last-resort handler does not print
  their warnings and tracebacks (gcsfs's retries against an endpoint that is
  down) on the console; ``debug`` removes it. A record logged with
  ``extra={LABEL: "octfw heartbeat"}`` replaces the ``octfw: warning`` prefix.
- :func:`attach_run_log` (around training) adds ``<run_dir>/octfw.log``:
  every record of octfw at DEBUG with time, level, logger name and traceback,
  and the records of the libraries under it (gcsfs, fsspec, aiohttp, urllib3,
  google, asyncio, wandb), which go to that file only. With the object store
  down, a failed checkpoint save is one warning line on the console (logged by
  the trainer) while gcsfs's retries and tracebacks land in the file.
  :func:`detach_run_log` removes it and gives those libraries back their
  previous level and propagation.

Both are idempotent: a second setup reconfigures the one console handler, and
attaching a run log while another is still attached detaches the older one
first, so a process that runs many trainings (the tests) keeps one handler.

The console handler writes to whatever ``sys.stderr`` is at each record, so a
redirected stderr (pytest's ``capsys``, the rich progress bar, which prints
stderr lines above the bar) receives it. It is a plain stream handler rather
than rich's ``RichHandler``: that one lays records out in a table wrapped to
the terminal width (several lines for one long warning), and a rich
``Console`` on stderr writes past the progress bar's redirection.

Warnings have one channel: logging. A module warns with
``logging.getLogger(__name__).warning(...)``, so the console shows one line
and the run's ``octfw.log`` keeps it. A warning that a library caller should
be able to catch by class (a volume's spacing defaulted:
:class:`~octfw.dicom.header.SpacingDefaulted`) is raised with
:func:`warnings.warn` as an :class:`octfw.display.errors.OctfwWarning`;
:func:`setup_console_logging` routes those into the same logger
(``octfw.warnings``), and leaves every other package's warnings as Python
shows them. (A report a command prints on purpose, such as ``octfw check``'s
memory verdict before "check passed", is that command's output, not a
warning.)

Without :func:`setup_console_logging` (octfw used as a library), octfw's
records follow the embedding program's logging configuration.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any

from octfw.display.errors import OctfwWarning

__all__ = ["LABEL", "LOG_FILE", "THIRD_PARTY_LEVELS", "setup_console_logging", "silence_console", "attach_run_log",
           "detach_run_log"]

#: Name of the run's log file, in the run directory.
LOG_FILE = "octfw.log"

#: ``extra`` key of a record whose console line starts with its own label
#: (``octfw heartbeat: ...``) instead of ``octfw: warning: ...``.
LABEL = "octfw_label"

#: Libraries whose records go to the run's file only, from this level up.
#: gcsfs logs its retries at DEBUG; the others' DEBUG is one line per request
#: (W&B keeps its DEBUG lines in its own ``debug.log``).
THIRD_PARTY_LEVELS = {
    "gcsfs": logging.DEBUG,
    "fsspec": logging.INFO,
    "aiohttp": logging.INFO,
    "urllib3": logging.INFO,
    "google": logging.INFO,
    "asyncio": logging.INFO,
    "wandb": logging.INFO,
}

_ROOT = "octfw"
_CONSOLE = "octfw-console"
_QUIET = "octfw-quiet"
_RUN_LOG = "octfw-run-log"
_FILE_FORMAT = "%(asctime)s %(levelname)-8s %(name)s [%(threadName)s]: %(message)s"


class _ConsoleFormatter(logging.Formatter):
    """``octfw: warning: <message>``; the bare message at INFO; a traceback only if asked."""

    def __init__(self, tracebacks: bool):
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        label = getattr(record, LABEL, None)
        if label is None and record.levelno != logging.INFO:
            label = f"octfw: {_level_word(record.levelno)}"
        message = record.getMessage()
        text = f"{label}: {message}" if label else message
        if self.tracebacks and record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _level_word(levelno: int) -> str:
    if levelno >= logging.ERROR:
        return "error"
    return "warning" if levelno >= logging.WARNING else "debug"


class _ConsoleHandler(logging.StreamHandler):
    """A stream handler on the current ``sys.stderr``, looked up at each record."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


class _RunLogHandler(logging.FileHandler):
    """``<run_dir>/octfw.log``; remembers the logger settings it changed, for detaching."""

    def __init__(self, path: Path):
        super().__init__(path, mode="a", encoding="utf-8")
        self.saved: dict[str, tuple[int, bool]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        # One handler serves every attached logger: each library from its own level up.
        top = record.name.split(".", 1)[0]
        return record.levelno >= THIRD_PARTY_LEVELS.get(top, logging.DEBUG) and super().filter(record)


def _named(logger: logging.Logger, name: str) -> logging.Handler | None:
    return next((h for h in logger.handlers if h.get_name() == name), None)


def setup_console_logging(debug: bool = False) -> logging.Handler:
    """Install (or reconfigure) the one console handler on the ``octfw`` logger.

    ``debug`` shows DEBUG records and tracebacks. Returns the handler.
    """
    logger = logging.getLogger(_ROOT)
    handler = _named(logger, _CONSOLE)
    if handler is None:
        handler = _ConsoleHandler()
        handler.set_name(_CONSOLE)
        logger.addHandler(handler)
    level = logging.DEBUG if debug else logging.INFO
    handler.setLevel(level)
    handler.setFormatter(_ConsoleFormatter(tracebacks=debug))
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    _route_octfw_warnings()
    for name in THIRD_PARTY_LEVELS:
        library = logging.getLogger(name)
        quiet = _named(library, _QUIET)
        if quiet is None and not debug:
            quiet = logging.NullHandler()
            quiet.set_name(_QUIET)
            library.addHandler(quiet)
        elif quiet is not None and debug:
            library.removeHandler(quiet)
    return handler


def silence_console() -> None:
    """Nothing from octfw's loggers on the console (one process of a job speaks for it; the
    others' records still reach the run log where they have one)."""
    handler = _named(logging.getLogger(_ROOT), _CONSOLE)
    if handler is not None:
        handler.setLevel(logging.CRITICAL + 1)


def _route_octfw_warnings() -> None:
    """Show :class:`OctfwWarning` through the ``octfw.warnings`` logger; others as before."""
    shown = warnings.showwarning
    if getattr(shown, "_octfw", False):
        return  # installed already

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, OctfwWarning):
            logging.getLogger(f"{_ROOT}.warnings").warning("%s", message)
        else:
            shown(message, category, filename, lineno, file, line)

    showwarning._octfw = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def attach_run_log(run_dir: str | Path) -> logging.Handler:
    """Start writing ``<run_dir>/octfw.log`` (appended to on resume); returns the handler
    to pass to :func:`detach_run_log`.

    The file receives octfw's records at DEBUG and the third-party libraries of
    :data:`THIRD_PARTY_LEVELS`, which stop propagating (to the console or any
    other handler) until detached. A run log still attached is detached first.
    When nothing handles octfw's records yet, the console handler is installed
    too: Python's last-resort handler, which would otherwise print warnings,
    stops once the file handler exists.
    """
    octfw_logger = logging.getLogger(_ROOT)
    stale = _named(octfw_logger, _RUN_LOG)
    if stale is not None:
        detach_run_log(stale)
    if not octfw_logger.hasHandlers():
        setup_console_logging()
    handler = _RunLogHandler(Path(run_dir) / LOG_FILE)
    handler.set_name(_RUN_LOG)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(_FILE_FORMAT))
    for name, level in {_ROOT: logging.DEBUG, **THIRD_PARTY_LEVELS}.items():
        logger = logging.getLogger(name)
        handler.saved[name] = (logger.level, logger.propagate)
        if logger.getEffectiveLevel() > level:  # only ever lowered: W&B's own debug.log keeps its DEBUG
            logger.setLevel(level)
        logger.addHandler(handler)
        if name != _ROOT:
            logger.propagate = False
    return handler


def detach_run_log(handler: logging.Handler) -> None:
    """Stop writing the run's log file and restore the loggers :func:`attach_run_log` changed."""
    saved = getattr(handler, "saved", {})
    for name, (level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    saved.clear()
    handler.close()
