"""What several commands share: the recipe arguments, loading the registry once,
and the progress bar of long work."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Any, Callable, Iterator

__all__ = ["add_recipe_arguments", "load_registry_once", "load_recipe_from_args", "progress_bar"]


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe file (.toml)")
    parser.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                        help="override a recipe value, e.g. --set engine.base_lr=1e-4 (repeatable)")


def load_registry_once() -> Any:
    """The command's one registry: plugins are discovered here and passed down.
    A plugin that failed to load is a warning, not an error (the others still work)."""
    from octfw.registry import load_registry

    registry = load_registry()
    for failure in registry.failures:
        logging.getLogger(__name__).warning(str(failure))
    return registry


def load_recipe_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(recipe, registry) for a command that takes RECIPE and --set."""
    from octfw.recipe import load_recipe

    registry = load_registry_once()
    return load_recipe(args.recipe, args.set or (), registry), registry


@contextlib.contextmanager
def progress_bar(label: str, unit: str | None = None, text: str = "") -> Iterator[Callable[..., None] | None]:
    """A rich progress bar on stderr when it is a terminal (stdout keeps tables and JSON);
    None otherwise, so logs and pipes get no control characters.

    Yields ``update(done, total, text="")``; ``text`` is shown until the first update.
    With ``unit`` the bar also shows the rate (``unit``/s) and an ETA: for work whose
    items take about the same time.
    """
    if not sys.stderr.isatty():
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

        def update(done: int, total: int, text: str = "") -> None:
            speed = bar.tasks[0].speed
            bar.update(task, completed=done, total=total, description=text,
                       rate=f"{speed:.2f} {unit}/s" if unit and speed else "")

        yield update
