"""What cannot be resumed exactly is refused, naming the difference; nothing is half-loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from octfw.cli import main


@pytest.fixture
def checkpoint(tiny_recipe, tmp_path) -> Path:
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=2"]) == 0
    [run_dir] = list((tmp_path / "runs" / "tiny").iterdir())
    return Path(json.loads((run_dir / "summary.json").read_text())["checkpoint"])


@pytest.mark.parametrize("override, message", [
    ("model.depth=3", "trained with another model (model.depth None -> 3)"),
    ("engine.per_device_batch=1", "global batch of 2 samples, this run has 1"),
    ("dataset.n_volumes=10", "dataset had 8 samples, this one has 10"),
])
def test_a_checkpoint_of_another_run_shape_is_refused(tiny_recipe, checkpoint, capsys, override, message):
    code = main(["run", str(tiny_recipe), "--set", override, "--resume", str(checkpoint)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_checkpoint_cut_short_is_a_user_error(tiny_recipe, checkpoint, tmp_path, capsys):
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    code = main(["run", str(tiny_recipe), "--resume", str(truncated)])
    err = capsys.readouterr().err
    assert code == 2 and f"checkpoint {truncated} cannot be read" in err and "cut short" in err


def test_the_same_run_shape_resumes(tiny_recipe, checkpoint, capsys):
    assert main(["run", str(tiny_recipe), "--resume", str(checkpoint), "--set", "run.max_steps=2",
                 "--set", "engine.log_every_steps=2"]) == 0
    assert "resumed with a changed recipe: engine.log_every_steps: 1 -> 2" in capsys.readouterr().err


def test_a_longer_run_is_a_change_of_training_refused_unless_accepted(tiny_recipe, checkpoint, capsys):
    longer = ["run", str(tiny_recipe), "--set", "run.max_steps=3", "--resume", str(checkpoint)]
    assert main(longer) == 2
    err = capsys.readouterr().err
    assert "the checkpoint was trained with another recipe" in err and "  run.max_steps: 2 -> 3" in err
    assert main([*longer, "--allow-recipe-change"]) == 0
    assert "run.max_steps: 2 -> 3 (changes training; accepted)" in capsys.readouterr().err


def test_turning_on_activation_checkpointing_resumes(tiny_recipe, checkpoint, capsys):
    """It changes how memory is spent, not the weights or the numbers: the way
    out of an out-of-memory crash is allowed on --resume."""
    assert main(["run", str(tiny_recipe), "--set", "model.activation_checkpointing=true", "--set", "run.max_steps=2",
                 "--resume", str(checkpoint)]) == 0
