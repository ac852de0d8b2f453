"""Errors octfw shows to users.

A :class:`UserError` is a mistake the user can fix (a bad recipe, a missing
file, an unknown component). The CLI prints its message on one line and exits
with code 2, without a traceback. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

__all__ = ["UserError", "RecipeError", "ContractError", "CorruptFile", "PluginError", "OctfwWarning",
           "RunNotFinished",
           "one_line"]

# Control characters (and Unicode line breaks) as the escapes repr() writes.
_ESCAPES = {code: repr(chr(code))[1:-1] for code in (*range(0x20), 0x7F, 0x85, 0x2028, 0x2029)}


def one_line(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\x00``).

    A message quotes file names, keys and values the user chose, and a file
    name may hold a newline: printed raw, one error would read as two.
    """
    return text.translate(_ESCAPES)


class UserError(Exception):
    """A mistake the user can fix; the message names the file, key or value."""

    exit_code = 2

    def console_text(self) -> str:
        """What the command line prints: ``octfw: error: <message>``, made one line."""
        return f"octfw: error: {one_line(str(self))}"


class RecipeError(UserError):
    """Every problem found in a recipe, reported at once.

    Built from ``(path, message)`` pairs (plain strings are taken as they
    are); ``problems`` holds one line per problem, each naming ``table.key``.
    """

    def __init__(self, source: str, problems: "list[tuple[str, str] | str]"):
        self.source = source
        self.problems = [one_line(p if isinstance(p, str) else f"{p[0]}: {p[1]}") for p in problems]
        noun = "problem" if len(self.problems) == 1 else "problems"
        lines = [f"{one_line(source)}: {len(self.problems)} {noun}"]
        lines += [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))

    def console_text(self) -> str:
        """One line per problem, each made one line already."""
        return f"octfw: error: {self}"


class ContractError(UserError):
    """A stage handed the next stage something of the wrong shape, dtype or type."""


class PluginError(UserError):
    """A component could not be found, or two components claim the same name."""


class CorruptFile(Exception):
    """An input file that cannot be used. Raised by datasets, caught by octfw.

    The data pipeline records the file in the run's quarantine report and
    carries on with the next sample; training never stops for one bad file.
    """

    def __init__(self, url: str, reason: str):
        self.url = url
        self.reason = reason
        super().__init__(f"{url}: {reason}")


class OctfwWarning(UserWarning):
    """A warning a caller of octfw's library functions may catch by its class.

    Under the CLI (:func:`octfw.display.logs.setup_console_logging`) it is shown as
    one ``octfw: warning:`` line and kept in the run's ``octfw.log``, like
    every other octfw warning, which modules log through ``logging``.
    """


class RunNotFinished(Exception):
    """:func:`octfw.train` ended before its last update step.

    ``reason`` is ``"stopped"`` (a guard stopped it), ``"preempted"``,
    ``"interrupted"`` (a second signal: no final save) or
    ``"final_save_failed"``; ``result`` (an :class:`octfw.api.TrainResult`)
    holds the run folder, its summary and the newest checkpoint. The message
    says how to continue. (``octfw run`` exits 1, 75, 130 or 74 for these.)
    """

    def __init__(self, result: object, reason: str, message: str):
        self.result, self.reason = result, reason
        super().__init__(one_line(message))
