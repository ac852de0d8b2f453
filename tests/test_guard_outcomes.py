"""A guard ends a run two ways: stopped by a problem (exit 1) or done, a target reached (exit 0)."""

from __future__ import annotations

import json
import sys

import pytest

from octfw.cli.main import main

from conftest import make_dist

TARGET_PLUGIN = '''
import attrs
from octfw.recipe.fields import doc
from octfw.hookspecs import Register, hookimpl
from octfw.types import StopTraining, TrainingDone


@attrs.frozen
class LossTargetConfig:
    below: float = doc("end the run once the logged loss is below this", default=0.5)
    as_problem: bool = doc("end it as a problem (StopTraining) instead of as done", default=False)


class LossTarget:
    def __init__(self, config):
        self.config = config

    def before_step(self, inputs):
        return None

    def at_log_step(self, update_step, metrics):
        if metrics["loss"] < self.config.below:
            raise (StopTraining if self.config.as_problem else TrainingDone)(
                f"loss {metrics['loss']:.3f} < {self.config.below} at update step {update_step}")


@hookimpl
def octfw_register_guards(register: Register) -> None:
    register("loss-target", LossTargetConfig, lambda config, ctx: LossTarget(config), "end at a loss target")
'''


@pytest.fixture
def target_guard(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("target-site")
    make_dist(root, "octfw-target", "plug_target", TARGET_PLUGIN)
    monkeypatch.syspath_prepend(str(root))
    yield
    sys.modules.pop("plug_target", None)


def summary_of(recipe):
    [run_dir] = (recipe.parent / "runs" / recipe.stem).iterdir()
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def test_a_target_reached_ends_the_run_as_done_and_resume_auto_leaves_it(target_guard, tiny_recipe, capsys):
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[guard]]\nname = "loss-target"\nbelow = 1e9\n')
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=4"]) == 0
    run_dir, summary = summary_of(tiny_recipe)
    assert summary["update_steps"] == 1 and summary["stopped"] is None
    assert summary["finished_early"].startswith("loss ") and "at update step 1" in summary["finished_early"]
    assert summary["checkpoint"] and (run_dir / "checkpoints").is_dir()
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=4", "--resume", "auto"]) == 0
    assert "nothing to resume" in capsys.readouterr().err
    assert summary_of(tiny_recipe)[1]["update_steps"] == 1  # not trained again


def test_the_same_guard_ending_it_as_a_problem_exits_1(target_guard, tiny_recipe):
    tiny_recipe.write_text(tiny_recipe.read_text()
                           + '\n[[guard]]\nname = "loss-target"\nbelow = 1e9\nas_problem = true\n')
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=4"]) == 1
    _, summary = summary_of(tiny_recipe)
    assert summary["stopped"].startswith("loss ") and summary["finished_early"] is None
