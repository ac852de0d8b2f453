"""Preemption: a real SIGTERM to a training process, then ``--resume auto`` again and again.

The run is an ``octfw run`` subprocess on the CPU, as on a spot VM: the
signal arrives at a random point of an update step; the process finishes the
step, saves, exits with code 75 and names the resume command. The resumed
run's losses are bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from octfw.engine.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow

STEPS = 24


def _octfw(recipe: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "octfw.cli", "run", str(recipe), "--set", f"run.max_steps={STEPS}",
            "--set", "engine.checkpoint_every_steps=5", *args]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _env() -> dict[str, str]:
    return {**os.environ, "PJRT_DEVICE": "CPU"}


def _runs(tmp_path: Path) -> list[Path]:
    root = tmp_path / "runs" / "tiny"
    return sorted(p for p in root.iterdir()) if root.exists() else []


def _wait_for_step(run_dir_root: Path, step: int, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        files = list(run_dir_root.glob("*/metrics.jsonl"))
        if files and len(files[0].read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no update step {step} within {timeout_s} s")


def test_sigterm_saves_and_resume_auto_continues_bitwise(tiny_recipe, tmp_path):
    reference_dir = tmp_path / "reference"
    done = subprocess.run(_octfw(tiny_recipe, "--set", f"run.output_dir={reference_dir}"),
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    reference = _metrics(next((reference_dir / "tiny").iterdir()))
    assert len(reference) == STEPS

    # The same run, preempted by a real SIGTERM once it has logged update step 7.
    process = subprocess.Popen(_octfw(tiny_recipe), cwd=tmp_path, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(tmp_path / "runs" / "tiny", 7, process)
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=300)
    assert process.returncode == PREEMPTED_EXIT_CODE, err
    assert "SIGTERM received" in err
    assert f"Resume with: octfw run {tiny_recipe}" in err and "--resume auto" in err
    [run_dir] = _runs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["update_steps"]
    assert summary["preempted"] is True and 7 <= stopped_at < STEPS
    assert summary["checkpoint"].endswith(f"step_{stopped_at:08d}.pt")  # the step it finished
    assert len(_metrics(run_dir)) == stopped_at

    # The scheduler starts the same command again: it continues the same run, bitwise.
    again = subprocess.run(_octfw(tiny_recipe, "--resume", "auto"), cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert _runs(tmp_path) == [run_dir]
    resumed = _metrics(run_dir)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in reference]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in reference]

    # And once more: the run is complete, nothing is trained again.
    third = subprocess.run(_octfw(tiny_recipe, "--resume", "auto"), cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr
    assert "nothing to resume" in third.stderr and f"{STEPS}/{STEPS} update steps" in third.stderr
    assert _runs(tmp_path) == [run_dir] and len(_metrics(run_dir)) == STEPS


def test_resume_auto_with_no_earlier_run_starts_one(tiny_recipe, tmp_path):
    from octfw.cli.main import main

    assert main(["run", str(tiny_recipe), "--resume", "auto"]) == 0
    [run_dir] = _runs(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["update_steps"] == 4
