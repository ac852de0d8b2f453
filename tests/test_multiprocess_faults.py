"""Many processes, one run, faulted for real: ``octfw run --nproc-per-node N`` (torch's elastic
agent, gloo on the CPU), two launcher agents meeting on 127.0.0.1 as two nodes, and processes
started as srun starts them. Signals are real (to one rank, to the whole process group as Slurm
and Kubernetes send them), processes are killed with SIGKILL and stopped with SIGSTOP, a disk
fills on a real tmpfs. After each fault, ``--resume auto`` must finish the run with the losses
of an uninterrupted one, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import TINY_RECIPE, make_dist
from test_engine import PROBE_PLUGIN
from octfw.cli.exit_codes import (INTERRUPTED_EXIT_CODE, PEER_LOST_EXIT_CODE, PREEMPTED_EXIT_CODE,
                              SAVE_FAILED_EXIT_CODE, STOPPED_BY_GUARD)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STEPS = 14
TIMEOUT_S = 12  # engine.collective_timeout_s of these jobs: a lost process ends the others this soon

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (a real full disk) needs root; "
                                                          "CI runs as root")

# A test plugin: a model whose collapse metric falls on one rank only, and a guard that fills a disk.
FAULT_PLUGIN = '''
import os, attrs, torch
from octfw.hookspecs import hookimpl
from octfw.types import ModelOutput

@attrs.frozen
class CollapsingConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)
    rank: int = 1  # the rank whose features "collapse"

class Collapsing(torch.nn.Module):
    def __init__(self, inner, collapsed):
        super().__init__()
        self.inputs = inner.inputs  # what the wrapped model reads
        self.inner, self.collapsed = inner, collapsed
    def forward(self, batch):
        out = self.inner(batch)
        metrics = dict(out.metrics)
        if self.collapsed:
            metrics["effective_rank"] = torch.ones((), device=out.loss.device)
        return ModelOutput(out.loss, out.per_sample_loss, metrics)
    def ema_update(self, momentum):
        self.inner.ema_update(momentum)
    def param_groups(self, weight_decay):
        return self.inner.param_groups(weight_decay)

def build_model(config, ctx):
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build
    return Collapsing(build(VJEPA3DConfig(preset="tiny", patch_size=config.patch_size), ctx), ctx.rank == config.rank)

@attrs.frozen
class FillerConfig:
    at_step: int = 3

class Filler:
    def __init__(self, at_step, rank):
        self.at_step, self.rank = at_step, rank
    def before_step(self, inputs):
        return None
    def at_log_step(self, update_step, metrics):
        if update_step == self.at_step and self.rank == 0:  # another job's files fill the disk
            with open(os.environ["FILL_PATH"], "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"x" * 65536)
                except OSError:
                    pass

class DeviceReport:
    """Writes which device this rank trains on, and which is current, at every log step."""
    def __init__(self, ctx):
        self.rank, self.run_dir, self.device = ctx.rank, ctx.run_dir, None
    def before_step(self, inputs):
        self.device = inputs.parameters[0].device
        return None
    def at_log_step(self, update_step, metrics):
        current = torch.cuda.current_device() if torch.cuda.is_available() else -1
        with open(self.run_dir / f"device_rank{self.rank}.txt", "w") as f:
            f.write(f"{self.device} {current} {os.environ.get('LOCAL_RANK')}")

@hookimpl
def octfw_register_models(register):
    register("collapsing", CollapsingConfig, build_model, "vjepa3d whose effective rank reads 1 on one rank")

@hookimpl
def octfw_register_guards(register):
    register("filler", FillerConfig, lambda c, ctx: Filler(c.at_step, ctx.rank), "fills a disk at a log step")
    register("device-report", FillerConfig, lambda c, ctx: DeviceReport(ctx), "writes each rank's device")
'''


@pytest.fixture
def job(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY_RECIPE)
    (tmp_path / "site").mkdir()
    make_dist(tmp_path / "site", "octfw-faults", "plug_faults", FAULT_PLUGIN)
    make_dist(tmp_path / "site", "octfw-probe", "plug_probe", PROBE_PLUGIN)  # the checksum guard
    return Job(tmp_path)


class Job:
    """``octfw run tiny.toml --nproc-per-node N`` in its own process group, as a shell starts it."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([str(root / "site"), str(REPO)])}

    def command(self, out: str, *args: str, nproc: int | str | None = 2) -> list[str]:
        launch = [f"--nproc-per-node={nproc}"] if nproc else []
        return [sys.executable, "-m", "octfw.cli", "run", str(self.root / "tiny.toml"), *launch,
                f"--set=run.output_dir={self.root / out}", "--set=engine.per_device_batch=1",
                f"--set=run.max_steps={STEPS}", "--set=engine.checkpoint_every_steps=4",
                f"--set=engine.collective_timeout_s={TIMEOUT_S}", "--set=engine.save_deadline_s=5", *args]

    def start(self, out: str, *args: str, nproc: int | str | None = 2, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.command(out, *args, nproc=nproc), cwd=self.root, env={**self.env, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def run(self, out: str, *args: str, nproc: int | str | None = 2, env: dict | None = None
            ) -> subprocess.CompletedProcess:
        process = self.start(out, *args, nproc=nproc, env=env)
        stdout, stderr = process.communicate(timeout=600)
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def run_dir(self, out: str) -> Path:
        [run_dir] = list((self.root / out / "tiny").iterdir())  # one job, one run folder
        return run_dir

    def wait_for_step(self, out: str, step: int, process: subprocess.Popen, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()
            files = list((self.root / out).glob("tiny/*/metrics.jsonl"))
            if files and len(files[0].read_text().splitlines()) >= step:
                return
            time.sleep(0.05)
        raise AssertionError(f"no update step {step} within {timeout_s} s")

    def rank_pid(self, out: str, rank: int) -> int:
        """The worker of ``rank`` (by its environment, as torch's agent set it)."""
        for pid in subprocess.run(["pgrep", "-f", f"run.output_dir={self.root / out}"], capture_output=True,
                                  text=True).stdout.split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if f"RANK={rank}" in environ and "TORCHELASTIC_RUN_ID" in " ".join(environ) or \
                    f"SLURM_PROCID={rank}" in environ:
                return int(pid)
        raise AssertionError(f"no process of rank {rank}")


def losses(run_dir: Path) -> dict[int, float]:
    """Update step -> loss, the last line of each step (a resumed run logs its steps again)."""
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def job_lines(stderr: str) -> list[str]:
    """The job's status lines (not the progress lines of rank 0's log)."""
    return [line for line in stderr.splitlines() if line.startswith(("octfw: error:", "octfw: stopped", "stopped early"))]


@pytest.fixture
def reference(job):
    """The uninterrupted run of the same job: 2 processes, global batch 2."""
    done = job.run("reference")
    assert done.returncode == 0, done.stderr[-3000:]
    assert job_lines(done.stderr) == []
    return losses(job.run_dir("reference"))


def resume_until_done(job: Job, out: str, reference: dict[int, float], *args: str, nproc: int = 2) -> Path:
    resumed = job.run(out, "--resume", "auto", *args, nproc=nproc)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = job.run_dir(out)
    assert losses(run_dir) == reference  # bit for bit, every update step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == STEPS and not summary["preempted"] and summary["peer_lost"] is None
    return run_dir


def checkpoint_steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt"))


# --- signals ------------------------------------------------------------------------------


def test_sigterm_to_the_whole_process_group_saves_once_exits_75_and_resumes_bitwise(job, reference):
    """Slurm's scancel and Ctrl-C reach every process, the launcher too, which forwards it: the
    repeat is not a second signal, so the final save is written, not cancelled."""
    process = job.start("group")
    job.wait_for_step("group", 5, process)
    os.killpg(process.pid, signal.SIGTERM)
    _out, err = process.communicate(timeout=120)
    assert process.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    [line] = job_lines(err)  # one status line for the job
    assert line.startswith("octfw: stopped by SIGTERM at update step ") and "--resume auto" in line
    assert "Traceback" not in err and "received again" not in err
    run_dir = job.run_dir("group")
    summary = json.loads((run_dir / "summary.json").read_text())
    stop = summary["update_steps"]
    assert summary["preempted"] and not summary["interrupted"]
    assert summary["checkpoint"].endswith(f"step_{stop:08d}.pt")
    assert f"step_{stop:08d}.pt" in checkpoint_steps(run_dir)
    resumed = resume_until_done(job, "group", reference)
    assert len(checkpoint_steps(resumed)) == len(set(checkpoint_steps(resumed)))


def test_sigterm_to_one_of_four_ranks_stops_all_after_the_same_step(job):
    """A spot VM's notice reaching one process of four: every process hears of it at the end of
    the update step, and all stop after that step; rank 0 alone writes the checkpoint."""
    process = job.start("one", '--set=guard=[{name="checksum"}]', "--set=engine.log_every_steps=1", nproc=4)
    job.wait_for_step("one", 3, process)
    os.kill(job.rank_pid("one", 2), signal.SIGTERM)
    _out, err = process.communicate(timeout=180)
    assert process.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    run_dir = job.run_dir("one")
    last = {rank: (run_dir / f"checksum_rank{rank}.txt").read_text().splitlines()[-1] for rank in range(4)}
    assert len(set(last.values())) == 1  # the same step, the same parameters, on every rank
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == int(last[0].split()[0])
    assert "a stop request on another process" in summary["stopped"]


# --- lost processes -----------------------------------------------------------------------


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_lost_rank_ends_the_job_in_bounded_time_naming_it_and_resume_auto_continues_bitwise(
        job, reference, fault):
    out = fault.name.lower()
    process = job.start(out)
    job.wait_for_step(out, 6, process)
    victim = job.rank_pid(out, 1)
    faulted = time.monotonic()
    os.kill(victim, fault)
    try:
        _out, err = process.communicate(timeout=TIMEOUT_S + 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    waited = time.monotonic() - faulted
    assert process.returncode == PEER_LOST_EXIT_CODE, err[-3000:]
    assert waited < TIMEOUT_S + 30  # the collective timeout, the liveness census, the agent's close
    [line] = job_lines(err)
    # A killed process is named by its signal; a stopped one, by the others, as one that stopped answering.
    said = "the process of rank 1 was killed by SIGKILL" if fault == signal.SIGKILL else "rank 1 stopped answering"
    assert said in line, line
    run_dir = job.run_dir(out)
    newest = sorted(checkpoint_steps(run_dir))[-1]
    assert newest in line  # the last good checkpoint, named
    resume_until_done(job, out, reference)


def test_a_rank_ended_by_a_watchdog_while_its_peer_is_silent_names_the_silent_peer(job):
    """What NCCL's watchdog does on a GPU node: the rank that waited in a collective for a silent
    peer is ended with SIGABRT, saying nothing. The job's line names the silent rank (its liveness
    marks stopped), not only the one the watchdog ended; 76."""
    out = "watchdog"
    process = job.start(out, "--set=run.max_steps=100000")
    job.wait_for_step(out, 4, process)
    silent, waiting = job.rank_pid(out, 1), job.rank_pid(out, 0)
    os.kill(silent, signal.SIGSTOP)
    time.sleep(2)  # rank 0 waits in the next collective
    os.kill(waiting, signal.SIGABRT)
    try:
        _out, err = process.communicate(timeout=TIMEOUT_S + 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(silent, signal.SIGKILL)
    assert process.returncode == PEER_LOST_EXIT_CODE, err[-3000:]
    [line] = job_lines(err)
    assert "the process of rank 1 stopped answering (rank 0, waiting for it, was killed by SIGABRT)" in line, line


# --- decisions taken on one rank ----------------------------------------------------------


def test_a_collapse_stop_on_one_rank_stops_every_rank_at_the_same_step(job):
    """The collapse guard reads rank 1's own metrics; it stops the run there, and rank 0 hears it
    at the end of the same update step: no hang, one final save, exit 1 everywhere."""
    result = job.run("collapse", "--set=model.name=collapsing", "--set=engine.log_every_steps=1",
                     '--set=guard=[{name="collapse",action="stop",patience=2,min_effective_rank=1.1,min_rankme=0,max_position_share=1}]')
    assert result.returncode == STOPPED_BY_GUARD, result.stderr[-3000:]
    [line] = job_lines(result.stderr)
    assert line.startswith("stopped early: collapse: metric/effective_rank = 1") and "(on rank 1)" in line
    run_dir = job.run_dir("collapse")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == 2 and summary["checkpoint"].endswith("step_00000002.pt")
    assert checkpoint_steps(run_dir) == ["step_00000002.pt"]
    again = job.run("collapse", "--resume", "auto", "--set=model.name=collapsing", "--set=engine.log_every_steps=1",
                    '--set=guard=[{name="collapse",action="stop",patience=2,min_effective_rank=1.1,min_rankme=0,max_position_share=1}]')
    assert again.returncode == STOPPED_BY_GUARD and "nothing to resume" in again.stderr


@needs_root
def test_a_final_save_that_fails_on_rank_0_exits_74_on_the_whole_job_and_resume_uploads_it(job, reference):
    disk = job.root / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], check=True)
    try:
        env = {"FILL_PATH": str(disk / "other-job.bin")}
        sets = (f"--set=checkpointer.dir={disk / 'ckpt'}", '--set=guard=[{name="nan-skip"},{name="filler",at_step=3}]',
                "--set=engine.log_every_steps=1")
        failed = job.run("full", *sets, env=env)
        assert failed.returncode == SAVE_FAILED_EXIT_CODE, failed.stderr[-3000:]
        [line] = job_lines(failed.stderr)
        assert f"no space left on device at {disk / 'ckpt'}" in line
        run_dir = job.run_dir("full")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["final_save_failed"] and summary["fallback_checkpoint"] == str(
            run_dir / "fallback" / f"step_{STEPS:08d}.pt")
        (disk / "other-job.bin").unlink()
        again = job.run("full", "--resume", "auto", "--allow-recipe-change", f"--set=checkpointer.dir={disk / 'ckpt'}",
                        '--set=guard=[{name="nan-skip"},{name="filler",at_step=0}]', "--set=engine.log_every_steps=1",
                        env=env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert (disk / "ckpt" / f"step_{STEPS:08d}.pt").exists() and not (run_dir / "fallback").exists()
        assert losses(run_dir) == reference
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# --- other launchers ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launcher_agents_meet_on_127_0_0_1_as_two_nodes_and_stop_together(job, reference):
    """Two nodes of one process each: the run is the 2-process run, bit for bit. A SIGTERM to one
    node's process group stops both nodes after the same step, and both resume."""
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes"]
    first, second = (job.start("nodes", *nodes, nproc=1) for _ in range(2))
    job.wait_for_step("nodes", 4, first)
    os.killpg(second.pid, signal.SIGTERM)
    results = [p.communicate(timeout=180) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [PREEMPTED_EXIT_CODE] * 2, [e[-2000:] for _o, e in results]
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = ["--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes-again"]
    again = [job.start("nodes", "--resume", "auto", *nodes, nproc=1) for _ in range(2)]
    for p in again:
        _o, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    assert losses(job.run_dir("nodes")) == reference


def test_processes_started_as_srun_starts_them_train_one_run(job, reference):
    """srun starts each task itself and sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the
    batch script exports MASTER_ADDR and MASTER_PORT (docs/distributed.md). No Slurm here: the
    two tasks are started with exactly that environment."""
    port = str(_free_port())
    tasks = [job.start("srun", nproc=None, env={"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
                                                "SLURM_LOCALID": str(rank), "SLURM_JOB_ID": "1",
                                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for rank in range(2)]
    for task in tasks:
        _o, err = task.communicate(timeout=300)
        assert task.returncode == 0, err[-3000:]
    assert losses(job.run_dir("srun")) == reference


# --- stops in the start and in long steps ----------------------------------------------------


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (its SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def test_a_sigterm_during_the_start_exits_75_and_leaves_no_run_folder(job):
    """octfw run owns SIGTERM from its first instruction (before torch is imported): a stop in the
    start ends it cleanly. Signalled as soon as the handler is there (the start is then importing
    torch), not after a guessed delay that a loaded machine outlasts."""
    process = job.start("early", nproc=None)
    deadline = time.monotonic() + 60
    while not catches(process.pid, signal.SIGTERM):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGTERM)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    assert "stopped by SIGTERM before training began; nothing to save" in err and "Traceback" not in err
    assert not list((job.root / "early").glob("tiny/*/checkpoints/*.pt"))


SLOW_PLUGIN = '''
import os, time, attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class SlowConfig:
    patch_size: tuple[int, int, int] = (4, 16, 16)
    seconds: float = 60.0

def build_model(config, ctx):
    from octfw.plugins.models.vjepa3d import VJEPA3DConfig, build
    model = build(VJEPA3DConfig(preset="tiny", patch_size=config.patch_size), ctx)
    forward = model.forward
    calls = []
    def slow_forward(batch):  # from the second step on, one long CPU step (the first starts training)
        calls.append(1)
        if len(calls) == 1:
            return forward(batch)
        open(os.environ["SLOW_MARK"], "w").close()
        deadline = time.monotonic() + config.seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return forward(batch)
    model.forward = slow_forward
    return model

@hookimpl
def octfw_register_models(register):
    register("slow", SlowConfig, build_model, "vjepa3d whose forward takes a minute")
'''


def ctrl_c_twice_in_the_slow_step(process: subprocess.Popen, mark: Path, kill=os.kill, timeout_s: float = 120
                                  ) -> tuple[float, str, str]:
    """Once the slow model's minute-long step has begun (``mark`` exists), Ctrl-C, then Ctrl-C again
    1.5 s later (more than a forwarded repeat's window); (when the second came, stdout, stderr)."""
    deadline = time.monotonic() + timeout_s
    while not mark.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)
    time.sleep(1)
    kill(process.pid, signal.SIGINT)
    time.sleep(1.5)
    second = time.monotonic()
    kill(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=60)
    return second, out, err


def test_a_second_ctrl_c_stops_within_seconds_in_the_middle_of_a_long_cpu_step(job):
    make_dist(job.root / "site", "octfw-slow", "plug_slow", SLOW_PLUGIN)
    mark = job.root / "in-the-step"
    process = job.start("slow", "--set=model.name=slow", nproc=None, env={"SLOW_MARK": str(mark)})
    second, _out, err = ctrl_c_twice_in_the_slow_step(process, mark)
    assert time.monotonic() - second < 10
    assert process.returncode == INTERRUPTED_EXIT_CODE, err[-3000:]
    assert "received again: stopping now" in err and "Traceback" not in err


def test_a_node_that_never_comes_ends_the_rendezvous_within_the_timeout_counting_who_came(job):
    """A reachable endpoint where the other node never comes: a retryable 76 (the node may be
    late), saying how many nodes came."""
    endpoint = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    alone = job.run("alone", "--nnodes=2", f"--rdzv-endpoint={endpoint}", "--rdzv-id=alone", nproc=1)
    assert time.monotonic() - started < TIMEOUT_S + 30
    assert alone.returncode == PEER_LOST_EXIT_CODE, alone.stderr[-3000:]
    [line] = job_lines(alone.stderr)
    assert line.startswith(f"octfw: error: the job's processes could not start: 1 of 2 nodes met at {endpoint} "
                           f"within engine.collective_timeout_s = {TIMEOUT_S} s")
    assert "Traceback" not in alone.stderr


@contextlib.contextmanager
def _not_a_rendezvous() -> Iterator[int]:
    """A port on 127.0.0.1 where something listens and drops every connection at once."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def drop() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            connection.close()

    threading.Thread(target=drop, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("endpoint, said", [
    ("no-such-host.invalid:29500", "the host 'no-such-host.invalid' does not resolve"),
    ("node0", "expected HOST:PORT"),
    ("node0:http", "expected HOST:PORT"),
    ("127.0.0.1:70000", "expected HOST:PORT"),
    ("127.0.0.1:{dropping}", "no rendezvous answered there within engine.collective_timeout_s"),
], ids=["unresolved", "no-port", "named-port", "port-out-of-range", "refused"])
def test_a_mistyped_rendezvous_endpoint_is_one_line_naming_it_exit_2_within_the_timeout(job, endpoint, said):
    """Never a traceback, an unbounded wait or a 76 that a requeue loop would retry forever."""
    with _not_a_rendezvous() as dropping:
        endpoint = endpoint.format(dropping=dropping)
        started = time.monotonic()
        result = job.run("typo", "--nnodes=2", f"--rdzv-endpoint={endpoint}", nproc=1)
        waited = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("octfw: warning:")]
    assert len(lines) == 1, result.stderr
    [line] = lines
    assert line.startswith(f"octfw: error: --rdzv-endpoint {endpoint}") or \
        line.startswith(f"octfw: error: --rdzv-endpoint {endpoint!r}"), line
    assert said in line, line
    assert waited < TIMEOUT_S + 30
    assert not (job.root / "typo").exists()  # nothing trained, no run folder


def _job_pids(job: Job, out: str) -> list[int]:
    """Every live process of the job started with this output folder (launcher and workers)."""
    found = subprocess.run(["pgrep", "-f", f"run.output_dir={job.root / out}"], capture_output=True, text=True)
    return [pid for pid in map(int, found.stdout.split()) if _alive(pid)]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of process ``pid`` from /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has ended: only its parent's wait is missing


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (a launcher's workers)."""
    pids = [int(path.name) for path in Path("/proc").glob("[0-9]*")]
    return [child for child in pids if (stat := _stat(child)) is not None and stat[1] == pid and stat[0] != "Z"]


def _steps_trained(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_launcher_killed_then_one_quit_take_every_process_of_their_4_process_job_with_them(job):
    """SIGKILL to the launcher (an out-of-memory kill): its workers, in sessions of their own,
    die with it. Resumed, then SIGQUIT to the launcher: a stop like SIGTERM, the state saved at the
    step it stopped. Each time, within 10 s no process of the job is left and the run folder is
    free; ``--resume auto`` finishes the run. The steps trained again after the kill (those
    after its last checkpoint) give the same losses; after the quit, no step is trained twice."""
    from octfw.storage.owner import is_owned

    out, steps = "orphans", 60
    args = (f"--set=run.max_steps={steps}", "--set=engine.checkpoint_every_steps=5")
    process = job.start(out, *args, nproc=4)
    job.wait_for_step(out, 12, process)
    os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _job_pids(job, out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _job_pids(job, out) == []
    process.communicate(timeout=10)
    run_dir = job.run_dir(out)
    assert is_owned(run_dir) is None
    before_kill = losses(run_dir)
    saved = int(checkpoint_steps(run_dir)[-1].removeprefix("step_").removesuffix(".pt"))
    assert saved < max(before_kill)  # steps after the newest checkpoint were lost with the job

    resumed = job.start(out, *args, "--resume", "auto", nproc=4)
    job.wait_for_step(out, max(before_kill) + 10, resumed)
    os.kill(resumed.pid, signal.SIGQUIT)
    _out, err = resumed.communicate(timeout=60)
    assert resumed.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    assert _job_pids(job, out) == [] and is_owned(run_dir) is None
    assert f"resuming at update step {saved} of {steps}" in err and "Traceback" not in err
    before_quit = losses(run_dir)
    retrained = range(saved + 1, max(before_kill) + 1)
    # The same steps again, the same losses. Not bit for bit: at 4 processes a logged loss differs in
    # its last bit at scattered steps after any resume (a SIGTERM's too), the steps after it agreeing
    # again, so the weights did not diverge; at 2 processes resumes are bitwise (tests above).
    assert [before_quit[step] for step in retrained] == pytest.approx([before_kill[step] for step in retrained],
                                                                      rel=1e-6)
    stopped = max(before_quit)
    assert checkpoint_steps(run_dir)[-1] == f"step_{stopped:08d}.pt"  # saved where it stopped

    done = job.run(out, *args, "--resume", "auto", nproc=4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming at update step {stopped} of {steps}" in done.stderr  # nothing after the quit twice
    assert _steps_trained(run_dir) == list(range(1, steps + 1))


def test_a_stop_signal_while_the_nodes_agree_ends_the_wait_and_the_caller_keeps_its_handlers(job):
    """Two nodes; the second is frozen (SIGSTOP to its launcher and worker), so the first's
    worker loses its peer and the first launcher waits for the second's outcome. A Ctrl-C there
    ends the wait at once: 130, one line. The first node hosts the rendezvous's store (it binds
    the endpoint first); where the frozen node hosts it, the wait ends only when the store call
    in progress gives up (docs/distributed.md)."""
    port = _free_port()
    nodes = ["--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=agree", "--set=run.max_steps=100000"]
    first = job.start("agree", *nodes, nproc=1)
    deadline = time.monotonic() + 60
    while not _listening(port):  # the first node holds the store before the second comes
        assert time.monotonic() < deadline and first.poll() is None, "the first node never bound the endpoint"
        time.sleep(0.1)
    second = job.start("agree", *nodes, nproc=1)
    try:
        job.wait_for_step("agree", 4, first)
        for pid in (second.pid, *_children(second.pid)):
            os.kill(pid, signal.SIGSTOP)
        # The first node's worker ends within the collective timeout; its launcher then waits.
        deadline = time.monotonic() + TIMEOUT_S + 60
        while _children(first.pid):
            assert time.monotonic() < deadline, "the first node's worker never ended"
            time.sleep(0.2)
        time.sleep(1.0)
        interrupted = time.monotonic()
        first.send_signal(signal.SIGINT)
        _out, err = first.communicate(timeout=30)
        # One call to a frozen store, then closing the rendezvous: STORE_CALL_S each, at most.
        assert time.monotonic() - interrupted < 15
        assert first.returncode == INTERRUPTED_EXIT_CODE, err[-3000:]
        [line] = job_lines(err)
        assert line.startswith("octfw: stopped while the nodes agreed on how the job ended"), line
        assert "Traceback" not in err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(second.pid, signal.SIGKILL)
        for pid in _job_pids(job, "agree"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        second.communicate(timeout=30)


LAUNCH_TWICE = """
import signal, sys
import octfw
from octfw.engine.launcher import launch_job

def mine(signum, frame):
    pass

recipe_file, out = sys.argv[1], sys.argv[2]
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, mine)
overrides = [f"run.output_dir={out}", "run.max_steps=2", "engine.collective_timeout_s=12", "engine.save_deadline_s=5"]
recipe = octfw.load_recipe(recipe_file, overrides)
for attempt in range(2):
    code = launch_job(["run", recipe_file, *(f"--set={o}" for o in overrides)], recipe, nproc_per_node="1")
    kept = all(signal.getsignal(sig) is mine for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT))
    print(f"attempt {attempt}: exit {code}, handlers kept {kept}")
"""


def test_launch_job_called_twice_from_python_gives_the_caller_back_its_signal_handlers(job):
    script = job.root / "launch_twice.py"
    script.write_text(LAUNCH_TWICE)
    result = subprocess.run([sys.executable, str(script), str(job.root / "tiny.toml"), str(job.root / "twice")],
                            cwd=job.root, env=job.env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["attempt 0: exit 0, handlers kept True",
                                          "attempt 1: exit 0, handlers kept True"], result.stdout


def test_a_user_mistake_is_one_line_for_the_whole_job_exit_2(job):
    """Every process meets it (rank 0 decides what to resume, no process can read it); the
    job says it once."""
    missing = job.root / "no-such-checkpoint.pt"
    refused = job.run("mistake", "--resume", str(missing))
    assert refused.returncode == 2, refused.stderr[-3000:]
    [line] = job_lines(refused.stderr)
    assert str(missing) in line and "cannot be read by every process" in line and "Traceback" not in refused.stderr


def test_plain_torchrun_still_trains_and_a_group_sigterm_still_saves(job):
    """torchrun forwards the SIGTERM its process group already delivered; the workers count it
    once, so the final save is written. torchrun itself exits 1 (its own SignalException)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", *job.command("torchrun", nproc=None)[2:], "--set=run.max_steps=300"]
    process = subprocess.Popen(command, cwd=job.root, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    job.wait_for_step("torchrun", 4, process)
    os.killpg(process.pid, signal.SIGTERM)
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 1  # torchrun's, whatever the workers returned
    summary = json.loads((job.run_dir("torchrun") / "summary.json").read_text())
    assert summary["preempted"] and not summary["interrupted"], err[-3000:]
    assert summary["checkpoint"].endswith(f"step_{summary['update_steps']:08d}.pt")


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="needs a CUDA device (run scripts/accelerator_suite.sh on a GPU machine)")
def test_on_gpus_each_process_trains_on_the_gpu_of_its_local_rank(job):
    """--nproc-per-node auto: one process per visible GPU, each on cuda:LOCAL_RANK, selected before
    the NCCL group exists (with one GPU: the single-GPU path of the launcher)."""
    import torch

    gpus = torch.cuda.device_count()
    done = job.run("gpus", "--set=run.device=cuda", '--set=guard=[{name="nan-skip"},{name="device-report"}]',
                   "--set=run.max_steps=4", "--set=engine.log_every_steps=1", nproc="auto")
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = job.run_dir("gpus")
    for rank in range(gpus):
        device, current, local_rank = (run_dir / f"device_rank{rank}.txt").read_text().split()
        assert device == f"cuda:{local_rank}" and current == local_rank
    assert sorted((run_dir / f"device_rank{r}.txt").read_text().split()[0] for r in range(gpus)) == \
        sorted(f"cuda:{r}" for r in range(gpus))


def test_two_plain_torchrun_nodes_meeting_on_127_0_0_1_train_the_same_run(job, reference):
    """Multi-node torchrun keeps working: two agents, one process each, c10d rendezvous."""
    endpoint = f"127.0.0.1:{_free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=torchrun-nodes",
               "-m", *job.command("torchrun-nodes", nproc=None)[2:]]
    nodes = [subprocess.Popen(command, cwd=job.root, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(2)]
    for node in nodes:
        _out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    assert losses(job.run_dir("torchrun-nodes")) == reference
