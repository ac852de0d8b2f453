"""Nothing lost, round two, made for real: runs in other time zones and on a skewed clock, a run
folder deleted under a live run, SIGTERM at 0.5 s, 2 s and during the first (compiling) update
step, a checkpoint disk out of inodes (a real tmpfs with ``nr_inodes``), and a save that comes
due while the previous one is still being written."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import make_dist
from octfw.cli.exit_codes import PREEMPTED_EXIT_CODE, SAVE_FAILED_EXIT_CODE

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a disk out of inodes) needs root; "
                                                          "CI runs as root")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]), **extra}


def _start(tmp_path: Path, recipe: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "octfw.cli", "run", str(recipe), *args], cwd=tmp_path,
                            env=env or _env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(tmp_path: Path, recipe: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    process = _start(tmp_path, recipe, *args, env=env)
    out, err = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _wait_for_step(root: Path, step: int, process: subprocess.Popen, timeout_s: float = 300,
                   other_than: Path | None = None) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        for metrics in root.glob("*/metrics.jsonl"):
            if metrics.parent != other_than and len(metrics.read_text().splitlines()) >= step:
                return metrics.parent
        time.sleep(0.05)
    raise AssertionError(f"no update step {step} within {timeout_s} s")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- which run is the newest: never the clock --------------------------------------------------


def test_a_run_preempted_in_another_time_zone_or_on_a_skewed_clock_is_the_one_resume_auto_continues(
        tiny_recipe, tmp_path):
    steps = ("--set", "run.max_steps=40", "--set", "engine.checkpoint_every_steps=2")
    finished = _run(tmp_path, tiny_recipe, *steps, env=_env(tmp_path, TZ="UTC"))
    assert finished.returncode == 0, finished.stderr
    root = tmp_path / "runs" / "tiny"
    [done_dir] = list(root.iterdir())
    assert done_dir.name.endswith("Z")  # folder names are UTC, and say so

    # A later run, on a host 8 hours behind: its folder name would sort before the finished one.
    preempted = _start(tmp_path, tiny_recipe, *steps, env=_env(tmp_path, TZ="America/Los_Angeles"))
    run_dir = _wait_for_step(root, 3, preempted, other_than=done_dir)
    preempted.send_signal(signal.SIGTERM)
    _out, err = preempted.communicate(timeout=120)
    assert preempted.returncode == PREEMPTED_EXIT_CODE, err
    stopped_at = json.loads((run_dir / "summary.json").read_text())["update_steps"]
    # A clock far ahead on the host that finished the first run: its folder now sorts last.
    skewed = done_dir.with_name("29991231-000000Z")
    done_dir.rename(skewed)

    resumed = _run(tmp_path, tiny_recipe, *steps, "--resume", "auto", env=_env(tmp_path, TZ="Asia/Tokyo"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"continuing {run_dir}" in resumed.stderr and "nothing to resume" not in resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == 40 and stopped_at < 40
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, 41))  # one line per log step across attempts
    assert summary["first_loss"] == metrics[0]["loss"]  # the run's first loss, not this attempt's


# --- a run folder deleted under a live run -----------------------------------------------------


def _delete_the_live_run_folder(tmp_path: Path, recipe: Path, steps: tuple[str, ...]) -> tuple[Path, str]:
    """Start the run, delete its folder after update step 6, wait for its exit 74: (the folder, stderr)."""
    process = _start(tmp_path, recipe, *steps)
    run_dir = _wait_for_step(tmp_path / "runs" / "tiny", 6, process)
    # Gone at once, as `rm -rf` run between two of the run's checks leaves it. An `rm -rf` racing
    # the live run could also delete the start files it had just put back: a second fault.
    run_dir.rename(tmp_path / "deleted")
    shutil.rmtree(tmp_path / "deleted", ignore_errors=True)
    _out, err = process.communicate(timeout=180)
    assert process.returncode == SAVE_FAILED_EXIT_CODE, err
    return run_dir, err


def test_a_run_folder_deleted_mid_run_stops_it_with_74_puts_it_back_and_resume_auto_finishes(tiny_recipe, tmp_path):
    steps = ("--set", "run.max_steps=400", "--set", "engine.checkpoint_every_steps=5")
    run_dir, err = _delete_the_live_run_folder(tmp_path, tiny_recipe, steps)
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("octfw: error:")]
    assert f"the run folder {run_dir} vanished during the run (recipe.toml, run.json" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["fallback_checkpoint"] == str(run_dir / "fallback" / f"step_{summary['update_steps']:08d}.pt")
    assert (run_dir / "recipe.toml").exists() and (run_dir / "run.json").exists()  # put back: resumable

    resumed = _run(tmp_path, tiny_recipe, *steps, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"continuing from {run_dir / 'fallback'}" in resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["update_steps"] == 400


def test_a_run_folder_deleted_under_a_sharded_job_gets_every_process_slices_in_its_fallback(tiny_recipe, tmp_path):
    """The same under an fsdp job of 2 processes: each writes its own slices of the final state into
    RUN/fallback (no process gathers it), exit 74, and --resume auto continues from that folder."""
    steps = ("--set", "run.max_steps=200", "--set", "engine.checkpoint_every_steps=5",
             "--set", "engine.parallelism=fsdp", "--nproc-per-node", "2")
    run_dir, _err = _delete_the_live_run_folder(tmp_path, tiny_recipe, steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    fallback = run_dir / "fallback" / f"step_{summary['update_steps']:08d}.dcp"
    assert summary["fallback_checkpoint"] == str(fallback)
    assert sorted(p.name for p in fallback.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = _run(tmp_path, tiny_recipe, *steps, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"continuing from {run_dir / 'fallback'}" in resumed.stderr
    assert [m["step"] for m in _metrics(run_dir)][-1] == 200


# --- signals before training --------------------------------------------------------------------


SLOW_FIRST_STEP = '''
import os, time, attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class SlowFirstConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)

def build_model(config, ctx):
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build
    model = build(VJEPA3DConfig(preset="tiny", patch_size=config.patch_size), ctx)
    forward, calls = model.forward, []
    def compiling_forward(batch):  # the first step compiles: a long wait, as XLA's on a pod
        if not calls:
            calls.append(1)
            open(os.environ["COMPILE_MARK"], "w").close()
            time.sleep(30)
        return forward(batch)
    model.forward = compiling_forward
    return model

@hookimpl
def octfw_register_models(register):
    register("slow-first", SlowFirstConfig, build_model, "vjepa3d whose first forward takes 30 s")
'''


@pytest.mark.parametrize("when", ["0.5s", "2s", "compiling"])
def test_sigterm_before_the_first_update_step_exits_75_with_one_line_and_leaves_no_run(tiny_recipe, tmp_path, when):
    (tmp_path / "site").mkdir()
    make_dist(tmp_path / "site", "octfw-slow-first", "plug_slow_first", SLOW_FIRST_STEP)
    mark = tmp_path / "compiling"
    process = _start(tmp_path, tiny_recipe, "--set", "model.name=slow-first",
                     env=_env(tmp_path, COMPILE_MARK=str(mark)))
    if when == "compiling":
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
    else:
        time.sleep(float(when[:-1]))
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED_EXIT_CODE, err
    assert err.strip().splitlines()[-1] == "octfw: stopped by SIGTERM before training began; nothing to save"
    assert "Traceback" not in err
    root = tmp_path / "runs" / "tiny"
    assert not root.exists() or list(root.iterdir()) == []  # nothing --resume auto could take


# --- storage: out of inodes, a save that cannot start ------------------------------------------


INODE_FILLER = '''
import os, attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class InodeFillerConfig:
    at_step: int = 3

class InodeFiller:
    def __init__(self, at_step):
        self.at_step = at_step
    def before_step(self, inputs):
        return None
    def at_log_step(self, update_step, metrics):
        if update_step == self.at_step:  # another job's many small files take every inode
            folder = os.environ["FILL_DIR"]
            os.makedirs(folder, exist_ok=True)
            try:
                for i in range(1_000_000):
                    open(os.path.join(folder, str(i)), "w").close()
            except OSError:
                pass

@hookimpl
def octfw_register_guards(register):
    register("inode-filler", InodeFillerConfig, lambda c, ctx: InodeFiller(c.at_step), "uses up a disk's inodes")
'''


@needs_root
def test_a_checkpoint_disk_out_of_inodes_is_named_so_and_the_final_state_kept(tiny_recipe, tmp_path):
    (tmp_path / "site").mkdir()
    make_dist(tmp_path / "site", "octfw-inodes", "plug_inodes", INODE_FILLER)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=64", "tmpfs", str(disk)], check=True)
    try:
        tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[guard]]\nname = "inode-filler"\n')
        failed = _run(tmp_path, tiny_recipe, "--set", f"checkpointer.dir={disk / 'ckpt'}",
                      "--set", "engine.checkpoint_every_steps=2",
                      env=_env(tmp_path, FILL_DIR=str(disk / "other-job")))
        assert failed.returncode == SAVE_FAILED_EXIT_CODE, failed.stderr
        assert "Traceback" not in failed.stderr
        [line] = [line for line in failed.stderr.splitlines() if line.startswith("octfw: error:")]
        assert f"no free inodes left on device at {disk / 'ckpt'}" in line and "free)" in line
        [run_dir] = list((tmp_path / "runs" / "tiny").iterdir())
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["fallback_checkpoint"] == str(run_dir / "fallback" / "step_00000004.pt")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_save_due_while_the_previous_is_still_written_is_a_warning_and_a_failed_save(caplog):
    from octfw.engine.checkpointing import BackgroundSaver

    class SlowStore:  # a store that is retrying: the first save does not end until released
        def __init__(self):
            self.release = threading.Event()

        def save(self, update_step, state):
            self.release.wait(30)
            return f"store/step_{update_step}.pt"

    store = SlowStore()
    saver = BackgroundSaver(store)
    with caplog.at_level(logging.WARNING, logger="octfw.engine.checkpointing"):
        assert saver.submit(2, lambda: {}) is True
        assert saver.submit(4, lambda: {}) is False
    assert "checkpoint at update step 4 not written: the save of update step 2 was still being written" in caplog.text
    assert saver.failed == ["step 4: not written: the save of update step 2 was still being written "
                            "(a slow store)"] and saver.skipped == [4]
    store.release.set()
    assert saver.wait(10) and saver.latest == "store/step_2.pt"
