"""The ``octfw`` subcommands, one module each (argument parsing only).

Each module defines ``add_parser(subparsers)`` that adds its subparser and
sets ``func`` (called with the parsed arguments, returning an exit code). The
CLI finds the modules here by name; modules whose name starts with ``_``
hold what several commands share. A module must import nothing heavy at
import time (``octfw --help`` imports them all): the work happens in
:mod:`octfw.tools` and :mod:`octfw.engine`, imported inside ``func``.
"""
