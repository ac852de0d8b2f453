"""The ``octfw`` subcommands, one module each (argument parsing only).

Each module defines ``add_parser(subparsers)`` that adds its subparser and
sets ``func`` to its ``run(args)`` (called with the parsed arguments,
returning an exit code). The CLI finds the modules here by name; modules
whose name starts with ``_`` hold what several commands share. A module must
import nothing heavy at import time (``octfw --help`` imports them all): the
work happens in the feature the command serves (:mod:`octfw.engine`,
:mod:`octfw.diagnostics`, :mod:`octfw.evaluation`, :mod:`octfw.exports`, a
component's package such as :mod:`octfw.plugins.datasets.prepared.prepare`), imported
inside ``run``.
"""
