"""Plugins bring their own commands (``octfw_register_commands``), as llm's and datasette's do.

A third-party command is installed as pip leaves a distribution (a module and a dist-info
whose entry point is in the group ``octfw``) and run as a user runs it, ``octfw NAME`` in a
process of its own; octfw owns the names: a clash is refused in one line naming both
distributions. ``octfw prepare`` is the ``prepared`` dataset's command, registered the
same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from octfw.cli.main import build_parser, main
from octfw.display.errors import PluginError
from octfw.registry import DISABLE_ENV, load_commands

from conftest import TINY_RECIPE, make_dist

REPO = Path(__file__).resolve().parents[1]

HELLO_PLUGIN = '''
from octfw.display.errors import UserError
from octfw.hookspecs import RegisterCommand, hookimpl


def add_arguments(parser):
    parser.add_argument("who", help="whom to greet")
    parser.add_argument("--shout", action="store_true", help="in capitals")


def run(args):
    if not args.who.strip():
        raise UserError("hello: WHO is empty; name someone")
    text = f"hello, {args.who}"
    print(text.upper() if args.shout else text)
    return 0


@hookimpl
def octfw_register_commands(register: RegisterCommand) -> None:
    register("hello", add_arguments, run, "Greet someone (100% friendly).")
'''

#: A plugin whose command takes one name: {name}; its run is a "module:function" string.
NAMED_PLUGIN = '''
from octfw.hookspecs import hookimpl


@hookimpl
def octfw_register_commands(register):
    register("{name}", lambda parser: None, "plug_lazy_work:run", "A command named {name}.")
'''


#: A plugin one of whose commands cannot add its arguments (argparse refuses a second --x);
#: its other command and its guard are fine.
TANGLED_PLUGIN = '''
import attrs
from octfw.hookspecs import hookimpl


@attrs.frozen
class QuietConfig:
    pass


def two_xs(parser):
    parser.add_argument("--x")
    parser.add_argument("--x")


@hookimpl
def octfw_register_commands(register):
    register("tangle", two_xs, lambda args: 0, "Never gets its arguments.")
    register("tidy", lambda parser: None, lambda args: print("tidied") or 0, "Works.")


@hookimpl
def octfw_register_guards(register):
    register("quiet", QuietConfig, "plug_tangled:build", "A guard of the same plugin.")  # listed, not built
'''

#: How the tangled command's failure reads, warned or, when it is asked for, as the error.
TANGLED = ("command 'tangle' of plugin 'plug_tangled' from octfw-tangled failed to load: add_arguments raised "
           "ArgumentError: argument --x: conflicting option string: --x; block the plugin with "
           f"{DISABLE_ENV}=plug_tangled")


def _octfw(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``octfw ARGS`` in a process of its own, with the distributions under ``site`` installed."""
    environment = {key: value for key, value in os.environ.items() if key != DISABLE_ENV}
    environment.update(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), **env)
    return subprocess.run([sys.executable, "-m", "octfw.cli", *args], capture_output=True, text=True,
                          env=environment, cwd=site)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path that distributions are 'installed' into (make_dist)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("plug_")]:
        del sys.modules[name]


def test_an_installed_plugins_command_runs_and_is_listed_in_help(tmp_path):
    make_dist(tmp_path, "octfw-hello", "plug_hello", HELLO_PLUGIN)

    done = _octfw(tmp_path, "hello", "retina", "--shout")
    assert (done.returncode, done.stdout, done.stderr) == (0, "HELLO, RETINA\n", "")

    helped = _octfw(tmp_path, "--help")
    assert helped.returncode == 0, helped.stderr
    # listed among octfw's own commands, its summary as written ('%' too) and where it comes from
    listed = " ".join(helped.stdout.split())
    assert "hello Greet someone (100% friendly). (octfw-hello 1.2.3)" in listed
    assert "prepare Decode, resample" in listed and "run " in listed

    own = _octfw(tmp_path, "hello", "--help")
    assert own.returncode == 0 and "whom to greet" in own.stdout and "Greet someone" in own.stdout


def test_a_plugin_commands_user_error_is_one_line_and_exit_2(tmp_path):
    make_dist(tmp_path, "octfw-hello", "plug_hello", HELLO_PLUGIN)
    done = _octfw(tmp_path, "hello", " ")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["octfw: error: hello: WHO is empty; name someone"]
    usage = _octfw(tmp_path, "hello")  # argparse's own refusal of missing arguments, as for a built-in
    assert usage.returncode == 2 and "the following arguments are required: who" in usage.stderr


def test_a_plugin_command_named_like_a_built_in_is_refused_in_one_line_naming_both(tmp_path):
    make_dist(tmp_path, "octfw-clash", "plug_clash", NAMED_PLUGIN.format(name="run"))
    for args in (["list"], ["--help"], ["run", "recipe.toml"]):
        done = _octfw(tmp_path, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("octfw: error: command 'run' is registered twice: by octfw "), line
        assert "plug_clash (octfw-clash 1.2.3)" in line and f"{DISABLE_ENV}=plug_clash" in line
    blocked = _octfw(tmp_path, "list", "--stage", "guard", **{DISABLE_ENV: "plug_clash"})
    assert blocked.returncode == 0, blocked.stderr


def test_a_plugin_command_named_like_another_plugins_is_refused_naming_both(site):
    make_dist(site, "octfw-first", "plug_first", NAMED_PLUGIN.format(name="tidy"))
    make_dist(site, "octfw-second", "plug_second", NAMED_PLUGIN.format(name="tidy"))
    with pytest.raises(PluginError) as refused:
        load_commands()
    message = str(refused.value)
    assert message.startswith("command 'tidy' is registered twice: by plug_")
    assert "(octfw-first 1.2.3)" in message and "(octfw-second 1.2.3)" in message


def test_a_plugin_command_named_like_the_prepared_datasets_is_refused_too(site):
    make_dist(site, "octfw-prep", "plug_prep", NAMED_PLUGIN.format(name="prepare"))
    with pytest.raises(PluginError, match=r"command 'prepare' is registered twice: by "
                                          r"octfw\.plugins\.datasets\.prepared \(octfw .*\) and by "
                                          r"plug_prep \(octfw-prep 1\.2\.3\)"):
        build_parser()


def test_a_broken_plugin_leaves_the_other_commands_and_is_named_when_its_command_is_asked_for(site, capsys):
    make_dist(site, "octfw-broken", "plug_broken", "raise RuntimeError('half installed')\n")
    make_dist(site, "octfw-oddname", "plug_oddname", NAMED_PLUGIN.format(name="Two Words"))
    make_dist(site, "octfw-hello", "plug_hello", HELLO_PLUGIN)
    assert main(["hello", "vitreous"]) == 0
    assert capsys.readouterr().out == "hello, vitreous\n"

    commands, failures = load_commands()
    assert [c.name for c in commands if c.plugin.startswith("plug_")] == ["hello"]
    assert {f.distribution: f.error for f in failures} == {
        "octfw-broken": "RuntimeError: half installed",
        "octfw-oddname": "TypeError: command name 'Two Words': lower-case letters, digits and '-', "
                         "starting with a letter",
    }
    with pytest.raises(SystemExit) as exited:  # an unknown command: argparse's exit 2, the failures named first
        main(["tidy"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "plugin 'plug_broken' from octfw-broken failed to load: RuntimeError: half installed" in err
    assert "invalid choice: 'tidy'" in err


def test_a_plugin_command_that_cannot_add_its_arguments_is_listed_as_failed_and_every_other_command_runs(tmp_path):
    make_dist(tmp_path, "octfw-tangled", "plug_tangled", TANGLED_PLUGIN)

    listed = _octfw(tmp_path, "list", "--stage", "guard")
    assert listed.returncode == 0, listed.stderr
    assert "quiet" in listed.stdout  # the plugin's component is there
    assert listed.stderr.splitlines() == [f"octfw: warning: {TANGLED}"]
    as_json = _octfw(tmp_path, "list", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["failures"] == [{
        "distribution": "octfw-tangled", "entry_point": "plug_tangled", "command": "tangle",
        "error": "add_arguments raised ArgumentError: argument --x: conflicting option string: --x"}]

    shown = _octfw(tmp_path, "show", str(REPO / "recipes" / "quickstart.toml"))
    assert shown.returncode == 0 and "[model]" in shown.stdout, shown.stderr
    assert shown.stderr.splitlines() == [f"octfw: warning: {TANGLED}"]

    other = _octfw(tmp_path, "tidy")  # the plugin's other command (it loads no registry: no warning)
    assert (other.returncode, other.stdout, other.stderr) == (0, "tidied\n", "")
    helped = _octfw(tmp_path, "--help")
    assert helped.returncode == 0 and "Works." in helped.stdout and "Never gets" not in helped.stdout

    asked = _octfw(tmp_path, "tangle", "--x", "1")
    assert (asked.returncode, asked.stdout, asked.stderr) == (2, "", f"octfw: error: {TANGLED}\n")


@pytest.mark.slow
def test_a_plugin_command_that_cannot_add_its_arguments_leaves_run_and_a_launched_jobs_workers_training(tmp_path):
    """``octfw run`` alone and as a launched job of two processes (each a ``python -m octfw.cli``
    of its own, building the parser anew): the run finishes, and the failure is named once."""
    make_dist(tmp_path, "octfw-tangled", "plug_tangled", TANGLED_PLUGIN)
    (tmp_path / "tiny.toml").write_text(TINY_RECIPE)
    for launch in ([], ["--nproc-per-node=2"]):
        done = _octfw(tmp_path, "run", "tiny.toml", *launch, "--set=run.max_steps=2",
                      "--set=engine.per_device_batch=1", f"--set=run.output_dir={tmp_path / 'runs'}",
                      PJRT_DEVICE="CPU", OMP_NUM_THREADS="1")
        assert done.returncode == 0, (launch, done.stderr[-3000:])
        output = done.stdout + done.stderr
        assert output.count(TANGLED) == 1, (launch, output[-3000:])
    assert len(list((tmp_path / "runs" / "tiny").iterdir())) == 2  # both trained a run of their own


def test_a_command_given_as_module_and_function_is_imported_only_when_it_runs(site, capsys):
    (site / "plug_lazy_work.py").write_text("def run(args):\n    print('worked')\n    return 3\n")
    make_dist(site, "octfw-lazy", "plug_lazy", NAMED_PLUGIN.format(name="lazy"))
    build_parser()
    assert "plug_lazy_work" not in sys.modules  # `octfw --help` did not import the work
    assert main(["lazy"]) == 3
    assert capsys.readouterr().out == "worked\n"


def test_help_and_every_plugins_registration_import_no_heavy_package():
    """``octfw --help`` imports every plugin's command registration: none may import torch or the like."""
    code = ("import sys, contextlib, io\nfrom octfw.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])\n"
            "heavy = ('numpy', 'torch', 'torch_xla', 'dask', 'distributed', 'zarr', 'gcsfs', 'wandb', 'pydicom',\n"
            "         'monai', 'matplotlib', 'scipy')\n"
            "print('HEAVY', sorted(m for m in heavy if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


def test_prepare_is_the_prepared_datasets_own_command(monkeypatch, capsys):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    [prepare] = [c for c in load_commands(entry_points=[])[0] if c.name == "prepare"]
    assert (prepare.plugin, prepare.distribution) == ("octfw.plugins.datasets.prepared", "octfw")
    monkeypatch.setenv(DISABLE_ENV, "octfw.plugins.datasets.prepared")  # blocked with its dataset
    with pytest.raises(SystemExit) as exited:
        main(["prepare", "recipe.toml", "--out", "x"])
    assert exited.value.code == 2 and "invalid choice: 'prepare'" in capsys.readouterr().err


def test_octfws_own_commands_are_named_like_their_modules():
    """The names reserved for octfw's own commands are its command modules' names: each adds that command."""
    import argparse
    import importlib
    import pkgutil

    import octfw.cli.commands

    for module in pkgutil.iter_modules(octfw.cli.commands.__path__):
        if module.name.startswith("_"):
            continue
        subparsers = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"octfw.cli.commands.{module.name}").add_parser(subparsers)
        assert list(subparsers.choices) == [module.name], module.name
