"""The path of ``octfw run`` from the parsed command line to the first update step.

Issue #49 asks that a newcomer can follow how a run starts: which files the
decisions pass through, and how often the path comes back to a file it left;
issue #59 that the count follow every value derived from the parsed arguments.
This script measures it on a real run instead of by reading:

- every call to a function of the ``octfw`` package is traced
  (``sys.setprofile``) from the command's start to the first
  ``Trainer.update``;
- a value is **carried** when it is the parsed arguments
  (``argparse.Namespace``), the :class:`~octfw.recipe.Recipe` or the
  :class:`~octfw.engine.plan.RunPlan`, or is **derived** from a carried one:
  what a call on the path returns, or the object its ``__init__`` made, where
  that is a decision (a location such as the run folder or the checkpoint
  continued, an object holding a carried location such as the folder's owner
  or a checkpoint store, a tuple or list of those); the very object, not an
  equal one. Numbers and words are not followed: equal values are not one
  decision;
- a call is **on the path** when it receives a carried value, as an argument
  or as an attribute of ``self`` (a method of an object that holds one); the
  carried values' own accessors (``recipe.name``, ``recipe.total_update_steps``,
  in ``octfw/recipe/resolved.py``) read the decisions as an attribute does and
  are not stays;
- a component's own code is not the start's: building one (the recipe's spec
  handing its config through the registry to the plugin's factory) and every
  call into ``octfw/plugins/`` is left out, with what it calls, as a third
  party's plugin would be;
- the path **moves** when a call on it goes to another file (a call within
  one file is read on the same page); consecutive calls in one file are one
  **stay**, a move into a file the path had already visited is a **climb
  back** (``resume.py`` calling back into ``build.py``, a constructor's file
  entered again for its ``run``); a call that the same call (the same page's
  frame) already made once is a loop's next turn and is read once.

Two starts are traced: a new run of ``recipes/quickstart.toml``, and
``--resume auto --allow-recipe-change`` extending it by one step (the run
folder found, its checkpoint read, the recipe compared). ``python scripts/start_path.py``
prints each path, one line per stay, and exits 1 when one exceeds the bounds;
``tests/test_architecture.py`` runs it and shows its output when it fails.
A job of ``--nproc-per-node`` processes is not traced: its path runs in the
workers, each an ``octfw run`` like the one traced.
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

#: The bounds of issues #49 and #59: at most 30 stays, at most 3 climbs back, no file entered more than twice.
MAX_STAYS, MAX_CLIMBS, MAX_ENTRIES = 30, 3, 2


class Stay(NamedTuple):
    file: str  #: relative to the repository
    functions: tuple[str, ...]  #: the calls on the path made there, in order


def trace(argv: list[str]) -> list[Stay]:
    """Run ``octfw`` with ``argv`` in this process; the stays of its path to the first update step."""
    from octfw.cli.main import main
    from octfw.engine.plan import RunPlan
    from octfw.engine.trainer import Trainer
    from octfw.recipe import Recipe, StageSpec
    from octfw.registry import Component

    seeds = (argparse.Namespace, Recipe, RunPlan)  # what the decisions travel in
    first_update = Trainer.update.__code__
    package = str(PACKAGE)
    # Building a component: the recipe's spec hands its config to the registry's entry, which
    # calls the plugin's factory. What the factory does is the component's, not the start's.
    components = {StageSpec.build.__code__, Component.build.__code__}
    plugins = str(PACKAGE / "plugins")  # the built-in components' own code
    accessors = inspect.getfile(Recipe)
    calls: list[tuple[str, str]] = []
    reached = []  # the first update step, once called
    carried: dict[int, Any] = {}  # id -> the value itself (kept alive, so its id stays its own)
    on_path: set[int] = set()  # the frames of the calls on the path, until they return

    def is_location(value: Any) -> bool:
        return isinstance(value, Path) or (isinstance(value, str) and "/" in value)

    def fields_of(value: Any) -> list[Any]:
        held = getattr(value, "__dict__", None)
        if isinstance(held, dict):
            return list(held.values())
        return [getattr(value, name, None) for name in getattr(value, "__slots__", ())]

    def derive(value: Any) -> None:
        """``value`` is carried from now on where it is a decision: a location, a seed (the
        recipe, the plan), an object that holds a carried location (a folder's owner, a
        checkpoint store), or a tuple or list of those; and the locations such an object holds."""
        if id(value) in carried:
            return
        if isinstance(value, (tuple, list)):
            for item in value:
                derive(item)
            return
        if is_location(value):
            carried[id(value)] = value
            return
        held = fields_of(value)
        if isinstance(value, seeds) or any(id(v) in carried for v in held):
            carried[id(value)] = value
            for field in held:
                if is_location(field):
                    carried[id(field)] = field

    def carries(value: Any) -> bool:
        derive(value) if isinstance(value, seeds) else None  # the parsed command line, a recipe made anew
        if id(value) in carried:
            return True
        return any(id(v) in carried for v in fields_of(value))  # a method of an object holding one

    call_sites: set[tuple[Any, Any]] = set()  # (the calling page's frame, the function called) of each move
    unread: list[int] = []  # frames whose calls are not read: a component's code, a loop's next turn

    def page_of(frame):
        """The outermost of the consecutive frames in ``frame``'s file: the call being read there."""
        while frame.f_back is not None and frame.f_back.f_code.co_filename == frame.f_code.co_filename:
            frame = frame.f_back
        return frame

    def profile(frame, event, arg) -> None:
        if event == "return":
            if unread and unread[-1] == id(frame):
                unread.pop()
            if id(frame) in on_path:  # what a call on the path gives back is derived from what it got
                on_path.discard(id(frame))
                derive(arg)
                if frame.f_code.co_name == "__init__":
                    derive(frame.f_locals.get("self"))
            return
        if event != "call" or unread:
            return
        code = frame.f_code
        if code in components or code.co_filename.startswith(plugins):  # a component's code: a plugin's
            unread.append(id(frame))
            return
        if not code.co_filename.startswith(package) or code.co_filename == accessors:
            return
        if code is first_update:
            sys.setprofile(None)  # reached: the rest of the run is not on the path
            reached.append(code.co_qualname)
        n_args = code.co_argcount + code.co_kwonlyargcount
        arguments = [frame.f_locals.get(name) for name in code.co_varnames[:n_args]]
        if not any([carries(a) for a in arguments]):
            return
        on_path.add(id(frame))
        caller = frame.f_back
        moves = caller is None or caller.f_code.co_filename != code.co_filename
        if moves and caller is not None:
            site = (page_of(caller), code)
            if site in call_sites:  # the same call calls it again: a loop's next turn, read once
                unread.append(id(frame))
                return
            call_sites.add(site)
        if moves or (calls and calls[-1][0] == code.co_filename):
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


def entries(stays: list[Stay]) -> int:
    """How many times the path enters the file it enters most."""
    return max((sum(s.file == stay.file for s in stays) for stay in stays), default=0)


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
        print(f"{len(stays)} stays in {files} files, {climbs(stays)} climbs back, at most {entries(stays)} "
              f"entries in a file (bounds: {MAX_STAYS} stays, {MAX_CLIMBS} climbs, {MAX_ENTRIES} entries)\n")
        within &= len(stays) <= MAX_STAYS and climbs(stays) <= MAX_CLIMBS and entries(stays) <= MAX_ENTRIES
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
