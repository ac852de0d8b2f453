"""The ``octfw`` command line: parse, dispatch to a command, report user mistakes.

octfw's own commands are the modules of :mod:`octfw.cli.commands`, each with
``add_parser``; plugins add theirs through ``octfw_register_commands``
(:func:`octfw.registry.load_commands`: ``octfw prepare`` is the ``prepared``
dataset's), and ``octfw --help`` lists both by name. What a command does beyond
parsing lives in the feature it serves (:mod:`octfw.engine`,
:mod:`octfw.diagnostics`, :mod:`octfw.evaluation`, :mod:`octfw.exports`, a
component's package). User mistakes (bad recipe, missing file, unknown
component, two commands of one name) print one readable message per problem and
exit with code 2; ``--debug`` shows the traceback. A plugin's command whose
arguments cannot be added is left out (a failure of its plugin, as ``octfw list``
shows), the other commands run, and asking for it says why in one line, exit 2.
A reader of stdout that goes away (``octfw list | head -2``) ends the command
quietly, exit 141. ``--help``, ``list``, ``show`` and recipe validation never
import torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
from typing import Sequence

import octfw.cli.commands
from octfw.display.errors import PluginError, UserError
from octfw.cli.exit_codes import BROKEN_PIPE_EXIT_CODE
from octfw.version import __version__

__all__ = ["main", "build_parser"]

#: The order commands appear in ``octfw --help``; others follow by name.
FIRST_COMMANDS = ("run", "check", "show", "list")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command, octfw's own and the installed plugins'."""
    return _build_parser()[0]


def _build_parser() -> tuple[argparse.ArgumentParser, set[str], list]:
    """The parser, the names of its commands and the plugins that failed to load (reported where
    they matter: by the commands that load the registry, and when the command asked for is unknown)."""
    from octfw.registry import BUILTIN_DISTRIBUTION, load_commands

    parser = argparse.ArgumentParser(
        prog="octfw",
        description="Self-supervised pretraining of 3D OCT foundation models, composed from plugins.",
    )
    parser.add_argument("--version", action="version", version=f"octfw {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for every error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    own = [m.name for m in pkgutil.iter_modules(octfw.cli.commands.__path__) if not m.name.startswith("_")]
    plugin_commands, failures = load_commands(reserved=own)  # a clash is a PluginError
    adders = {name: importlib.import_module(f"octfw.cli.commands.{name}").add_parser for name in own}
    for command in plugin_commands:
        adders[command.name] = lambda subparsers, _command=command: _add_plugin_command(
            subparsers, _command, third_party=_command.distribution != BUILTIN_DISTRIBUTION)
    for name in sorted(adders, key=lambda n: (FIRST_COMMANDS.index(n) if n in FIRST_COMMANDS
                                              else len(FIRST_COMMANDS), n)):
        adders[name](sub)
    return parser, set(adders), failures


def _add_plugin_command(subparsers: argparse._SubParsersAction, command, *, third_party: bool) -> None:
    shown = f"{command.summary} ({command.distribution} {command.version})" if third_party else command.summary
    # argparse %-formats a subcommand's help (for %(prog)s): a plugin's '%' is shown as written.
    parser = subparsers.add_parser(command.name, help=shown.replace("%", "%%"), description=command.summary)
    # A third-party add_arguments that raises never gets here: load_commands tried it on a parser
    # of its own and left the command out (a failure of its plugin), so the other commands run.
    command.add_arguments(parser)
    parser.set_defaults(func=command)


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
    from octfw.display.logs import setup_console_logging

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(word.split("=", 1)[0] == "--nproc-per-node" for word in argv):
        from octfw.engine.launcher import quiet_torch_cpp_logs

        quiet_torch_cpp_logs()  # a launcher: before a plugin may import torch
    try:
        parser, commands, failures = _build_parser()
    except UserError as exc:  # two commands of one name: nothing can be parsed
        print(exc.console_text(), file=sys.stderr)
        return exc.exit_code
    command = next((word for word in argv if not word.startswith("-")), None)
    if failures and command is not None and command not in commands:
        failed = next((failure for failure in failures if failure.command == command), None)
        if failed is not None:  # this very command failed to load (the others run): why, in one line
            error = PluginError(str(failed))
            print(error.console_text(), file=sys.stderr)
            return error.exit_code
        # Perhaps the command of a plugin that failed to load: say so before argparse refuses the name.
        setup_console_logging(debug="--debug" in argv)
        for failure in failures:
            logging.getLogger(__name__).warning(str(failure))
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
