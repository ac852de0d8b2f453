"""The ``octfw`` command line: parse, dispatch to a command, report user mistakes.

Each command is a module of :mod:`octfw.commands` with ``add_parser``; what a
command does beyond parsing lives in the feature it serves (:mod:`octfw.engine`,
:mod:`octfw.diagnostics`, :mod:`octfw.evaluation`, :mod:`octfw.encoder`, a
component's package). User mistakes (bad recipe, missing file, unknown
component) print one readable message per problem and exit with code 2;
``--debug`` shows the traceback. A reader of stdout that goes away
(``octfw list | head -2``) ends the command quietly, exit 141. ``list``,
``show`` and recipe validation never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from typing import Sequence

import octfw.commands
from octfw.errors import UserError
from octfw.exit_codes import BROKEN_PIPE_EXIT_CODE
from octfw.version import __version__

__all__ = ["main", "build_parser"]

#: The order commands appear in ``octfw --help``; others follow by name.
FIRST_COMMANDS = ("run", "check", "show", "list")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="octfw",
        description="Self-supervised pretraining of 3D OCT foundation models, composed from plugins.",
    )
    parser.add_argument("--version", action="version", version=f"octfw {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for every error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = [m.name for m in pkgutil.iter_modules(octfw.commands.__path__) if not m.name.startswith("_")]
    for name in sorted(names, key=lambda n: (FIRST_COMMANDS.index(n) if n in FIRST_COMMANDS
                                             else len(FIRST_COMMANDS), n)):
        importlib.import_module(f"octfw.commands.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _run_command(argv)
        finally:
            sys.stdout.flush()  # a reader that went away shows here (after --help too), not at exit
    except BrokenPipeError:
        # `octfw list | head -2`: the reader has what it wanted. As the Python docs advise
        # (signal module, "Note on SIGPIPE"), stdout now points at devnull, so the flush at
        # exit finds nothing to fail on, and the command ends without a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT_CODE


def _run_command(argv: Sequence[str] | None) -> int:
    from octfw.logs import setup_console_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    setup_console_logging(debug=args.debug)
    try:
        return args.func(args)
    except UserError as exc:
        if args.debug:
            raise
        print(exc.console_text(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("octfw: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
