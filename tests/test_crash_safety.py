"""A training process SIGKILLed in the middle of a checkpoint save resumes from the last complete one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from octfw.plugins.checkpointers.local import LocalCheckpointer

from conftest import make_dist

# A guard whose state is a large tensor: it goes into every checkpoint, so a
# save takes long enough (write + fsync) for the test to kill the process in it.
BALLAST_PLUGIN = '''
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class BallastConfig:
    megabytes: int = 48

class Ballast:
    def __init__(self, megabytes):
        import torch
        self.ballast = torch.ones(megabytes * 2**18)  # float32: 4 bytes each
    def before_step(self, inputs):
        return None
    def at_log_step(self, update_step, metrics):
        pass
    def state_dict(self):
        return {"ballast": self.ballast}
    def load_state_dict(self, state):
        self.ballast = state["ballast"]

@hookimpl
def octfw_register_guards(register):
    register("ballast", BallastConfig, lambda c, ctx: Ballast(c.megabytes), "a large guard state")
'''


def octfw(cwd: Path, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "octfw.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_during_a_save_then_resume_auto_starts_from_the_last_complete_checkpoint(tiny_recipe, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "octfw-ballast", "plug_ballast", BALLAST_PLUGIN)
    env = {**os.environ, "PJRT_DEVICE": "CPU",
           "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parents[1])])}
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[guard]]\nname = "ballast"\n')
    args = ("run", str(tiny_recipe), "--set", "run.max_steps=3", "--set", "engine.checkpoint_every_steps=1")

    process = octfw(tmp_path, env, *args)
    runs = tmp_path / "runs" / "tiny"
    deadline = time.monotonic() + 120
    partial = None
    while partial is None:
        assert process.poll() is None, f"the run ended before a second save began:\n{process.communicate()[1]}"
        assert time.monotonic() < deadline, "no second save began within 120 s"
        # Saves run in the background, one at a time: the step-1 save is being written while
        # step 2 runs (so step 2's save is skipped) and the final save (step 3) waits for it.
        partial = next((p for p in runs.glob("*/checkpoints/step_*.pt.tmp")
                        if p.name != "step_00000001.pt.tmp"), None)
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)  # in the middle of writing a save after step 1's
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    killed_at = int(partial.name[len("step_"):-len(".pt.tmp")])

    folder = partial.parent
    run_dir = folder.parent
    assert partial.exists() and not (folder / f"step_{killed_at:08d}.pt").exists()
    assert json.loads((folder / "latest").read_text())["checkpoints"][0]["name"] == "step_00000001.pt"
    checkpointer = LocalCheckpointer(folder)
    assert checkpointer.latest() == str(folder / "step_00000001.pt")
    assert checkpointer.load(checkpointer.latest())["update_step"] == 1
    logged_before = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged_before == list(range(1, killed_at + 1))  # logged, then killed while saving

    resumed = octfw(tmp_path, env, *args, "--resume", "auto")
    out, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The resumed run redid steps 2 and 3 after checkpoint 1, and the lines the killed attempt
    # wrote after that checkpoint were dropped: one line per log step.
    assert steps == [1, 2, 3]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == 3 and summary["failed_saves"] == []
    assert summary["checkpoint"] == str(folder / "step_00000003.pt")
    assert not partial.exists()  # the interrupted save's leftover was cleaned up
