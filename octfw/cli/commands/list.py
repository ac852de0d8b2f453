"""``octfw list [--stage S] [--name N] [--json]``: the installed components."""

from __future__ import annotations

import argparse
import json
import logging

import attrs

from octfw.display.errors import UserError
from octfw.hookspecs import STAGES

__all__ = ["add_parser"]

HELP = "List installed components (built-in and from plugins)."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("list", help=HELP, description=HELP)
    parser.add_argument("--stage", help=f"only this stage: {', '.join(STAGES)}")
    parser.add_argument("--name", help="show this component's options (--stage when two stages share the name)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octfw.registry import did_you_mean, load_registry

    registry = load_registry()  # failures are part of this command's output
    if args.stage and args.stage not in STAGES:
        raise UserError(f"--stage {args.stage!r}: unknown stage{did_you_mean(args.stage, STAGES)}; "
                        f"stages: {', '.join(STAGES)}")
    if args.name:
        if args.stage:
            return _show_component(registry.get(args.stage, args.name), as_json=args.json)
        found = [c for c in registry.by_stage() if c.name == args.name]
        if len(found) != 1:
            names = sorted({c.name for c in registry.by_stage()})
            raise UserError(f"--name {args.name!r}: " + (
                f"a {' and a '.join(c.stage for c in found)} component; add --stage" if found
                else f"no such component{did_you_mean(args.name, names)}; octfw list shows them all"))
        return _show_component(found[0], as_json=args.json)
    components = registry.by_stage(args.stage)
    rows = [{"stage": c.stage, "name": c.name, "distribution": c.distribution,
             "version": c.version, "summary": c.summary} for c in components]
    if args.json:
        print(json.dumps({"components": rows, "failures": [attrs.asdict(f) for f in registry.failures]},
                         indent=2))
        return 0
    from octfw.display.tables import render_table

    columns = ("stage", "name", "distribution", "version", "summary")
    print(render_table([c.upper() for c in columns], [[r[c] for c in columns] for r in rows]))
    for failure in registry.failures:
        logging.getLogger(__name__).warning("%s", failure)
    return 0


def _show_component(component, *, as_json: bool) -> int:
    from octfw.recipe.reference import config_rows

    options = config_rows(component.config)
    if as_json:
        print(json.dumps({"stage": component.stage, "name": component.name,
                          "distribution": component.distribution, "version": component.version,
                          "summary": component.summary, "options": options}, indent=2, default=str))
        return 0
    print(f"{component.stage} {component.name} ({component.distribution} {component.version})")
    print(f"  {component.summary}")
    print(f"  options for [{STAGES[component.stage][1]}]:")
    for row in options:
        default = "required" if row["required"] else f"default {row['default']!r}"
        print(f"    {row['key']} ({row['type']}, {default})")
        if row["doc"]:
            print(f"        {row['doc']}")
    return 0
