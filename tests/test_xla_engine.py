"""XLA hygiene of the real engine on torch_xla's CPU device (PJRT_DEVICE=CPU).

The run happens in a subprocess: importing torch_xla patches torch for the
whole process. 100 update steps with gradient accumulation, three guards,
EMA and logging every 10 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_RECIPE

SCRIPT = Path(__file__).parent / "xla" / "engine_hygiene.py"
STEPS, LOG_EVERY = 100, 10
# Cheaper XLA CPU compilation: same graphs and caching, about 10x faster compiles.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("xla")
    recipe = folder / "tiny.toml"
    recipe.write_text(TINY_RECIPE)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "XLA_FLAGS": FAST_COMPILE}
    out = subprocess.run([sys.executable, str(SCRIPT), str(recipe), str(STEPS)], capture_output=True,
                         text=True, cwd=folder, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runs_every_update_step_through_the_parallel_device_loader(xla_run):
    assert xla_run["update_steps"] == STEPS
    assert xla_run["mp_device_loaders"] == 1


def test_no_compilation_after_warm_up(xla_run):
    rows = xla_run["rows"]
    # Warm-up: the first steps (optimizer state appears at step 1) and the first
    # log step (its read graph, and the step after it) compile; then nothing.
    warm = rows[LOG_EVERY + 2]["compiles"]
    assert [r["compiles"] for r in rows[LOG_EVERY + 2:]] == [warm] * (STEPS - LOG_EVERY - 2)


def test_device_to_host_transfers_only_on_log_steps(xla_run):
    rows = xla_run["rows"]
    for before, after in zip(rows, rows[1:]):
        done = before["step"] + 1
        moved = after["transfers"] - before["transfers"]
        if done % LOG_EVERY:
            assert moved == 0, f"update step {done} is not a log step but moved {moved} tensors to the host"
        else:
            assert moved > 0
    assert all(r["item_calls"] == 0 for r in rows), "a .item() ran inside the training loop"
