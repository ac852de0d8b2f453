"""``octfw replay`` rebuilds a step's batch and reproduces its loss on the CPU."""

from __future__ import annotations

import json

import pytest

from octfw.cli.main import main
from octfw.diagnostics.replay import replay
from octfw.registry import load_registry


def test_replay_reproduces_the_logged_loss_and_gradient_norm(tiny_recipe, tmp_path, capsys):
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=5", "--set", "engine.checkpoint_every_steps=2"]) == 0
    run_dir = next((tmp_path / "runs" / "tiny").iterdir())
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()
    for step, start in ((1, 0), (4, 2)):  # step 4 starts from the checkpoint of step 2
        result = replay(run_dir, step, load_registry(), report=lambda line: None)
        assert result["from_step"] == start
        assert result["loss"] == pytest.approx(logged[step - 1]["loss"], rel=1e-6)
        assert result["grad_norm"] == pytest.approx(logged[step - 1]["grad_norm"], rel=1e-6)
        assert len(result["samples"]) == 2 and all(s.endswith(".dcm") for s in result["samples"])
        assert result["applied"] and set(result["groups"]) == {"decay", "no_decay"}
    assert main(["replay", str(run_dir), "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert "replay of update step 3 on the CPU" in out and "context_idx" in out and "verdict" in out


def test_replay_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["replay", str(tmp_path), "--step", "1"]) == 2
    assert "not a run directory (no recipe.toml)" in capsys.readouterr().err
