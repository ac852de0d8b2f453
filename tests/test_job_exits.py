"""Every exit of a 4-process job means what it says, and the console shows one line for it.

Each test starts ``octfw run --nproc-per-node 4`` for real (gloo on the CPU), ends it one way
(a crash on one rank, a refusal, a SIGKILLed rank, a SIGTERM to the whole process group, a
final save on a full disk) and reads what an operator and a requeue loop read: the exit code,
the job's status lines (exactly one) and the tracebacks (none, or the crashing rank's alone).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import make_dist
from test_multiprocess_faults import (SLOW_PLUGIN, Job, checkpoint_steps, ctrl_c_twice_in_the_slow_step,  # noqa: F401
                                     job)
from octfw.engine.launcher import STOP_NOW_GRACE_S
from octfw.cli.exit_codes import (CRASHED, INTERRUPTED_EXIT_CODE, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE, RETRY_CODES,
                              SAVE_FAILED_EXIT_CODE, USER_ERROR)

pytestmark = pytest.mark.slow

NPROC = 4
STEPS = 14

# Guards that misbehave on one rank: a bug at a step, a refusal while the run is built.
MISBEHAVING_PLUGIN = '''
import attrs
from octfw.display.errors import UserError
from octfw.hookspecs import hookimpl

@attrs.frozen
class OnRankConfig:
    rank: int = 1
    at_step: int = 5

class Crasher:
    def __init__(self, config, rank):
        self.config, self.rank = config, rank
    def before_step(self, inputs):
        if self.rank == self.config.rank and inputs.update_step == self.config.at_step:
            raise RuntimeError(f"a plugin bug on rank {self.rank}")
        return None
    def at_log_step(self, update_step, metrics):
        pass

def build_refuser(config, ctx):
    if ctx.rank == config.rank:
        raise UserError(f"guard.refuser: rank {ctx.rank} cannot take this run")
    return Crasher(attrs.evolve(config, at_step=-1), ctx.rank)

@attrs.frozen
class CountingConfig:
    every_steps: int | None = 2

class Counting:
    """Writes a line per call into RUN/evaluated_rank<R>.txt: which ranks evaluated, how often."""
    def __init__(self, config, ctx):
        self.every_steps, self.path = config.every_steps, ctx.run_dir / f"evaluated_rank{ctx.rank}.txt"
    def evaluate(self, model, device, update_step):
        with open(self.path, "a") as f:
            f.write(f"{update_step}\\n")
        return {"calls": 1.0}

@hookimpl
def octfw_register_guards(register):
    register("crasher", OnRankConfig, lambda c, ctx: Crasher(c, ctx.rank), "raises at a step on one rank")
    register("refuser", OnRankConfig, build_refuser, "refuses the run on one rank")

@hookimpl
def octfw_register_evaluators(register):
    register("counting", CountingConfig, Counting, "counts the calls on each rank")
'''


def status_lines(stderr: str) -> list[str]:
    """What the job printed to say how it ended (not rank 0's progress lines)."""
    return [line for line in stderr.splitlines()
            if line.startswith(("octfw: error:", "octfw: stopped", "stopped early", "octfw: nothing"))]


def tracebacks(output: str) -> int:
    return output.count("Traceback (most recent call last)")


#: What a process prints when it ends badly on its way out: a C++ abort, an interpreter that failed
#: at exit, a Python warning of its own shutdown. None of it belongs on a job's console, whatever
#: the job's outcome.
SHUTDOWN_NOISE = ("terminate called", "Aborted", "core dumped", "Fatal Python error", "Exception ignored",
                  "Warning:", "what():", "leaked semaphore", "destroy_process_group")


def shutdown_noise(output: str) -> list[str]:
    return [line for line in output.splitlines() if any(noise in line for noise in SHUTDOWN_NOISE)]


@pytest.fixture
def misbehaving(job):
    make_dist(job.root / "site", "octfw-misbehaving", "plug_misbehaving", MISBEHAVING_PLUGIN)
    return job


def run4(job: Job, out: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    result = job.run(out, *args, f"--set=run.max_steps={STEPS}", nproc=NPROC, env=env)
    assert shutdown_noise(result.stdout + result.stderr) == [], result.stderr[-3000:]
    return result


def test_a_crash_on_one_rank_exits_1_naming_the_rank_with_its_traceback_alone(misbehaving):
    """A plugin's exception on rank 1 is a bug, not a lost process: the job exits 1 (never 76,
    which a requeue loop would retry forever), one line names rank 1 and the error, and the
    only traceback is rank 1's."""
    result = run4(misbehaving, "crash", '--set=guard=[{name="crasher",rank=1,at_step=5}]')
    assert result.returncode == CRASHED and CRASHED not in RETRY_CODES, result.stderr[-3000:]
    [line] = status_lines(result.stderr)
    assert "rank 1 crashed: RuntimeError: a plugin bug on rank 1" in line, line
    assert f"--nproc-per-node={NPROC}" in line  # the hint runs the job as it was launched
    output = result.stdout + result.stderr
    assert tracebacks(output) == 1 and "a plugin bug on rank 1" in output.split("Traceback", 1)[1]
    assert "stopped answering" not in output  # the other ranks' view stays off the console


def test_a_refusal_on_one_rank_is_the_jobs_refusal_exit_2_one_line(misbehaving):
    result = run4(misbehaving, "refusal", '--set=guard=[{name="refuser",rank=2}]')
    assert result.returncode == USER_ERROR, result.stderr[-3000:]
    [line] = status_lines(result.stderr)
    assert line == "octfw: error: guard.refuser: rank 2 cannot take this run", line
    assert tracebacks(result.stdout + result.stderr) == 0 and "stopped answering" not in result.stderr


def test_a_checkpoint_folder_held_by_another_process_refuses_the_job_exit_2(job):
    """checkpointer.claim runs on rank 0; every rank hears its refusal (no rank waits for a peer
    that left, no 76)."""
    from octfw.storage.owner import FolderOwner

    held = job.root / "held-checkpoints"
    held.mkdir()
    owner = FolderOwner(str(held), "checkpoint folder")
    owner.acquire()  # this test's process: alive, so the folder is in use
    try:
        result = run4(job, "held", f"--set=checkpointer.dir={held}")
    finally:
        owner.release()
    assert result.returncode == USER_ERROR, result.stderr[-3000:]
    [line] = status_lines(result.stderr)
    assert "in use" in line and str(held) in line, line
    assert tracebacks(result.stdout + result.stderr) == 0


def test_a_sigkilled_rank_exits_76_named_as_killed_by_sigkill(job):
    process = job.start("killed", f"--set=run.max_steps={STEPS}", "--set=engine.log_every_steps=1", nproc=NPROC)
    job.wait_for_step("killed", 3, process)
    os.kill(job.rank_pid("killed", 2), signal.SIGKILL)
    out, err = process.communicate(timeout=180)
    assert process.returncode == PEER_LOST_EXIT_CODE and PEER_LOST_EXIT_CODE in RETRY_CODES, err[-3000:]
    [line] = status_lines(err)
    assert "the process of rank 2 was killed by SIGKILL" in line and f"--nproc-per-node={NPROC}" in line, line
    assert tracebacks(out + err) == 0 and shutdown_noise(out + err) == []


def test_a_sigterm_to_the_whole_group_exits_75_one_line_with_the_launch_in_its_hint(job):
    process = job.start("term", f"--set=run.max_steps={STEPS * 20}", "--set=engine.log_every_steps=1", nproc=NPROC)
    job.wait_for_step("term", 3, process)
    os.killpg(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=180)
    assert process.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    [line] = status_lines(err)
    assert line.startswith("octfw: stopped by SIGTERM") and f"--nproc-per-node={NPROC}" in line, line
    assert line.endswith("--resume auto") and tracebacks(out + err) == 0 and shutdown_noise(out + err) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full disk) needs root; CI runs as root")
def test_a_final_save_on_a_full_disk_exits_74_with_one_line_and_no_rank_traceback(job):
    disk = job.root / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], check=True)
    try:
        result = run4(job, "full", f"--set=checkpointer.dir={disk / 'ckpt'}", "--set=engine.log_every_steps=1",
                      '--set=guard=[{name="nan-skip"},{name="filler",at_step=3}]',
                      env={"FILL_PATH": str(disk / "other-job.bin")})
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert result.returncode == SAVE_FAILED_EXIT_CODE, result.stderr[-3000:]
    [line] = status_lines(result.stderr)
    assert "the final checkpoint could not be written" in line and f"--nproc-per-node={NPROC}" in line, line
    assert tracebacks(result.stdout + result.stderr) == 0
    summary = json.loads((job.run_dir("full") / "summary.json").read_text())
    assert summary["final_save_failed"] and summary["failed_saves"]


def test_a_resume_on_another_number_of_processes_is_refused_naming_both(job):
    first = job.run("resize", nproc=None)  # one process: global batch 1
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = job.run_dir("resize")
    newest = sorted(checkpoint_steps(run_dir))[-1]
    again = job.run("resize", "--resume", str(run_dir / "checkpoints" / newest), nproc=NPROC)
    assert again.returncode == USER_ERROR, again.stderr[-3000:]
    [line] = status_lines(again.stderr)
    assert "trained on 1 device (global batch 1)" in line and "this run has 4 devices (global batch 4)" in line
    assert "--nproc-per-node" in line and "engine.global_batch = 1" in line


def test_a_second_ctrl_c_ends_every_rank_at_once_exit_130_keeping_the_last_checkpoint(job):
    """Two Ctrl-C to the whole process group inside a minute-long step: every rank stops where it
    is, the launcher kills what is left after a short grace, and the job says one line, exit 130;
    the checkpoint of the last complete step stays the newest."""
    # The slow model of test_multiprocess_faults, slow from its fourth forward on: steps saved first.
    make_dist(job.root / "site", "octfw-slow", "plug_slow", SLOW_PLUGIN.replace("len(calls) == 1", "len(calls) <= 3"))
    mark = job.root / "in-the-step"
    process = job.start("twice", "--set=model.name=slow", "--set=engine.checkpoint_every_steps=1", nproc=2,
                        env={"SLOW_MARK": str(mark)})
    second, out, err = ctrl_c_twice_in_the_slow_step(process, mark, kill=os.killpg, timeout_s=180)  # to the group
    assert time.monotonic() - second < 10 + STOP_NOW_GRACE_S
    assert process.returncode == INTERRUPTED_EXIT_CODE, err[-3000:]
    [line] = status_lines(err)
    assert "--nproc-per-node=2" in line, line
    assert tracebacks(out + err) == 0 and shutdown_noise(out + err) == []
    run_dir = job.run_dir("twice")
    saved = checkpoint_steps(run_dir)  # every complete step's, the newest named in the line
    assert saved and saved[-1] in line, (line, saved)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # nothing half-written


def test_records_are_the_jobs_every_ranks_quarantined_files_listed_and_evaluators_run_once(misbehaving):
    """Corrupt files met by any of the 4 ranks reach rank 0's quarantine.jsonl and the summary's
    count; an evaluator runs on rank 0 alone, at each of its steps."""
    from octfw.plugins.datasets.synthetic.corruption import corrupt_count

    volumes, fraction = 16, 0.25
    result = run4(misbehaving, "records", f"--set=dataset.n_volumes={volumes}",
                  f"--set=dataset.corrupt_fraction={fraction}", '--set=evaluator=[{name="counting",every_steps=4}]')
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = misbehaving.run_dir("records")
    listed = [json.loads(line)["url"] for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    corrupt = corrupt_count(volumes, fraction)
    assert len(listed) == len(set(listed)) == corrupt  # every corrupt file, met on whichever rank, once
    assert json.loads((run_dir / "summary.json").read_text())["quarantined"] == corrupt
    assert sorted(p.name for p in run_dir.glob("evaluated_rank*.txt")) == ["evaluated_rank0.txt"]
    assert (run_dir / "evaluated_rank0.txt").read_text().split() == ["4", "8", "12", str(STEPS)]


def test_two_nodes_exit_alike_when_a_rank_of_one_crashes(misbehaving):
    """Two launchers meeting on 127.0.0.1 as two nodes of 2 processes each; rank 3 (on the second
    node) raises: both nodes exit 1 with the same line, though the first node only lost a peer."""
    from test_multiprocess_faults import _free_port

    nodes = ["--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=crash-nodes"]
    launched = [misbehaving.start("nodes", *nodes, f"--set=run.max_steps={STEPS}",
                                  '--set=guard=[{name="crasher",rank=3,at_step=4}]', nproc=2) for _ in range(2)]
    results = [process.communicate(timeout=300) for process in launched]
    codes = [process.returncode for process in launched]
    assert codes == [CRASHED, CRASHED], [err[-2000:] for _out, err in results]
    lines = [status_lines(err) for _out, err in results]
    assert lines[0] == lines[1] and len(lines[0]) == 1 and "rank 3 crashed: RuntimeError" in lines[0][0], lines
    assert sum(tracebacks(out + err) for out, err in results) == 1
    assert [noise for out, err in results for noise in shutdown_noise(out + err)] == []


def test_resuming_a_finished_job_says_so_on_every_try_with_no_abort_at_exit(job):
    """``--resume auto`` of a finished 4-process run: "nothing to resume", exit 0, and no process
    ends in ``std::terminate`` on its way out (it did about one time in five, the process group
    left to the interpreter's exit)."""
    assert run4(job, "finished").returncode == 0
    for _ in range(2):
        again = run4(job, "finished", "--resume", "auto")  # run4: no shutdown noise on the console
        assert again.returncode == 0, again.stderr[-3000:]
        [line] = status_lines(again.stderr)
        assert line.startswith("octfw: nothing to resume:") and "already finished" in line, line
