"""The Python API (octfw.api): what the CLI does, with typed exceptions instead of exit codes.

Real runs of the tiny recipe on the CPU; a fresh interpreter checks what
`import octfw` offers and that it stays light.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import octfw
from octfw.display.errors import RecipeError, RunNotFinished, UserError

LABELLED = '{ name = "synthetic-oct", n_volumes = 24, labels = true, seed = 5 }'
EVAL_RECIPE = f"""
[run]
seed = 3
device = "cpu"

[[evaluator]]
name = "knn"
dataset = {LABELLED}
k = 3
bootstrap = 0
"""


def test_import_octfw_lists_the_api_and_imports_no_torch():
    code = ("import sys, octfw\n"
            "print(sorted(n for n in ('load_recipe', 'train', 'evaluate', 'export', 'load_encoder',"
            " 'TrainResult', 'RunNotFinished') if n in dir(octfw) and n in octfw.__all__))\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == [
        "['RunNotFinished', 'TrainResult', 'evaluate', 'export', 'load_encoder', 'load_recipe', 'train']", "False"]


def test_recipe_mistakes_are_raised_as_typed_one_line_errors(tiny_recipe):
    with pytest.raises(RecipeError) as exc:
        octfw.load_recipe(tiny_recipe, ["engine.base_lr=-1", "run.bogus=1"])
    assert sorted(p.split(":")[0] for p in exc.value.problems) == ["--set engine.base_lr=-1", "--set run.bogus=1"]
    with pytest.raises(UserError, match="give a list of 'table.key=value' strings"):
        octfw.load_recipe(tiny_recipe, "run.max_steps=2")
    with pytest.raises(UserError, match="recipe not found"):
        octfw.train(tiny_recipe.parent / "missing.toml")


def test_train_resume_evaluate_export_and_load_from_python(tiny_recipe, tmp_path):
    # A constant LR and EMA: the run can be extended below without either restarting.
    constant = ["scheduler.name=constant", "scheduler.ema_shape=constant"]
    recipe = octfw.load_recipe(tiny_recipe, ["run.max_steps=3", "engine.checkpoint_every_steps=2", *constant])
    result = octfw.train(recipe)
    assert isinstance(result, octfw.TrainResult)
    assert result.run_dir.is_dir() and (result.run_dir / "summary.json").is_file()
    assert result.summary["update_steps"] == 3 and result.summary["stopped"] is None
    assert result.checkpoint is not None and Path(result.checkpoint).name == "step_00000003.pt"

    again = octfw.train(recipe, resume="auto")  # finished: returned as it is, nothing trained
    assert again.run_dir == result.run_dir and again.summary["update_steps"] == 3

    longer = octfw.load_recipe(tiny_recipe, ["run.max_steps=5", "engine.checkpoint_every_steps=2", *constant])
    with pytest.raises(octfw.RecipeError, match="run.max_steps: 3 -> 5"):  # another length: said, refused
        octfw.train(longer, resume="auto")
    resumed = octfw.train(longer, resume="auto", allow_recipe_change=True)  # the same run, continued to step 5
    assert resumed.run_dir == result.run_dir and resumed.summary["update_steps"] == 5

    eval_path = tmp_path / "eval.toml"
    eval_path.write_text(textwrap.dedent(EVAL_RECIPE))
    report = octfw.evaluate(result.run_dir, eval_path)
    assert report.update_step == 5
    assert 0.0 <= report.pretrained["knn/balanced_accuracy"] <= 1.0
    assert set(report.pretrained) == set(report.random_init)

    encoder_file = octfw.export(result.run_dir, tmp_path / "encoder.pt")
    encoder = octfw.load_encoder(encoder_file)
    tokens = encoder(torch.zeros(1, 1, 8, 32, 32))
    assert tokens.shape[:2] == (1, 2 * 2 * 2)

    with pytest.raises(UserError, match="is a folder"):
        octfw.export(result.run_dir, tmp_path)


def test_a_guard_that_stops_the_run_raises_run_not_finished_with_the_result(tiny_recipe):
    tiny_recipe.write_text(tiny_recipe.read_text()
                           + '\n[[guard]]\nname = "collapse"\nmin_std = 1e9\naction = "stop"\npatience = 1\n')
    with pytest.raises(RunNotFinished) as exc:
        octfw.train(tiny_recipe)
    assert exc.value.reason == "stopped" and "stopped early" in str(exc.value)
    assert exc.value.result.summary["stopped"] and exc.value.result.run_dir.is_dir()
