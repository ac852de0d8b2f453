"""Extra ``octfw`` subcommands, one module each.

Each module defines ``add_parser(subparsers)`` that adds its subparser and
sets ``func`` (called with the parsed arguments, returning an exit code). The
CLI finds the modules here by name; a module must import nothing heavy at
import time (``octfw --help`` imports them all).
"""
