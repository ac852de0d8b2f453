"""Seed failure: ``ckpt_dir: null`` in the smoke-test YAML became the string
"None"; the workers crashed at step 7 with ``Invalid bucket name: 'None'``.

In octfw that cannot happen: TOML has no null, every null-like spelling of a
location is refused with the key named, and a left-out key takes its
documented default (``<run_dir>/checkpoints``), never a folder or bucket
named None."""

import os

import pytest

from seedkit import cli, metrics, train, write_tiny

NULL_SPELLINGS = ["None", "none", "null", "NULL", "Nil", "", "  "]


@pytest.mark.parametrize("spelling", NULL_SPELLINGS)
@pytest.mark.parametrize("key", ["checkpointer.dir", "run.output_dir", "run.cache_dir"])
def test_every_null_like_location_is_refused(tmp_path, capsys, key, spelling):
    recipe = write_tiny(tmp_path)
    code, out, err = cli(capsys, "check", recipe, "--set", f'{key}="{spelling}"')
    assert code == 2
    # The problem names the --set that wrote it (a recipe file's key would be named so instead).
    assert f"--set {key}=" in err and f"{spelling!r} is not a location; leave the key out" in err


def test_null_like_gcs_checkpoint_dir_is_refused(tmp_path, capsys):
    recipe = write_tiny(tmp_path)
    code, _, err = cli(capsys, "check", recipe, "--set", 'checkpointer={name="gcs", dir="None"}')
    assert code == 2 and "checkpointer.dir: 'None' is not a location" in err


def test_a_toml_null_is_a_recipe_error(tmp_path, capsys):
    recipe = write_tiny(tmp_path, '[checkpointer]\nname = "local"\ndir = null\n')
    code, _, err = cli(capsys, "check", recipe)
    assert code == 2 and str(recipe) in err


def test_left_out_checkpoint_dir_goes_to_the_run_folder_and_nothing_is_named_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = write_tiny(tmp_path)
    summary, run_dir = train(recipe, ["run.max_steps=2", "engine.checkpoint_every_steps=1"])
    assert len(metrics(run_dir)) == 2
    assert summary.checkpoint == str(run_dir / "checkpoints" / "step_00000002.pt")
    named_none = [os.path.join(root, name) for root, dirs, files in os.walk(tmp_path)
                  for name in dirs + files if name.lower() in ("none", "null")]
    assert named_none == []
