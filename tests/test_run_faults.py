"""Faults a training run meets in operation, made for real: two trainers on one run folder,
a failed start between a preemption and its resume, a full or read-only disk (real tmpfs
mounts, as root), flipped bytes in a checkpoint, and a second Ctrl-C during the final save.

Each run is an ``octfw run`` subprocess on the CPU, as an operator would start it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from octfw.engine.preemption import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from octfw.engine.trainer import SAVE_FAILED_EXIT_CODE

from conftest import make_dist
from test_crash_safety import BALLAST_PLUGIN

pytestmark = pytest.mark.slow

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full or read-only "
                                                          "disk) needs root; CI runs as root")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PJRT_DEVICE": "CPU", **extra}


def _start(tmp_path: Path, recipe: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "octfw.cli", "run", str(recipe), *args], cwd=tmp_path,
                            env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(tmp_path: Path, recipe: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    process = _start(tmp_path, recipe, *args, env=env)
    out, err = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _runs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir()) if root.exists() else []


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _wait_for_step(root: Path, step: int, process: subprocess.Popen, timeout_s: float = 300) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        for metrics in root.glob("*/metrics.jsonl"):
            if len(metrics.read_text().splitlines()) >= step:
                return metrics.parent
        time.sleep(0.05)
    raise AssertionError(f"no update step {step} within {timeout_s} s")


def _one_line_error(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("octfw: error:")]
    assert len(errors) == 1, err
    return errors[0]


@contextlib.contextmanager
def _tmpfs(folder: Path, size: str, *options: str):
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(folder)],
                   check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


# --- one writer per run folder ------------------------------------------------------


def test_a_second_trainer_is_refused_while_a_run_is_live_and_takes_over_once_its_owner_is_killed(
        tiny_recipe, tmp_path):
    root = tmp_path / "runs" / "tiny"
    long = ("--set", "run.max_steps=100000", "--set", "engine.checkpoint_every_steps=2")
    first = _start(tmp_path, tiny_recipe, *long)
    try:
        run_dir = _wait_for_step(root, 3, first)
        owner = json.loads((run_dir / "owner.lock").read_text())
        assert owner["pid"] == first.pid

        # A retry loop, a second terminal, a scheduler that thinks the job died: refused, naming the owner.
        second = _run(tmp_path, tiny_recipe, *long, "--resume", "auto")
        assert second.returncode == 2
        line = _one_line_error(second.stderr)
        assert f"pid {first.pid}" in line and str(run_dir) in line
        assert _runs(root) == [run_dir]
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    logged = len(_metrics(run_dir))

    # The owner is gone (kill -9 leaves its owner record behind): the next start takes the run over.
    third = _start(tmp_path, tiny_recipe, *long, "--resume", "auto")
    try:
        _wait_for_step(root, logged + 2, third)
    finally:
        third.send_signal(signal.SIGTERM)
        _out, err = third.communicate(timeout=300)
    assert third.returncode == PREEMPTED_EXIT_CODE, err
    assert f"taking over run folder {run_dir} from pid {first.pid}" in err
    assert _runs(root) == [run_dir] and (run_dir / "owner.lock").read_text() == ""  # released


# --- --resume auto never goes backwards ------------------------------------------------


def test_preempt_then_a_failed_start_then_resume_auto_continues_the_preempted_run_bitwise(tiny_recipe, tmp_path):
    steps = ("--set", "run.max_steps=30", "--set", "engine.checkpoint_every_steps=5")
    reference = _run(tmp_path, tiny_recipe, *steps, "--set", f"run.output_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr
    [reference_dir] = _runs(tmp_path / "reference" / "tiny")

    root = tmp_path / "runs" / "tiny"
    process = _start(tmp_path, tiny_recipe, *steps)
    run_dir = _wait_for_step(root, 11, process)
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=300)
    assert process.returncode == PREEMPTED_EXIT_CODE, err

    # A start that fails (a mistyped --resume path) leaves no folder behind.
    failed = _run(tmp_path, tiny_recipe, *steps, "--resume", str(tmp_path / "nonexistent.pt"))
    assert failed.returncode == 2 and "nonexistent.pt" in _one_line_error(failed.stderr)
    assert _runs(root) == [run_dir]
    # A folder an older octfw left after a failed start, newer than the run: skipped, not continued.
    leftover = root / "29991231-235959"
    leftover.mkdir()
    (leftover / "recipe.toml").write_text((run_dir / "recipe.toml").read_text())
    (leftover / "run.json").write_text('{"id": "leftover", "sequence": 99}')  # recorded as started later

    resumed = _run(tmp_path, tiny_recipe, *steps, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping {leftover}" in resumed.stderr and f"continuing {run_dir}" in resumed.stderr
    assert [m["loss"] for m in _metrics(run_dir)] == [m["loss"] for m in _metrics(reference_dir)]
    assert [m["grad_norm"] for m in _metrics(run_dir)] == [m["grad_norm"] for m in _metrics(reference_dir)]


# --- checkpoint integrity -----------------------------------------------------------------


def _flip(path: Path, offset: int, count: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(b ^ 0xFF for b in data[offset:offset + count])
    path.write_bytes(bytes(data))


def test_a_checkpoint_with_flipped_bytes_is_never_loaded(tiny_recipe, tmp_path):
    steps = ("--set", "run.max_steps=4", "--set", "engine.checkpoint_every_steps=2")
    assert _run(tmp_path, tiny_recipe, *steps).returncode == 0
    [run_dir] = _runs(tmp_path / "runs" / "tiny")
    newest = run_dir / "checkpoints" / "step_00000004.pt"
    size = newest.stat().st_size
    _flip(newest, size // 2)  # the same size: a size check alone would pass it
    assert newest.stat().st_size == size

    def octfw(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "octfw.cli", *args], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=600)

    encoder = tmp_path / "encoder.pt"
    for refused in (octfw("run", str(tiny_recipe), *steps, "--resume", str(newest)),
                    octfw("export", str(newest), "--out", str(encoder))):
        assert refused.returncode == 2, refused.stderr
        line = _one_line_error(refused.stderr)
        assert f"{newest} is damaged" in line and "weights_only" not in refused.stderr
    assert not encoder.exists()
    # A run folder exports its newest good checkpoint, saying which one it skipped.
    exported = octfw("export", str(run_dir), "--out", str(encoder))
    assert exported.returncode == 0, exported.stderr
    assert f"checkpoint {newest} is damaged" in exported.stderr and encoder.exists()

    # --resume auto falls back to the previous good checkpoint, with a warning naming the bad one.
    longer = _run(tmp_path, tiny_recipe, "--set", "run.max_steps=6", "--set", "engine.checkpoint_every_steps=2",
                  "--resume", "auto", "--allow-recipe-change")
    assert longer.returncode == 0, longer.stderr
    assert f"checkpoint {newest} is damaged" in longer.stderr
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2, 3, 4, 5, 6]  # from step 2, not 4: one line a step


# --- a full disk, a read-only folder ------------------------------------------------------


@needs_root
def test_a_checkpoint_folder_without_room_or_write_access_is_refused_before_training(tiny_recipe, tmp_path):
    with _tmpfs(tmp_path / "small", "64k") as small:
        refused = _run(tmp_path, tiny_recipe, "--set", f"checkpointer.dir={small}")
        assert refused.returncode == 2
        line = _one_line_error(refused.stderr)
        assert f"no space left on device at {small}" in line and "a checkpoint needs" in line and "free" in line
    with _tmpfs(tmp_path / "readonly", "1m", "ro") as readonly:
        refused = _run(tmp_path, tiny_recipe, "--set", f"checkpointer.dir={readonly}")
        assert refused.returncode == 2
        assert f"read-only file system at {readonly}" in _one_line_error(refused.stderr)
    assert _runs(tmp_path / "runs" / "tiny") == []  # nothing trained, no folder left for --resume auto


@needs_root
def test_a_disk_that_fills_up_mid_run_fails_the_run_keeps_the_final_state_and_resume_uploads_it(
        tiny_recipe, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "octfw-filler", "plug_filler", '''
import os, attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class FillerConfig:
    at_step: int = 3

class Filler:
    def __init__(self, at_step):
        self.at_step = at_step
    def before_step(self, inputs):
        return None
    def at_log_step(self, update_step, metrics):
        if update_step == self.at_step:  # the disk fills up: another job's files
            with open(os.environ["FILL_PATH"], "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 65536)
                except OSError:  # full
                    pass

@hookimpl
def octfw_register_guards(register):
    register("filler", FillerConfig, lambda c, ctx: Filler(c.at_step), "fills a disk at a log step")
''')
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[guard]]\nname = "filler"\n')
    with _tmpfs(tmp_path / "disk", "48m") as disk:
        env = _env(FILL_PATH=str(disk / "other-job.bin"),
                   PYTHONPATH=os.pathsep.join([str(site), str(Path(__file__).parent)]))
        sets = ("--set", f"checkpointer.dir={disk / 'ckpt'}", "--set", "engine.checkpoint_every_steps=2")
        failed = _run(tmp_path, tiny_recipe, *sets, env=env)
        assert failed.returncode == SAVE_FAILED_EXIT_CODE, failed.stderr
        line = _one_line_error(failed.stderr)
        assert f"no space left on device at {disk / 'ckpt'}" in line and "enforce fail" not in failed.stderr
        [run_dir] = _runs(tmp_path / "runs" / "tiny")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["final_save_failed"] and summary["update_steps"] == 4
        assert summary["fallback_checkpoint"] == str(run_dir / "fallback" / "step_00000004.pt")
        assert not list((disk / "ckpt").glob("*.tmp"))  # the failed write left nothing half-written

        # The other job's files go; --resume auto treats the run as unfinished and uploads the state.
        (disk / "other-job.bin").unlink()
        tiny_recipe.write_text(tiny_recipe.read_text().replace('name = "filler"', 'name = "filler"\nat_step = 0'))
        resumed = _run(tmp_path, tiny_recipe, *sets, "--resume", "auto", "--allow-recipe-change", env=env)
        assert resumed.returncode == 0, resumed.stderr
        assert (disk / "ckpt" / "step_00000004.pt").exists() and not (run_dir / "fallback").exists()
        assert json.loads((run_dir / "summary.json").read_text())["final_save_failed"] is False


# --- Ctrl-C twice ---------------------------------------------------------------------------


def test_a_second_ctrl_c_during_the_final_save_stops_at_once_and_keeps_the_last_complete_checkpoint(
        tiny_recipe, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    make_dist(site, "octfw-ballast", "plug_ballast", BALLAST_PLUGIN)
    env = _env(PYTHONPATH=os.pathsep.join([str(site), str(Path(__file__).parent)]))
    # A large state: the final save takes long enough for a second Ctrl-C to land in it.
    tiny_recipe.write_text(tiny_recipe.read_text() + '\n[[guard]]\nname = "ballast"\nmegabytes = 400\n')
    process = _start(tmp_path, tiny_recipe, "--set", "run.max_steps=1000", "--set", "engine.checkpoint_every_steps=1000",
                     env=env)
    root = tmp_path / "runs" / "tiny"
    run_dir = _wait_for_step(root, 2, process)
    process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob("*.tmp")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the final save never began"
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)  # in the middle of writing the final checkpoint
    _out, err = process.communicate(timeout=120)
    assert process.returncode == INTERRUPTED_EXIT_CODE, err
    assert "terminate called" not in err and "Traceback" not in err
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert not list((run_dir / "checkpoints").glob("step_*.pt"))  # none complete: none claimed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["preempted"] and summary["checkpoint"] is None
    # Every line about the save is true: it was cancelled while stopping, not "failed, training goes on".
    assert "training goes on" not in err and "was not written: stopped at once by a second signal" in err
    assert err.strip().splitlines()[-1].startswith("octfw: stopped by SIGINT") and "(none written)" in err


def test_no_load_error_ever_suggests_weights_only_false(tmp_path):
    """torch's advice to retry with weights_only=False would run whatever code the file holds."""
    import datetime

    import torch

    from octfw.exports.pretrained import load_encoder
    from octfw.display.errors import UserError
    from octfw.storage.checkpoints import load_checkpoint

    with_object = tmp_path / "step_00000001.pt"
    torch.save({"model": datetime.date(2026, 11, 25)}, with_object)  # a class weights_only refuses
    junk = tmp_path / "encoder.pt"
    junk.write_bytes(b"x" * 100)
    for load, path in ((load_checkpoint, with_object), (load_checkpoint, junk), (load_encoder, junk)):
        with pytest.raises(UserError) as refused:
            load(str(path))
        message = str(refused.value)
        assert str(path) in message and "weights_only" not in message and "\n" not in message


def test_octfw_eval_refuses_a_damaged_checkpoint_file(tiny_recipe, tmp_path, registry):
    from octfw.evaluation.target import load_target
    from octfw.storage.checkpoint_reading import CorruptCheckpoint

    assert _run(tmp_path, tiny_recipe, "--set", "run.max_steps=2").returncode == 0
    [run_dir] = _runs(tmp_path / "runs" / "tiny")
    checkpoint = run_dir / "checkpoints" / "step_00000002.pt"
    _flip(checkpoint, checkpoint.stat().st_size // 2)
    with pytest.raises(CorruptCheckpoint, match=f"{checkpoint} is damaged"):
        load_target(str(checkpoint), seed=0, registry=registry)
