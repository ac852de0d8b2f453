"""The ``octfw`` command line.

User mistakes (bad recipe, missing file, unknown component) print one
readable message per problem and exit with code 2; ``--debug`` shows the
traceback. ``list``, ``show`` and recipe validation never import torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import attrs

from octfw.version import __version__
from octfw.errors import UserError
from octfw.hookspecs import STAGES

__all__ = ["main"]


def cmd_list(args: argparse.Namespace) -> int:
    from octfw.registry import load_registry

    registry = load_registry()
    if args.stage and args.stage not in STAGES:
        raise UserError(f"--stage {args.stage!r}: unknown stage; stages: {', '.join(STAGES)}")
    if args.name:
        if not args.stage:
            raise UserError("--name needs --stage, e.g. octfw list --stage model --name vjepa3d")
        from octfw.reference import config_rows

        component = registry.get(args.stage, args.name)
        options = config_rows(component.config)
        if args.json:
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
    components = registry.by_stage(args.stage)
    rows = [{"stage": c.stage, "name": c.name, "distribution": c.distribution,
             "version": c.version, "summary": c.summary} for c in components]
    if args.json:
        print(json.dumps({"components": rows, "failures": [attrs.asdict(f) for f in registry.failures]},
                         indent=2))
        return 0
    widths = {k: max([len(k)] + [len(r[k]) for r in rows]) for k in ("stage", "name", "distribution", "version")}
    header = "  ".join(k.upper().ljust(widths[k]) for k in widths) + "  SUMMARY"
    print(header)
    for r in rows:
        print("  ".join(r[k].ljust(widths[k]) for k in widths) + "  " + r["summary"])
    for failure in registry.failures:
        print(f"warning: {failure}", file=sys.stderr)
    return 0


def _load(args: argparse.Namespace):
    from octfw.recipe import load_recipe
    from octfw.registry import load_registry

    registry = load_registry()
    for failure in registry.failures:
        print(f"warning: {failure}", file=sys.stderr)
    return load_recipe(args.recipe, args.set or (), registry), registry


def cmd_show(args: argparse.Namespace) -> int:
    from octfw.recipe import to_toml

    recipe, _ = _load(args)
    print(to_toml(recipe.to_dict()), end="")
    return 0


def _warn_cadence(recipe) -> None:
    from octfw.engine.cadence import cadence_warnings

    for warning in cadence_warnings(recipe.engine):
        print(f"octfw: warning: {warning}", file=sys.stderr)


def cmd_check(args: argparse.Namespace) -> int:
    recipe, _ = _load(args)
    print(f"recipe    {recipe.source}: valid")
    _warn_cadence(recipe)
    from octfw.tools.check import check_recipe

    check_recipe(recipe)
    print("check passed")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    recipe, registry = _load(args)
    from octfw.engine.launch import launch

    summary = launch(recipe, registry, resume=args.resume)
    if summary.stopped:
        print(f"stopped early: {summary.stopped}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="octfw",
        description="Self-supervised pretraining of 3D OCT foundation models, composed from plugins.",
    )
    parser.add_argument("--version", action="version", version=f"octfw {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for every error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def recipe_command(name: str, help_text: str):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("recipe", help="recipe file (.toml)")
        p.add_argument("--set", action="append", metavar="TABLE.KEY=VALUE",
                       help="override a recipe value, e.g. --set engine.base_lr=1e-4 (repeatable)")
        return p

    run = recipe_command("run", "Train: validate the recipe, build the components and run the engine.")
    run.add_argument("--resume", metavar="auto|PATH",
                     help="continue from the newest complete checkpoint of the latest run (auto) or from PATH")
    run.set_defaults(func=cmd_run)
    recipe_command("check", "Validate, build every component and push one real batch through "
                   "dataset -> transform -> model forward and backward on the CPU.").set_defaults(func=cmd_check)
    recipe_command("show", "Print the resolved recipe with every default filled in, as TOML."
                   ).set_defaults(func=cmd_show)

    ls = sub.add_parser("list", help="List installed components (built-in and from plugins).",
                        description="List installed components (built-in and from plugins).")
    ls.add_argument("--stage", help=f"only this stage: {', '.join(STAGES)}")
    ls.add_argument("--name", help="with --stage: show this component's options")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)

    import importlib
    import pkgutil

    import octfw.commands

    for info in sorted(pkgutil.iter_modules(octfw.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"octfw.commands.{info.name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as exc:
        if args.debug:
            raise
        print(f"octfw: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("octfw: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
