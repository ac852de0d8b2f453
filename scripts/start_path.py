"""The path of ``octfw run`` from the parsed command line to the first update step.

Issue #49 asks that a newcomer can follow how a run starts: which files the
decisions pass through, and how often the path comes back to a file it left.
This script measures it on a real run instead of by reading:

- every call to a function of the ``octfw`` package is traced
  (``sys.setprofile``) from the command's start to the first
  ``Trainer.update``;
- a call is **on the path** when it receives the decisions being carried: the
  parsed arguments (``argparse.Namespace``), the :class:`~octfw.recipe.Recipe`,
  the :class:`~octfw.engine.plan.RunPlan`, or a location either of them holds
  (the run folder, the checkpoint resumed: the very object, not an equal
  one), as an argument or as an attribute of ``self`` (a method of an object
  that holds them); the carried values' own accessors (``recipe.name``,
  ``recipe.model``, in ``octfw/recipe/resolved.py``) read the decisions as an
  attribute does and are not stays;
- the path **moves** when a call on it goes to another file (a call within
  one file is read on the same page); consecutive calls in one file are one
  **stay**, and a move into a file the path had already visited is a **climb
  back** (``resume.py`` calling back into ``build.py``, a constructor's file
  entered again for its ``run``).

Two starts are traced: a new run of ``recipes/quickstart.toml``, and
``--resume auto --allow-recipe-change`` extending it by one step (the run
folder found, its checkpoint read, the recipe compared). ``python scripts/start_path.py``
prints each path, one line per stay, and exits 1 when one exceeds the bounds;
``tests/test_architecture.py`` runs it.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "octfw"

#: The bounds of issue #49: at most 30 stays, at most 3 climbs back.
MAX_STAYS, MAX_CLIMBS = 30, 3


class Stay(NamedTuple):
    file: str  #: relative to the repository
    functions: tuple[str, ...]  #: the calls on the path made there, in order


def trace(argv: list[str]) -> list[Stay]:
    """Run ``octfw`` with ``argv`` in this process; the stays of its path to the first update step."""
    from octfw.cli.main import main
    from octfw.engine.plan import RunPlan
    from octfw.engine.trainer import Trainer
    from octfw.recipe import Recipe

    carried = (argparse.Namespace, Recipe, RunPlan)
    first_update = Trainer.update.__code__
    package = str(PACKAGE)
    accessors = inspect.getfile(Recipe)
    calls: list[tuple[str, str]] = []
    reached = []  # the first update step, once called
    locations: dict[int, Any] = {}  # id -> the location itself (kept alive, so its id stays its own)

    def follow(value: Any) -> bool:
        """Whether ``value`` is carried; a carried value's locations are followed from now on."""
        if id(value) in locations:
            return True
        if not isinstance(value, carried):
            return False
        fields = vars(value) if hasattr(value, "__dict__") else {}
        fields = fields or {name: getattr(value, name) for name in getattr(value, "__slots__", ())}
        for field in fields.values():
            if isinstance(field, Path) or (isinstance(field, str) and "/" in field):
                locations[id(field)] = field
        return True

    def carries(value: Any) -> bool:
        if follow(value):
            return True
        held = getattr(value, "__dict__", None)
        return isinstance(held, dict) and any(follow(v) for v in held.values())

    def profile(frame, event, _arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(package) or code.co_filename == accessors:
            return
        if code is first_update:
            sys.setprofile(None)  # reached: the rest of the run is not on the path
            reached.append(code.co_qualname)
        n_args = code.co_argcount + code.co_kwonlyargcount
        arguments = [frame.f_locals.get(name) for name in code.co_varnames[:n_args]]
        on_path = any([carries(a) for a in arguments])  # a list: every argument's locations followed
        moves = frame.f_back is None or frame.f_back.f_code.co_filename != code.co_filename
        if on_path and (moves or (calls and calls[-1][0] == code.co_filename)):
            calls.append((code.co_filename, code.co_qualname))

    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    if code != 0:
        raise SystemExit(f"octfw {' '.join(argv)} exited {code}")
    if not reached:
        raise SystemExit("the run ended without an update step")
    stays: list[Stay] = []
    for file, function in calls:
        relative = str(Path(file).relative_to(ROOT))
        if stays and stays[-1].file == relative:
            stays[-1] = Stay(relative, stays[-1].functions + (function,))
        else:
            stays.append(Stay(relative, (function,)))
    return stays


def climbs(stays: list[Stay]) -> int:
    """How many stays return to a file the path had left."""
    return sum(stay.file in {s.file for s in stays[:i]} for i, stay in enumerate(stays))


def quickstart_argv(output_dir: str, *more: str) -> list[str]:
    """``octfw run recipes/quickstart.toml`` for ``run.max_steps`` steps, into ``output_dir``."""
    return ["run", str(ROOT / "recipes" / "quickstart.toml"), "--set", f"run.output_dir={output_dir}",
            "--set", "dataset.n_volumes=6", *more]


def main() -> int:
    with tempfile.TemporaryDirectory() as out:
        paths = {"a new run": trace(quickstart_argv(out, "--set", "run.max_steps=1")),
                 "--resume auto": trace(quickstart_argv(out, "--set", "run.max_steps=2", "--resume", "auto",
                                                   "--allow-recipe-change"))}
    within = True
    for name, stays in paths.items():
        print(f"octfw run, {name}:")
        for number, stay in enumerate(stays, 1):
            again = " (back)" if stay.file in {s.file for s in stays[:number - 1]} else ""
            print(f"{number:3d} {stay.file}{again}: {', '.join(dict.fromkeys(stay.functions))}")
        files = len({s.file for s in stays})
        print(f"{len(stays)} stays in {files} files, {climbs(stays)} climbs back "
              f"(bounds: {MAX_STAYS} stays, {MAX_CLIMBS} climbs)\n")
        within &= len(stays) <= MAX_STAYS and climbs(stays) <= MAX_CLIMBS
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
