"""Seed failure: the NaN came back every ~512 steps; the advice was to move
periodic routines (the checkpoint every 512 steps, with accumulation 2) to an
interval such as 997 that coincides with nothing, to tell a bad batch from a
periodic code path.

octfw counts every interval in update steps and warns, in ``octfw check`` and
``octfw run``, when ``engine.checkpoint_every_steps`` is a multiple of
``engine.grad_accum_steps`` (or of ``engine.log_every_steps``), suggesting an
interval that is not."""

import pytest

from seedkit import cli, write_tiny

COINCIDING = ["--set", "engine.grad_accum_steps=2", "--set", "engine.checkpoint_every_steps=512",
              "--set", "engine.log_every_steps=1", "--set", "dataset.n_volumes=16"]


@pytest.mark.parametrize("command", ["check", "run"])
def test_interval_in_phase_with_accumulation_is_warned(tmp_path, capsys, command):
    recipe = write_tiny(tmp_path)
    code, _, err = cli(capsys, command, recipe, *COINCIDING, "--set", "run.max_steps=2")
    assert code == 0
    warning = next(line for line in err.splitlines() if "engine.grad_accum_steps = 2" in line)
    assert "engine.checkpoint_every_steps = 512 is a multiple of" in warning
    assert "an interval such as 513 would not coincide" in warning


def test_interval_out_of_phase_is_not_warned(tmp_path, capsys):
    recipe = write_tiny(tmp_path)
    code, _, err = cli(capsys, "check", recipe, *COINCIDING, "--set", "engine.checkpoint_every_steps=997")
    assert code == 0 and "checkpoint_every_steps" not in err
