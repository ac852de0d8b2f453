"""The layers of docs/architecture.md hold: dependencies flow one way.

The contracts live in pyproject.toml ([tool.importlinter]); import-linter
builds the import graph of the installed source (function-local imports
included) and a backward import fails here, naming the chain.

The lists of built-in components agree with ``octfw.registry.BUILTIN_PLUGINS``:
the registering modules on disk, the import contracts, the component table of
docs/architecture.md, README's Components table and the stage packages'
docstrings.
"""

from __future__ import annotations

import importlib
import logging.config
import re
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def _lint(config: Path, monkeypatch, capsys) -> tuple[int, str]:
    """import-linter's exit code and report for the contracts of ``config`` (a pyproject.toml)."""
    monkeypatch.chdir(config.parent)
    # lint_imports configures its logging with dictConfig, which by default disables every
    # logger that exists already (octfw's among them) for the rest of this test process.
    configure = logging.config.dictConfig
    monkeypatch.setattr(logging.config, "dictConfig",
                        lambda config: configure({**config, "disable_existing_loggers": False}))
    code = lint_imports(config_filename=str(config), no_cache=True, no_logo=True)
    return code, capsys.readouterr().out


def test_imports_follow_the_declared_layers(monkeypatch, capsys):
    code, report = _lint(ROOT / "pyproject.toml", monkeypatch, capsys)
    assert code == 0, report
    assert "BROKEN" not in report and "KEPT" in report


def test_validating_every_recipe_imports_no_heavy_package():
    """`octfw show`/`octfw list` and every recipe check stay fast: configs are attrs only.

    Each shipped recipe (every component of every stage among them) is
    loaded and validated in a fresh interpreter, then no numerical, imaging
    or cloud package may have been imported.
    """
    import subprocess
    import sys

    code = (
        "import sys, pathlib\n"
        "from octfw.recipe import load_recipe\n"
        "from octfw.registry import load_registry\n"
        "registry = load_registry(entry_points=[])\n"
        "for path in sorted(pathlib.Path('recipes').glob('*.toml')):\n"
        "    load_recipe(path, [], registry=registry)\n"
        "heavy = ('numpy', 'torch', 'torch_xla', 'pydicom', 'monai', 'zarr', 'dask', 'gcsfs', 'wandb',\n"
        "         'matplotlib', 'oct_converter', 'scipy')\n"
        "print('HEAVY', sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


# --- the lists of built-in components agree -------------------------------------------------
#
# octfw.registry.BUILTIN_PLUGINS is the source; every other list of the built-ins is checked
# against it here, so a new built-in missing from one of them fails naming what is missing where.


def _builtins() -> dict[str, str]:
    """Each built-in plugin module -> its stage package (the package it sits in)."""
    from octfw.registry import BUILTIN_PLUGINS

    return {module: module.rpartition(".")[0] for module in BUILTIN_PLUGINS}


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_every_registering_module_on_disk_is_a_builtin_plugin_and_back():
    """A module (or a package's ``__init__``) with an ``octfw_register_*`` hook is a component: it is listed."""
    import importlib.util

    hook = re.compile(r"^def octfw_register_\w+\(", re.MULTILINE)
    on_disk = set()
    for path in sorted((ROOT / "octfw").rglob("*.py")):
        if path.name == "hookspecs.py" or not hook.search(path.read_text(encoding="utf-8")):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        on_disk.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    listed = set(_builtins())
    problems = [f"{module} registers components but is not in octfw.registry.BUILTIN_PLUGINS"
                for module in sorted(on_disk - listed)]
    problems += [f"{module} is in octfw.registry.BUILTIN_PLUGINS but "
                 + ("does not exist" if importlib.util.find_spec(module) is None
                    else "has no octfw_register_* hook")
                 for module in sorted(listed - on_disk)]
    assert not problems, "\n".join(problems)


#: The modules of the contract that keeps plugins apart: every plugin (package or module) of every stage.
EVERY_PLUGIN = "octfw.plugins.*.*"


def _contracts() -> dict[str, dict]:
    """The contracts by type, and the independence of every plugin as ``"plugins"``."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "tool"]["importlinter"]["contracts"]
    plugins = [contract for contract in contracts if contract.get("modules") == [EVERY_PLUGIN]]
    assert len(plugins) == 1 and plugins[0]["type"] == "independence", \
        f"one independence contract over {EVERY_PLUGIN} expected"
    by_type = {contract["type"]: contract for contract in contracts if contract is not plugins[0]}
    assert sorted(by_type) == ["forbidden", "independence", "layers"], "one contract of each type expected"
    return by_type | {"plugins": plugins[0]}


def _layered(contract: dict) -> list[str]:
    """Every module a layers contract names (siblings are separated by ``|`` or ``:``)."""
    return [name.strip() for layer in contract["layers"] for name in re.split(r"[|:]", layer)]


def test_every_module_sits_in_a_layer():
    """A module no layer names would be unchecked: every module of octfw is within one, but for
    ``octfw/__init__.py`` and the ``__init__`` of a package whose modules sit in several layers
    (``octfw.cli``: its exit codes at the bottom, its commands at the top), which imports no
    octfw module when it is imported (a name it offers is imported when asked for)."""
    import ast

    layered = _layered(_contracts()["layers"])
    problems = []
    for path in sorted((ROOT / "octfw").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module == "octfw" or any(_is_within(module, entry) for entry in layered):
            continue
        top_level = [node for node in ast.parse(path.read_text(encoding="utf-8")).body
                     if isinstance(node, (ast.Import, ast.ImportFrom))]
        octfw_imports = [ast.unparse(node) for node in top_level
                         if any(name.startswith("octfw") for name in
                                ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                                 [alias.name for alias in node.names]))]
        if parts[-1] != "__init__":
            problems.append(f"{module}: in no layer of pyproject.toml [tool.importlinter]")
        elif octfw_imports:
            problems.append(f"{module}: a package across layers whose __init__ imports {octfw_imports}")
    assert not problems, "\n".join(problems)


def test_the_top_level_holds_packages_and_the_plugin_contract():
    """Issue #59: `octfw/` shows the layers by its folders: packages, and beside them only the
    package's own ``__init__``, ``api``, ``version``, ``registry`` and ``hookspecs``."""
    loose = sorted(path.name for path in (ROOT / "octfw").glob("*.py"))
    assert loose == ["__init__.py", "api.py", "hookspecs.py", "registry.py", "version.py"], loose


def test_the_old_places_of_moved_modules_still_import_them():
    """A plugin written against octfw 0.1 (``from octfw.fields import doc``, ``octfw.errors``,
    ``octfw.arguments``) keeps working: the old names are the moved modules themselves."""
    import subprocess
    import sys

    code = ("import octfw.fields, octfw.errors, octfw.arguments, octfw.recipe.fields, octfw.display.errors\n"
            "import octfw.cli.arguments, octfw.hookspecs\n"
            "from octfw.fields import doc, positive\n"
            "from octfw.errors import CorruptFile, UserError\n"
            "from octfw.arguments import add_recipe_arguments, load_recipe_from_args\n"
            "from octfw import hookimpl\n"
            "assert octfw.fields is octfw.recipe.fields and doc is octfw.recipe.fields.doc\n"
            "assert octfw.errors is octfw.display.errors and UserError is octfw.UserError\n"
            "assert octfw.arguments is octfw.cli.arguments and hookimpl is octfw.hookspecs.hookimpl\n"
            "print('SAME')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "SAME", out.stderr


def test_no_command_imports_a_plugin_not_even_by_exception():
    """A component's own command (``octfw prepare``) comes through ``octfw_register_commands``:
    the contract that keeps the core off the built-ins has no exception to read past."""
    forbidden = _contracts()["forbidden"]
    assert "octfw.cli" in forbidden["source_modules"] and forbidden["forbidden_modules"] == ["octfw.plugins"]
    assert not forbidden.get("ignore_imports"), forbidden.get("ignore_imports")


def test_the_import_contracts_name_every_builtin_and_nothing_else():
    contracts = _contracts()
    forbidden = contracts["forbidden"]["forbidden_modules"]
    independent = contracts["independence"]["modules"]
    layered = _layered(contracts["layers"])
    where = "pyproject.toml [tool.importlinter]"
    problems = []
    for module, stage_package in _builtins().items():
        if not any(_is_within(module, entry) for entry in forbidden):
            problems.append(f"{module}: not in the forbidden_modules of {where} "
                            f"({contracts['forbidden']['name']!r})")
        if stage_package not in independent:
            problems.append(f"{module}: its stage package {stage_package} is not in the modules of {where} "
                            f"({contracts['independence']['name']!r})")
        top = ".".join(module.split(".")[:2])
        if top not in layered:
            problems.append(f"{module}: its package {top} is in no layer of {where}")
    for entry in forbidden:
        if not any(_is_within(module, entry) for module in _builtins()):
            problems.append(f"{entry}: in the forbidden_modules of {where} but holds no built-in plugin")
    for entry in independent:
        if entry not in _builtins().values():
            problems.append(f"{entry}: in the independence contract of {where} but holds no built-in plugin")
    assert not problems, "\n".join(problems)


def test_no_plugin_imports_another_not_even_within_its_stage():
    """What plugins share is core code (the DICOM reading in ``octfw.dicom``, the fine-tuning
    parts in ``octfw.evaluation.fine_tuning``), where a third party's plugin imports it too: the
    contract covers every built-in, by a wildcard a new one falls under, with no exception."""
    contract = _contracts()["plugins"]
    outside = [module for module in _builtins() if len(module.split(".")) != 4]
    assert not outside, f"built-ins {EVERY_PLUGIN} does not match: {outside}"
    assert not contract.get("ignore_imports"), contract.get("ignore_imports")


def test_a_plugin_that_imports_another_breaks_the_contract(tmp_path, monkeypatch, capsys):
    """The shipped contract, over a small tree of the same shape: a dataset that imports
    another's module (inside a function, too) breaks it; plugins that import the core do not."""
    import json

    files = {
        "__init__.py": "", "plugins/__init__.py": "", "plugins/datasets/__init__.py": "",
        "plugins/guards/__init__.py": "", "dicom/__init__.py": "", "dicom/reader.py": "def read(): ...\n",
        "plugins/datasets/dicom/__init__.py": "", "plugins/datasets/vendor/__init__.py": "",
        "plugins/datasets/dicom/dataset.py": "from plugged.dicom.reader import read\n",
        "plugins/datasets/vendor/reader.py": "def files():\n    from plugged.plugins.datasets.dicom import dataset\n",
        "plugins/guards/nan_skip.py": "import plugged.dicom.reader\n",
    }
    for name, text in files.items():
        (tmp_path / "plugged" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "plugged" / name).write_text(text)
    contract = _contracts()["plugins"]
    modules = [module.replace("octfw.", "plugged.", 1) for module in contract["modules"]]
    config = tmp_path / "pyproject.toml"
    config.write_text(f'[tool.importlinter]\nroot_package = "plugged"\n\n[[tool.importlinter.contracts]]\n'
                      f'name = {json.dumps(contract["name"])}\ntype = "independence"\nmodules = {json.dumps(modules)}\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    code, report = _lint(config, monkeypatch, capsys)
    broken = " ".join(report.split("Broken contracts")[-1].split())
    assert code != 0 and "1 broken" in report, report
    assert ("plugged.plugins.datasets.vendor is not allowed to import plugged.plugins.datasets.dicom" in broken
            and "plugged.plugins.guards" not in broken), report


def test_the_architecture_table_lists_every_builtin_and_nothing_else():
    """docs/architecture.md, "Where a component lives": one row per stage package."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Where a component lives", 1)[1].split("\n\n", 3)[2]
    listed: dict[str, set[str]] = {}
    for row in section.splitlines()[2:]:
        _stage, package, components = (cell.strip() for cell in row.strip("|").split("|"))
        # the components come first; a parenthesis after them names what they share
        listed[package.strip("`")] = set(re.findall(r"`([^`]+)`", components.split("(")[0]))
    problems = []
    expected: dict[str, set[str]] = {}
    for module, stage_package in _builtins().items():
        package = stage_package.replace(".", "/") + "/"
        name = module.rpartition(".")[2]
        entry = f"{name}/" if (ROOT / module.replace(".", "/")).is_dir() else f"{name}.py"
        expected.setdefault(package, set()).add(entry)
        if package not in listed:
            problems.append(f"{module}: docs/architecture.md's component table has no row for {package}")
        elif entry not in listed[package]:
            problems.append(f"{module}: `{entry}` is missing from the {package} row of "
                            "docs/architecture.md's component table")
    for package, entries in listed.items():
        for entry in sorted(entries - expected.get(package, set())):
            problems.append(f"docs/architecture.md's component table lists `{entry}` under {package}, "
                            "which is not in octfw.registry.BUILTIN_PLUGINS")
    assert not problems, "\n".join(problems)


def test_the_readme_components_table_names_every_builtin_component():
    """README.md, "Components": each registered built-in under its stage, and nothing else."""
    from octfw.registry import load_registry

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Components", 1)[1].split("\n\n", 2)[1]
    listed = {}
    for row in section.splitlines()[2:]:
        stage, names, _guarantees = (cell.strip() for cell in row.strip("|").split("|", 2))
        listed[stage] = set(re.findall(r"`([^`]+)`", names))
    registered: dict[str, set[str]] = {}
    for component in load_registry(builtins=None, entry_points=[]).by_stage():
        registered.setdefault(component.stage, set()).add(component.name)
    problems = [f"{stage} {name!r}: missing from README.md's Components table"
                for stage, names in registered.items() for name in sorted(names - listed.get(stage, set()))]
    problems += [f"README.md's Components table lists {stage} {name!r}, which no built-in registers"
                 for stage, names in listed.items() for name in sorted(names - registered.get(stage, set()))]
    assert not problems, "\n".join(problems)


def test_a_stage_package_docstring_that_lists_its_builtins_lists_them_all():
    """``octfw/plugins/datasets/__init__.py`` and its siblings: a list of the components there is complete.

    A built-in counts as named by its module (``octfw.plugins.datasets.phantom``) or by a component name
    it registers in double backticks (````phantom-oct````).
    """
    import importlib

    from octfw.registry import load_registry

    names: dict[str, set[str]] = {}
    for component in load_registry(builtins=None, entry_points=[]).by_stage():
        names.setdefault(component.plugin, set()).add(component.name)
    by_package: dict[str, list[str]] = {}
    for module, stage_package in _builtins().items():
        by_package.setdefault(stage_package, []).append(module)
    problems = []
    for stage_package, modules in sorted(by_package.items()):
        doc = importlib.import_module(stage_package).__doc__ or ""
        named = {module: module in doc or any(f"``{name}``" in doc for name in names.get(module, ()))
                 for module in modules}
        if any(named.values()):
            problems += [f"{module}: missing from the docstring of {stage_package} (which lists its siblings)"
                         for module, ok in named.items() if not ok]
    assert not problems, "\n".join(problems)


# --- no import circle -----------------------------------------------------------------------


def _import_circles(package: str) -> list[str]:
    """Each import circle among the modules of ``package``: a strongly connected component of
    its import graph (grimp's, as import-linter builds it) of more than one module, shown as
    the shortest chain from one of its modules to another and back.

    Every import that runs counts, at module level or inside a function: a function-local
    import hides a circle at import time but does not untie it (each module still needs the
    other to be read or to work; the phantom families' knot ran through one). An import under
    ``if TYPE_CHECKING:`` does not count: it never runs, and only names a type."""
    import grimp

    graph = grimp.build_graph(package, exclude_type_checking_imports=True, cache_dir=None)
    # Tarjan's strongly connected components, iteratively (the graph is hundreds of modules).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, edges = work[-1]
            for imported in edges:
                if imported not in index:
                    index[imported] = low[imported] = len(index)
                    stack.append(imported)
                    on_stack.add(imported)
                    work.append((imported, iter(sorted(graph.find_modules_directly_imported_by(imported)))))
                    break
                if imported in on_stack:
                    low[module] = min(low[module], index[imported])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    circles = []
    for component in components:
        first, second = component[0], component[1]
        there = graph.find_shortest_chain(importer=first, imported=second)
        back = graph.find_shortest_chain(importer=second, imported=first)
        circles.append(f"{' -> '.join(there)} -> {' -> '.join(back[1:])} "
                       f"(all {len(component)} modules of the circle: {', '.join(component)})")
    return circles


def test_no_import_circle_anywhere_in_octfw():
    """No two modules of octfw need each other, through however many others: each can be read
    (and moved, or tested) knowing only what it imports. Function-local imports count
    (:func:`_import_circles` says why)."""
    circles = _import_circles("octfw")
    assert not circles, "import circles (break each by moving what both need into a module of its own):\n" + \
        "\n".join(circles)


def test_an_import_circle_through_a_function_local_import_is_found(tmp_path, monkeypatch):
    """The check above sees a circle hidden in a function, and not one that only a type checker follows."""
    package = tmp_path / "knotted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cohort.py").write_text("def family():\n    from knotted import family\n    return family\n")
    (package / "family.py").write_text("from knotted.cohort import family as _f\n")
    (package / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from knotted import hinted\n")
    (package / "hinted.py").write_text("import knotted.typed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    [circle] = _import_circles("knotted")
    assert circle.startswith("knotted.cohort -> knotted.family -> knotted.cohort "), circle


def test_each_stages_contract_reads_alone():
    """``octfw/types/``: one module per stage's contract, each importing only the shared modules
    (the sample, the batch, what every component shares, the capability check), never another
    stage's; every stage has its module and every name is imported from ``octfw.types``."""
    import grimp

    import octfw.types
    from octfw.hookspecs import STAGES

    shared = {"octfw.types.sample", "octfw.types.batch", "octfw.types.component", "octfw.types.capability"}
    stage_modules = {f"octfw.types.{stage}" for stage in STAGES}
    graph = grimp.build_graph("octfw", exclude_type_checking_imports=True, cache_dir=None)
    assert stage_modules <= graph.modules, sorted(stage_modules - graph.modules)
    problems = []
    for module in sorted(stage_modules | shared):
        imported = {m for m in graph.find_modules_directly_imported_by(module) if m.startswith("octfw.")}
        problems += [f"{module} imports {other}, not a shared module" for other in sorted(imported - shared)]
        loaded = importlib.import_module(module)
        problems += [f"{module}.{name} is not importable from octfw.types" for name in loaded.__all__
                     if getattr(octfw.types, name, None) is not getattr(loaded, name)]
    assert not problems, "\n".join(problems)


def test_the_trainer_reads_in_one_sitting():
    """octfw/engine/trainer.py stays short enough to read top to bottom (nanoGPT's train.py is
    the model): resuming, the run's end, throughput and the optimizer live in modules of their
    own, so the loop is not buried again."""
    import ast

    path = ROOT / "octfw" / "engine" / "trainer.py"
    source = path.read_text(encoding="utf-8")
    lines = len(source.splitlines())
    assert lines <= 400, (f"{path.relative_to(ROOT)} has {lines} lines (at most 400): move what is not the loop "
                          "into a module of its own (resume, run_end, throughput, records, optim)")
    trainer = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    for method in ("train_loop", "update"):
        node = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == method)
        length = node.end_lineno - node.lineno + 1
        assert length <= 80, (f"Trainer.{method} has {length} lines (at most 80): the loop must read in one "
                              "sitting; give what is not a step of it a method or a module of its own")


def test_the_start_path_stays_short():
    """Issues #49 and #59: from `octfw run`'s parsed arguments to the first update step, following
    every value derived from them, a new run and a `--resume auto` each move through at most 30
    stays, climb back at most 3 times and enter no file more than twice (scripts/start_path.py
    says how they are counted, on a real run; its output is the message of a failure)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "start_path.py")], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    paths = out.stdout[out.stdout.index("octfw run, a new run:"):] if "octfw run, a new run:" in out.stdout else ""
    counts = re.findall(r"^(\d+) stays in \d+ files, (\d+) climbs back, at most (\d+) entries in a file",
                        paths, re.MULTILINE)
    assert len(counts) == 2, out.stdout + out.stderr
    for stays, climbs, entries in counts:
        assert int(stays) <= 30 and int(climbs) <= 3 and int(entries) <= 2, paths
    for stop in ("octfw/engine/plan.py", "octfw/runs/folder.py", "octfw/engine/build.py", "octfw/engine/trainer.py"):
        assert stop in paths, paths  # the decisions and the build are on the path: the trace follows them
    assert out.returncode == 0, paths + out.stderr
