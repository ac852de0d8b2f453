"""Scale-out in real processes: DDP under torchrun (gloo, 2 CPU processes) and
XLA SPMD over 4 virtual CPU devices, each against a single-device run of the
same global batch."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from conftest import TINY_RECIPE, make_dist
from test_engine import PROBE_PLUGIN
from test_xla_engine import FAST_COMPILE

REPO = Path(__file__).resolve().parents[1]
# Different reduction order (two batch-1 gradients averaged vs one batch-2
# gradient) changes the last float bits only; AdamW's first updates amplify
# them (SPMD vs one device: 0 at update 1, 1e-6 at 2, 1e-5 at 3).
LOSS_TOLERANCE = 5e-5


def launch(tmp_path: Path, args: list[str], nproc: int = 1, env: dict | None = None) -> Path:
    out_dir = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    command = [sys.executable, "-m", "octfw.cli", "run", str(tmp_path / "tiny.toml"),
               "--set", f"run.output_dir={out_dir}", *args]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", "-m", *command[2:]]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]), **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=full_env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((out_dir / "tiny").iterdir())
    assert len(runs) == 1, runs  # one job, one run directory, whatever the process count
    return runs[0]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def setup(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY_RECIPE)
    (tmp_path / "site").mkdir()
    make_dist(tmp_path / "site", "octfw-probe", "plug_probe", PROBE_PLUGIN)


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    setup(tmp_path)
    ddp = launch(tmp_path, ["--set", "engine.per_device_batch=1", "--set", "engine.grad_accum_steps=2"], nproc=2)
    single = launch(tmp_path, ["--set", "engine.per_device_batch=2", "--set", "engine.grad_accum_steps=2"])
    assert len(losses(ddp)) == len(losses(single)) == 4  # rank 0 alone logged
    for a, b in zip(losses(ddp), losses(single)):
        assert abs(a - b) <= LOSS_TOLERANCE * abs(b)
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["update_steps"] == 4 and summary["samples_per_s"] > 0


def test_ddp_ranks_take_the_same_skip_decision(tmp_path):
    """A NaN on rank 1 only: both ranks skip that update and stay identical."""
    setup(tmp_path)
    run_dir = launch(tmp_path, [
        "--set", "engine.per_device_batch=1", "--set", "model.name=poisoned", "--set", "model.nan_at=[2]",
        "--set", "model.rank_only=1", "--set", 'guard=[{name="nan-skip"},{name="checksum"}]'], nproc=2)
    assert json.loads((run_dir / "summary.json").read_text())["skipped_updates"] == 1
    rank0 = (run_dir / "checksum_rank0.txt").read_text().splitlines()
    rank1 = (run_dir / "checksum_rank1.txt").read_text().splitlines()
    assert rank0 == rank1 and len(rank0) == 4


def test_spmd_on_four_cpu_devices_matches_one_device(tmp_path):
    setup(tmp_path)
    common = ["--set", "run.device=xla", "--set", "model.depth=1", "--set", "model.predictor_depth=1",
              "--set", "run.max_steps=3"]
    spmd = launch(tmp_path, [*common, "--set", "engine.per_device_batch=1"],
                  env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLA_FLAGS": FAST_COMPILE})
    single = launch(tmp_path, [*common, "--set", "engine.per_device_batch=4"],
                    env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "XLA_FLAGS": FAST_COMPILE})
    assert len(losses(spmd)) == 3
    for a, b in zip(losses(spmd), losses(single)):
        assert abs(a - b) <= LOSS_TOLERANCE * abs(b)
    line = json.loads((spmd / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["samples_per_s"] == 4 * line["samples_per_s_per_device"]
    # Per-domain losses of update 1 (before any update: only the sum order differs).
    first = [json.loads((d / "metrics.jsonl").read_text().splitlines()[0]) for d in (spmd, single)]
    per_domain = [{k: v for k, v in m.items() if k.startswith("loss/")} for m in first]
    assert per_domain[0].keys() == per_domain[1].keys() and per_domain[0]
    for key, value in per_domain[1].items():
        assert abs(per_domain[0][key] - value) <= 1e-6 * abs(value)


def test_spmd_skips_a_non_finite_update_on_the_device(tmp_path):
    """A NaN gradient at update 2 under SPMD on two CPU devices: nan-skip's
    verdict stays on the device and goes into GatedAdamW's update, so the
    parameters after update 2 equal those after update 1, and training goes on."""
    setup(tmp_path)
    run_dir = launch(tmp_path, [
        "--set", "run.device=xla", "--set", "engine.per_device_batch=1", "--set", "model.name=poisoned", "--set", "model.nan_at=[2]",
        "--set", "model.where=grad", "--set", 'guard=[{name="nan-skip"},{name="checksum"}]'],
        env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "XLA_FLAGS": FAST_COMPILE})
    assert json.loads((run_dir / "summary.json").read_text())["skipped_updates"] == 1
    checksums = [line.split() for line in (run_dir / "checksum_rank0.txt").read_text().splitlines()]
    assert [int(step) for step, _ in checksums] == [1, 2, 3, 4]
    totals = [float(total) for _, total in checksums]
    assert all(math.isfinite(t) for t in totals)
    assert totals[1] == totals[0] and totals[2] != totals[1] and totals[3] != totals[2]


def test_ddp_a_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """A spot VM's SIGTERM reaching one process only: both ranks stop after the same
    update step, rank 0 alone writes the checkpoint and the summary."""
    import signal
    import time

    setup(tmp_path)
    out_dir = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "octfw.cli", "run", str(tmp_path / "tiny.toml"), "--set", f"run.output_dir={out_dir}",
               "--set", "engine.per_device_batch=1", "--set", "run.max_steps=200",
               "--set", 'guard=[{name="nan-skip"},{name="checksum"}]']
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    torchrun = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(out_dir.glob("tiny/*/checksum_rank1.txt")) or \
            len(next(out_dir.glob("tiny/*/checksum_rank1.txt")).read_text().splitlines()) < 3:
        assert torchrun.poll() is None, torchrun.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "rank 1 logged no 3 update steps within 300 s"
        time.sleep(0.05)
    candidates = subprocess.run(["pgrep", "-f", f"octfw.cli run {tmp_path / 'tiny.toml'}"],
                                capture_output=True, text=True).stdout.split()
    rank1 = [int(pid) for pid in candidates
             if "RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")]
    assert len(rank1) == 1, (candidates, rank1)
    os.kill(rank1[0], signal.SIGTERM)
    _out, err = torchrun.communicate(timeout=300)
    assert "SIGTERM received" in err

    [run_dir] = list((out_dir / "tiny").iterdir())
    steps = {rank: [int(line.split()[0]) for line in (run_dir / f"checksum_rank{rank}.txt").read_text().splitlines()]
             for rank in (0, 1)}
    assert steps[0] == steps[1] and steps[0][-1] < 200  # the same last update step on both ranks
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] is True and summary["update_steps"] == steps[0][-1]
    assert summary["checkpoint"].endswith(f"step_{steps[0][-1]:08d}.pt")
    # Rank 0 alone held the folder (owner.lock stays; its owner record went with the run).
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest", "owner.lock", f"step_{steps[0][-1]:08d}.pt", f"step_{steps[0][-1]:08d}.pt.sha256"]


# --- NCCL bounded by engine.collective_timeout_s (issue 48, item 7) --------------------------


def test_nccl_settings_derive_from_the_collective_timeout():
    from octfw.engine.distributed import nccl_environment

    assert nccl_environment(600, {}) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # abort the communicators, then end the process
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000",  # torch's own: a tenth of 600 s is more
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
    }
    short = nccl_environment(12, {})
    assert short["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "12"
    assert short["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "1200"  # the abort by 12 + 4 x 1.2 s
    tiny = nccl_environment(0.5, {})
    assert tiny["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "1" and tiny["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "100"


def test_nccl_settings_the_user_made_are_kept_under_either_of_torchs_names():
    from octfw.engine.distributed import nccl_environment

    user = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900", "NCCL_ASYNC_ERROR_HANDLING": "3",
            "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert nccl_environment(600, user) == {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000"}
    everything = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "60000",
                  "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "30"}
    assert nccl_environment(600, everything) == {}


def test_join_on_cuda_creates_the_nccl_group_with_those_settings_and_the_timeout(monkeypatch):
    """The order in join(): the device selected, the NCCL settings in the environment, then the
    group with the same timeout (torch's NCCL group reads the settings once, when it is made).
    CUDA and torch.distributed are stood in for: this machine has no GPU."""
    import datetime

    import torch
    import torch.distributed as dist

    from octfw.engine.distributed import join

    environ = {key: value for key, value in os.environ.items() if "NCCL" not in key}
    environ.update({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "77"})
    environ.pop("MASTER_ADDR", None)  # no liveness thread: there is no store to mark in
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    selected: list = []
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    created: list = []

    def init_process_group(backend, **kwargs):
        created.append((backend, kwargs, {k: v for k, v in os.environ.items() if "NCCL" in k}, list(selected)))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: object())
    processes, peers = join("cuda", 12)
    [(backend, kwargs, nccl, selected_before)] = created
    assert backend == "nccl" and kwargs == {"timeout": datetime.timedelta(seconds=12),
                                            "device_id": torch.device("cuda", 1)}
    assert selected_before == [torch.device("cuda", 1)]  # the device first, then the group
    assert nccl == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1200",
                    "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "77"}  # the user's 77 kept
    assert (processes.rank, processes.world_size, processes.local_rank) == (1, 2, 1)
    peers.close()


# --- TPU pods: the hosts' group in the order torch_xla documents for SPMD (issue 48, item 10) ---


def test_the_hosts_group_is_made_under_spmd_with_each_hosts_process_index_and_count(tmp_path):
    """Two hosts, each in its own process, join as octfw's XLA path joins on a pod: SPMD first,
    then torch_xla's ``xla://`` group, whose rank and size are then each host's process index and
    the process count (made before SPMD, they would come from device ordinals and the device
    count). torch_xla's runtime reports the two hosts (its CPU client is one process only,
    tests/xla/host_group.py); the rendezvous, its store and the gloo groups are real."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TORCHELASTIC", "XLA_USE_SPMD"))}
    env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)})
    hosts = [subprocess.Popen([sys.executable, str(REPO / "tests" / "xla" / "host_group.py"), str(host), "2"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for host in range(2)]
    outcomes = [host.communicate(timeout=300) for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], [err[-3000:] for _, err in outcomes]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outcomes]
    for host, report in enumerate(reports):
        assert report["spmd"] and report["devices"] == 2
        assert report["processes"] == report["group"] == [host, 2]
        assert report["broadcast"] == "decided on host 0"  # host 0's decision reached both
        assert report["gathered"] == [0, 1]
