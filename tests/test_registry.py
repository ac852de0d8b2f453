"""Plugin discovery: built-ins, installed distributions, duplicates, broken plugins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from octfw.display.errors import PluginError
from octfw.hookspecs import STAGES
from octfw.registry import load_registry

from conftest import make_dist

REPO = Path(__file__).resolve().parents[1]

SCHEDULER_PLUGIN = '''
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class Config:
    steps: int = 3

@hookimpl
def octfw_register_schedulers(register):
    register("{name}", Config, "math:sqrt", "A test schedule.")
'''


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("plug_")]:
        del sys.modules[name]


def test_every_stage_has_a_builtin_component(registry):
    for stage in STAGES:
        assert registry.names(stage), f"no built-in {stage}"
    assert registry.get("scheduler", "cosine-no-restart").distribution == "octfw"


def test_third_party_plugin_is_found_through_its_entry_point(site):
    make_dist(site, "octfw-fancy", "plug_fancy", SCHEDULER_PLUGIN.format(name="fancy"))
    component = load_registry().get("scheduler", "fancy")
    assert (component.distribution, component.version, component.plugin) == ("octfw-fancy", "1.2.3", "plug_fancy")
    assert component.summary == "A test schedule."


def test_duplicate_component_names_both_origins(site):
    make_dist(site, "octfw-dup", "plug_dup", SCHEDULER_PLUGIN.format(name="constant"))
    with pytest.raises(PluginError) as exc:
        load_registry()
    message = str(exc.value)
    assert "'constant' is registered twice" in message
    assert "octfw.plugins.schedulers.constant (octfw" in message and "plug_dup (octfw-dup 1.2.3)" in message


def test_broken_plugin_is_reported_with_its_distribution_and_the_rest_loads(site):
    make_dist(site, "octfw-broken", "plug_broken", "import this_module_does_not_exist\n")
    make_dist(site, "octfw-fine", "plug_fine", SCHEDULER_PLUGIN.format(name="fine"))
    registry = load_registry()
    assert [f.distribution for f in registry.failures] == ["octfw-broken"]
    assert "ModuleNotFoundError" in registry.failures[0].error
    assert registry.get("scheduler", "fine").distribution == "octfw-fine"
    assert registry.get("model", "vjepa3d")


def test_misspelled_hook_is_reported_not_silently_ignored(site):
    code = SCHEDULER_PLUGIN.format(name="typo").replace("octfw_register_schedulers", "octfw_register_schedulerz")
    make_dist(site, "octfw-typo", "plug_typo", code)
    registry = load_registry()
    assert [f.distribution for f in registry.failures] == ["octfw-typo"]
    assert "octfw_register_schedulerz" in registry.failures[0].error


def test_registration_that_raises_drops_only_that_plugin(site):
    code = SCHEDULER_PLUGIN.format(name="bad").replace('register("bad", Config', 'register("bad", dict')
    make_dist(site, "octfw-badconfig", "plug_badconfig", code)
    registry = load_registry()
    assert "must be an attrs class" in registry.failures[0].error
    assert "bad" not in registry.names("scheduler")


def test_a_config_with_a_name_field_is_refused_at_registration(site):
    """`name` selects the component in a recipe table: an option of that name could never be set
    (the W&B logger's display name was one) and would vanish from the saved recipe."""
    code = SCHEDULER_PLUGIN.format(name="clash").replace("    steps: int = 3", "    name: str = 'x'")
    make_dist(site, "octfw-clash", "plug_clash", code)
    registry = load_registry()
    assert [f.distribution for f in registry.failures] == ["octfw-clash"]
    assert "has a field 'name'" in registry.failures[0].error
    assert "clash" not in registry.names("scheduler")


def test_disable_env_blocks_plugins_by_entry_point_or_distribution(site, monkeypatch):
    make_dist(site, "octfw-dup", "plug_dup", SCHEDULER_PLUGIN.format(name="constant"))
    monkeypatch.setenv("OCTFW_DISABLE_PLUGINS", "plug_dup, octfw.plugins.guards.collapse")
    registry = load_registry()
    assert registry.get("scheduler", "constant").distribution == "octfw"
    assert "collapse" not in registry.names("guard") and "nan-skip" in registry.names("guard")


def test_unknown_component_suggests_the_closest_name(registry):
    with pytest.raises(PluginError, match=r"unknown model component 'vjepa3' \(did you mean 'vjepa3d'\?\)"):
        registry.get("model", "vjepa3")


def test_listing_imports_no_heavy_dependency():
    code = ("import sys\nfrom octfw.cli.main import main\n"
            "main(['list'])\n"
            "heavy = [m for m in ('torch', 'torch_xla', 'wandb', 'gcsfs', 'monai', 'pydicom') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout, out.stdout


def test_example_plugin_package_installs_and_its_component_runs(tmp_path, tiny_recipe):
    """A real pip install of examples/octfw-example-plugin, then octfw uses it."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO / "examples" / "octfw-example-plugin")],
        check=True, capture_output=True, text=True,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO)])}
    listed = subprocess.run([sys.executable, "-m", "octfw.cli", "list", "--json", "--stage", "scheduler"],
                            capture_output=True, text=True, env=env, check=True)
    rows = {r["name"]: r for r in json.loads(listed.stdout)["components"]}
    assert rows["linear-decay"]["distribution"] == "octfw-example-plugin"
    run = subprocess.run(
        [sys.executable, "-m", "octfw.cli", "run", str(tiny_recipe), "--set", "scheduler.name=linear-decay",
         "--set", "scheduler.warmup_steps=2"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    metrics = [json.loads(line) for line in next((tmp_path / "runs" / "tiny").glob("*/metrics.jsonl")).read_text().splitlines()]
    assert [round(m["lr"], 6) for m in metrics[:2]] == [0.0005, 0.001]

    # Its dataset and guard, written as the plugin guide says: train on .npy volumes (one of them
    # broken: quarantined, the run goes on) until the loss target ends the run as done (exit 0).
    import numpy as np

    volumes = tmp_path / "volumes"
    volumes.mkdir()
    rng = np.random.default_rng(0)
    for index in range(6):
        np.save(volumes / f"v{index}.npy", rng.normal(100.0, 20.0, (8, 40, 40)).astype(np.float32))
    (volumes / "broken.npy").write_bytes(b"not numpy")
    (volumes / "spacing.json").write_text("[0.2, 0.01, 0.01]")
    npy = tiny_recipe.parent / "npy.toml"
    npy.write_text(tiny_recipe.read_text().replace(
        'name = "synthetic-oct"\nn_volumes = 8', f'name = "npy-folder"\npath = "{volumes}"')
        + '\n[[guard]]\nname = "loss-target"\nbelow = 1e9\npatience = 2\n')
    listed = subprocess.run([sys.executable, "-m", "octfw.cli", "list", "--name", "npy-folder"],
                            capture_output=True, text=True, env=env, check=True)
    assert "Folder of .npy volumes" in listed.stdout

    # Its command, the dataset's own step, as the plugin guide writes one: listed, then run.
    helped = subprocess.run([sys.executable, "-m", "octfw.cli", "--help"],
                            capture_output=True, text=True, env=env, check=True)
    assert "npy-check" in helped.stdout and "(octfw-example-plugin 0.1.0)" in " ".join(helped.stdout.split())
    checked = subprocess.run([sys.executable, "-m", "octfw.cli", "npy-check", str(volumes)],
                             capture_output=True, text=True, env=env)
    assert checked.returncode == 1, checked.stderr
    assert checked.stdout.splitlines()[0] == "6 of 7 volumes usable"
    assert "not usable: broken.npy: not a numpy volume" in checked.stdout
    missing = subprocess.run([sys.executable, "-m", "octfw.cli", "npy-check", str(tmp_path / "nowhere")],
                             capture_output=True, text=True, env=env)
    assert (missing.returncode, missing.stderr.strip()) == (2, f"octfw: error: {tmp_path / 'nowhere'} is not a folder")
    run = subprocess.run([sys.executable, "-m", "octfw.cli", "run", str(npy), "--set", "run.max_steps=8",
                          "--set", "engine.per_device_batch=4"],  # 2 steps read all 7 files
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    [run_dir] = (tiny_recipe.parent / "runs" / "npy").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == 2 and summary["stopped"] is None
    assert summary["finished_early"].startswith("loss ") and summary["quarantined"] == 1
    [bad] = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert bad["url"].endswith("broken.npy") and bad["reason"].startswith("not a numpy volume")
