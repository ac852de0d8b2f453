"""Text for people: tables laid out by rich, and counted nouns.

Every table octfw prints (``octfw list``, ``octfw bench``, ``octfw eval``'s
reports) goes through :func:`render_table`, so they share one look: a
header row, columns sized to their content two spaces apart, numbers
right-aligned, no rules (a table pasted into an issue or read by a script
is its rows, one per line). The result is a string, because a report is also written to
files and compared in tests; it never wraps (a long summary stays on its
row, as ``grep`` and a pasted issue expect) and carries no colour codes.
"""

from __future__ import annotations

import io
from typing import Iterable, Sequence

__all__ = ["render_table", "counted"]


def render_table(header: Sequence[str], rows: Iterable[Sequence[str]], *, right: Iterable[int] = (),
                 indent: int = 0) -> str:
    """``header`` and ``rows`` (cells as text) as a table; ``right``: column indexes aligned right.

    Cells are shown as written: brackets such as ``[0.70, 0.91]`` are text,
    not rich markup.
    """
    from rich.console import Console  # deferred: `octfw list --json` never imports rich
    from rich.padding import Padding
    from rich.table import Table

    right = set(right)
    table = Table(box=None, show_edge=False, pad_edge=False, header_style="")
    for index, name in enumerate(header):
        table.add_column(name, justify="right" if index in right else "left", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    out = io.StringIO()
    console = Console(file=out, width=100_000, color_system=None, markup=False, highlight=False,
                      emoji=False, legacy_windows=False)
    console.print(Padding(table, (0, 0, 0, indent)) if indent else table)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").split("\n"))


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``1 file``, ``2 files``, ``0 files``: a count with its noun in the right number."""
    return f"{count} {noun if count == 1 else (plural or noun + 's')}"
