"""The tensorboard logger, read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from octfw.cli.main import main

TENSORBOARD_LOGGER = '\n[[logger]]\nname = "tensorboard"\nflush_secs = 1\n'


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def read_text(folder: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    [event] = events.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def jsonl_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_metric_is_a_scalar_at_its_update_step_with_the_recipe_and_summary_as_text(tiny_recipe):
    tiny_recipe.write_text(tiny_recipe.read_text() + TENSORBOARD_LOGGER)
    assert main(["run", str(tiny_recipe), "--set", "run.max_steps=3"]) == 0
    [run_dir] = (tiny_recipe.parent / "runs" / "tiny").iterdir()
    scalars = read_scalars(run_dir / "tensorboard")
    rows = jsonl_rows(run_dir)
    assert {"loss", "lr", "grad_norm"} <= set(scalars) and any(tag.startswith("loss/") for tag in scalars)
    for tag in ("loss", "lr", "grad_norm"):  # the values the jsonl logger got, at the same steps
        assert [step for step, _ in scalars[tag]] == [row["step"] for row in rows]
        assert [value for _, value in scalars[tag]] == pytest.approx([row[tag] for row in rows], rel=1e-6)
    assert json.loads(read_text(run_dir / "tensorboard", "recipe").strip("`\n"))["run"]["max_steps"] == 3
    assert json.loads(read_text(run_dir / "tensorboard", "summary").strip("`\n"))["update_steps"] == 3


# A guard that SIGKILLs its own process at a log step, after TensorBoard's writer has flushed.
KILLER_PLUGIN = """
import os, signal, time
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class KillerConfig:
    at_step: int = 4

class Killer:
    def __init__(self, at_step):
        self.at_step = at_step
    def before_step(self, inputs):
        return None
    def at_log_step(self, update_step, metrics):
        if update_step == self.at_step:
            time.sleep(1.5)  # flush_secs = 1: what was logged is on disk
            os.kill(os.getpid(), signal.SIGKILL)

@hookimpl
def octfw_register_guards(register):
    register("killer", KillerConfig, lambda c, ctx: Killer(c.at_step), "kill -9 at a step")
"""


def test_a_run_killed_after_its_checkpoint_resumes_showing_each_step_once(tiny_recipe, tmp_path):
    """kill -9 at step 4, the newest checkpoint at step 2: the resumed run's writer purges the
    killed attempt's step 3 (and 4), so TensorBoard shows steps 1 to 6 once each, and the values
    after step 2 are the resumed run's."""
    import os
    import subprocess
    import sys

    from conftest import make_dist

    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "octfw-killer", "plug_killer", KILLER_PLUGIN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parents[1])])}
    recipe = tiny_recipe.read_text() + TENSORBOARD_LOGGER
    tiny_recipe.write_text(recipe + '\n[[guard]]\nname = "killer"\n')
    sets = ["--set", "run.max_steps=6", "--set", "engine.checkpoint_every_steps=2"]
    killed = subprocess.run([sys.executable, "-m", "octfw.cli", "run", str(tiny_recipe), *sets],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    [run_dir] = (tiny_recipe.parent / "runs" / "tiny").iterdir()
    before = [step for step, _ in read_scalars(run_dir / "tensorboard")["loss"]]
    assert before[:3] == [1, 2, 3]  # the killed attempt wrote past its checkpoint

    tiny_recipe.write_text(recipe + '\n[[guard]]\nname = "killer"\nat_step = 0\n')
    resumed = subprocess.run([sys.executable, "-m", "octfw.cli", "run", str(tiny_recipe), *sets, "--resume", "auto",
                              "--allow-recipe-change"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    loss = read_scalars(run_dir / "tensorboard")["loss"]
    assert [step for step, _ in loss] == [1, 2, 3, 4, 5, 6]
    resumed_rows = [row for row in jsonl_rows(run_dir)][-4:]  # steps 3 to 6 of the resumed run
    assert [row["step"] for row in resumed_rows] == [3, 4, 5, 6]
    assert [value for _, value in loss[2:]] == pytest.approx([row["loss"] for row in resumed_rows], rel=1e-6)
