"""Seed failure: one distributed training job showed up as 4 concurrent W&B
runs, one per worker, in inconsistent states.

octfw builds loggers on rank 0 only (and the wandb logger does nothing on
other ranks): a 2-process torchrun job with the wandb logger, offline, leaves
exactly one offline run folder."""

import os
import subprocess
import sys

from seedkit import REPO, write_tiny


def test_two_process_job_makes_exactly_one_wandb_run(tmp_path):
    recipe = write_tiny(tmp_path)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(REPO),
           "WANDB_DIR": str(tmp_path / "wandb-default")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "octfw.cli", "run", str(recipe), "--set", "engine.per_device_batch=1",
               "--set", "run.max_steps=2", "--set", 'logger=[{name="jsonl"}, {name="wandb", mode="offline"}]']
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    offline_runs = [p for p in tmp_path.rglob("offline-run-*") if p.is_dir()]
    assert len(offline_runs) == 1, offline_runs
    run_dirs = list((tmp_path / "runs" / "tiny").iterdir())
    assert len(run_dirs) == 1 and offline_runs[0].is_relative_to(run_dirs[0])
