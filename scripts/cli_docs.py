"""Write docs/cli.md from octfw's own argument parsers: every command's usage, description,
arguments and epilog, as ``octfw COMMAND --help`` shows them.

    .venv/bin/python scripts/cli_docs.py            # after changing a command or its help: rewrites docs/cli.md
    .venv/bin/python scripts/cli_docs.py --check    # exit 1 when docs/cli.md differs from the parsers

``tests/test_docs.py`` fails when the page and the parsers disagree. The page covers octfw's
commands, its built-in plugins' included (``octfw prepare``); commands of other installed
plugins are left out, so the page does not depend on what else is installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cli.md"
COMMAND = ".venv/bin/python scripts/cli_docs.py"
USAGE_WIDTH = 100  # fixed, so the page does not depend on the terminal that wrote it

#: The guide that says how and why, for the commands that have one (paths relative to docs/).
GUIDES = {
    "run": "runs.md", "check": "runs.md", "plot": "runs.md", "replay": "runs.md",
    "show": "recipes.md", "lr": "recipes.md", "list": "plugins.md",
    "export": "encoder.md", "embed": "encoder.md", "eval": "evaluation.md",
    "prepare": "data-at-scale.md", "bench": "performance.md",
}


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=USAGE_WIDTH)


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _paragraph(text: str) -> str:
    """Prose as argparse shows it (it re-wraps whitespace), on one line."""
    return " ".join(text.split())


def _invocation(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    if not action.option_strings:
        return formatter._format_args(action, action.dest)  # noqa: SLF001 - argparse's own metavar rules
    shown = ", ".join(action.option_strings)
    if action.nargs == 0:
        return shown
    return f"{shown} {formatter._format_args(action, action.dest.upper())}"  # noqa: SLF001


def _own(parser: argparse.ArgumentParser) -> bool:
    """Whether a command is octfw's or a built-in plugin's (not another installed distribution's)."""
    return getattr(parser.get_default("func"), "distribution", "octfw") == "octfw"


def _subcommands(parser: argparse.ArgumentParser) -> tuple[list[tuple[str, str, argparse.ArgumentParser]], str]:
    """(name, one-line help, parser) of each command in ``octfw --help``'s order, and the
    subcommands' metavar."""
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    helps = {choice.dest: _formatter(parser.prog)._expand_help(choice)  # noqa: SLF001
             for choice in sub._choices_actions}  # noqa: SLF001
    commands = [(name, helps.get(name, ""), command) for name, command in sub.choices.items() if _own(command)]
    return commands, sub.metavar or "COMMAND"


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    """Each argument group of a parser as a table (the help option left out)."""
    formatter = _formatter(parser.prog)
    lines: list[str] = []
    for group in parser._action_groups:  # noqa: SLF001
        actions = [a for a in group._group_actions  # noqa: SLF001
                   if a.help != argparse.SUPPRESS
                   and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]  # noqa: SLF001
        if not actions:
            continue
        title = {"positional arguments": "Arguments", "options": "Options",
                 "optional arguments": "Options"}.get(group.title or "", group.title or "Options")
        lines += [f"**{_paragraph(title)}**", ""]
        if group.description:
            lines += [_paragraph(group.description), ""]
        lines += ["| argument | what it does |", "| --- | --- |"]
        for action in actions:
            text = formatter._expand_help(action) if action.help else ""  # noqa: SLF001
            lines.append(f"| `{_cell(_invocation(action, formatter))}` | {_cell(text)} |")
        lines.append("")
    return lines


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = _formatter(parser.prog)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")  # noqa: SLF001
    return formatter.format_help().strip("\n")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page for ``parser`` (default: ``octfw.cli.main.build_parser()``)."""
    if parser is None:
        from octfw.cli.main import build_parser

        parser = build_parser()
    commands, metavar = _subcommands(parser)
    lines = [
        "# Command reference",
        "",
        f"<!-- Generated from octfw's argument parsers by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every command of `octfw` with its arguments, as `octfw COMMAND --help` prints them. "
        "What a command is for, and why it works as it does, is in the guide linked under it.",
        "",
        "```text",
        _usage(parser),
        "```",
        "",
        _paragraph(parser.description or ""),
        "",
        *_arguments(parser),
        "## Commands",
        "",
        f"| {metavar.lower()} | what it does |",
        "| --- | --- |",
        *(f"| [`{name}`](#octfw-{name}) | {_cell(text)} |" for name, text, _ in commands),
        "",
    ]
    for name, _text, command in commands:
        lines += [f"## octfw {name}", "", "```text", _usage(command), "```", ""]
        if command.description:
            lines += [_paragraph(command.description), ""]
        lines += _arguments(command)
        if command.epilog:
            lines += [_paragraph(command.epilog), ""]
        if name in GUIDES:
            lines += [f"Guide: [{GUIDES[name]}]({GUIDES[name]})", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write docs/cli.md from octfw's argument parsers.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/cli.md differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"docs/cli.md differs from octfw's argument parsers; rewrite it with {COMMAND}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
