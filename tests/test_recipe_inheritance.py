"""Nothing is dropped silently by ``extends``, and no run leaves out the safety guards unsaid.

A child recipe's array of tables (``[[guard]]``, ``[[logger]]``, ``[[evaluator]]``)
replaces its parent's unless the child says ``append``; every parent component a
replacement drops is named by ``octfw show``, ``octfw check`` and once at the start
of ``octfw run``, as is a run without ``nan-skip`` or ``grad-clip``. The recipes in
``recipes/`` keep the quickstart's guards.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from octfw.recipe import load_recipe

from conftest import TINY_RECIPE

REPO = Path(__file__).resolve().parents[1]
GUARDED = TINY_RECIPE + ('\n[[guard]]\nname = "nan-skip"\n\n[[guard]]\nname = "grad-clip"\nmax_norm = 1.0\n'
                         '\n[[guard]]\nname = "lr-positive"\n')
REPLACING = 'extends = "base.toml"\n\n[[guard]]\nname = "lr-positive"\n'


def octfw(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octfw.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)


def dropped_line(child: Path) -> str:
    return (f"{child}: its [[guard]] replaces those of base.toml, dropping nan-skip, grad-clip; to keep them, "
            'add append = ["guard"] before its first table (or list them again)')


def missing_line(child: Path) -> str:
    return (f"{child}: no nan-skip or grad-clip guard: without nan-skip, an update with a non-finite loss or "
            "gradient reaches the weights; without grad-clip, one gradient spike moves the weights without bound; "
            'add [[guard]] with name = "nan-skip" and [[guard]] with name = "grad-clip" '
            "(as recipes/quickstart.toml does)")


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "recipes").glob("*.toml")))
def test_every_shipped_recipe_keeps_the_safety_guards_and_drops_nothing(name, registry):
    recipe = load_recipe(REPO / "recipes" / name, (), registry)
    guards = [spec.name for spec in recipe.guards]
    assert {"nan-skip", "grad-clip"} <= set(guards), guards
    assert recipe.dropped == () and recipe.warnings() == []


def test_the_cpu_pretraining_recipes_add_the_collapse_guard_to_the_quickstarts(registry):
    quickstart = [spec.to_table() for spec in load_recipe(REPO / "recipes" / "quickstart.toml", (), registry).guards]
    for name in ("pretrain_cpu", "pretrain_dense_cpu", "mae_cpu", "mae_pix_cpu"):
        guards = [spec.to_table() for spec in load_recipe(REPO / "recipes" / f"{name}.toml", (), registry).guards]
        assert guards[:-1] == quickstart and guards[-1]["name"] == "collapse", name


def test_a_drop_is_named_down_the_chain_until_a_later_file_or_set_lists_the_component_again(write_recipe, registry):
    write_recipe(GUARDED, "base.toml")
    child = write_recipe(REPLACING, "child.toml")
    grandchild = write_recipe('extends = "child.toml"\n\n[engine]\nbase_lr = 2e-3\n', "grandchild.toml")
    [drop] = load_recipe(grandchild, (), registry).dropped  # the grandchild trains without them too
    assert (drop.file, drop.table, drop.parent, drop.names) == (child.resolve(), "guard", "base.toml",
                                                                ("nan-skip", "grad-clip"))
    relisted = write_recipe('extends = "child.toml"\nappend = ["guard"]\n\n[[guard]]\nname = "nan-skip"\n',
                            "relisted.toml")
    assert [d.names for d in load_recipe(relisted, (), registry).dropped] == [("grad-clip",)]
    restored = load_recipe(child, ['guard=[{name="nan-skip"},{name="grad-clip"},{name="lr-positive"}]'], registry)
    assert restored.dropped == () and restored.warnings() == []


def test_other_arrays_of_tables_are_named_when_dropped_and_appending_drops_nothing(write_recipe, registry):
    write_recipe(GUARDED.replace('[[logger]]\nname = "jsonl"', '[[logger]]\nname = "console"\n\n'
                                 '[[logger]]\nname = "jsonl"'), "base.toml")
    child = write_recipe('extends = "base.toml"\n\n[[logger]]\nname = "console"\n', "child.toml")
    [drop] = load_recipe(child, (), registry).dropped
    assert (drop.table, drop.names) == ("logger", ("jsonl",))
    appended = write_recipe('extends = "base.toml"\nappend = ["guard"]\n\n[[guard]]\nname = "collapse"\n',
                            "appended.toml")
    recipe = load_recipe(appended, (), registry)
    assert recipe.dropped == () and recipe.warnings() == []


def test_a_recipe_with_the_default_guard_alone_is_warned_about_grad_clip_only(tiny_recipe, registry):
    [line] = load_recipe(tiny_recipe, (), registry).warnings()  # the default [[guard]]: nan-skip
    assert line == (f"{tiny_recipe.resolve()}: no grad-clip guard: without grad-clip, one gradient spike moves "
                    'the weights without bound; add [[guard]] with name = "grad-clip" (as recipes/quickstart.toml '
                    "does)")


def test_show_names_what_a_child_dropped_without_importing_torch(write_recipe):
    write_recipe(GUARDED, "base.toml")
    child = write_recipe(REPLACING, "child.toml").resolve()
    code = ("import sys\nfrom octfw.cli.main import main\ncode = main(['show', sys.argv[1]])\n"
            "print('TORCH', 'torch' in sys.modules)\nsys.exit(code)\n")
    out = subprocess.run([sys.executable, "-c", code, str(child)], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"# warning: {dropped_line(child)}" in lines and f"# warning: {missing_line(child)}" in lines
    assert lines[-1] == "TORCH False"

    appended = write_recipe(REPLACING.replace("\n\n", '\nappend = ["guard"]\n\n', 1), "appended.toml")
    shown = octfw("show", str(appended))
    assert shown.returncode == 0, shown.stderr
    assert "# warning:" not in shown.stdout


def test_a_run_says_once_at_its_start_what_the_child_dropped_and_which_safety_guards_it_lacks(write_recipe):
    write_recipe(GUARDED, "base.toml")
    child = write_recipe(REPLACING, "child.toml").resolve()  # 4 update steps, every one a log step
    out = octfw("run", str(child))
    assert out.returncode == 0, out.stderr
    err = out.stderr.splitlines()
    assert err.count(f"octfw: warning: {dropped_line(child)}") == 1, out.stderr
    assert err.count(f"octfw: warning: {missing_line(child)}") == 1, out.stderr
    assert sum("no nan-skip" in line or "replaces those of" in line for line in err) == 2, out.stderr


def test_check_names_what_a_child_dropped(write_recipe, capsys):
    from octfw.cli.main import main

    write_recipe(GUARDED, "base.toml")
    child = write_recipe(REPLACING, "child.toml").resolve()
    assert main(["check", str(child), "--steps", "10"]) == 0  # the preview: no data read
    err = capsys.readouterr().err.splitlines()
    assert f"octfw: warning: {dropped_line(child)}" in err and f"octfw: warning: {missing_line(child)}" in err
