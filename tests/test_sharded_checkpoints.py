"""Sharded checkpoints (``step_N.dcp/``): written by every process of a real 2-process FSDP2 job,
read whole by one process, damaged files skipped for the previous checkpoint, and nothing in the
folder able to run code when read."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from octfw.display.errors import UserError
from octfw.storage.checkpoint_reading import CorruptCheckpoint
from octfw.storage.checkpoints import load_checkpoint
from octfw.storage.checkpoints import CheckpointStorage

HERE = Path(__file__).resolve().parent


def write_two_checkpoints(folder: str, out: Path, nproc: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
         str(HERE / "sharding" / "write_sharded.py"), folder, str(out)],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("sharded")
    write_two_checkpoints(str(out / "checkpoints"), out)
    return out / "checkpoints", out


def copy_of(folder: Path, tmp_path: Path) -> CheckpointStorage:
    import shutil

    shutil.copytree(folder, tmp_path / "checkpoints")
    return CheckpointStorage(str(tmp_path / "checkpoints"))


def test_every_process_writes_its_slices_and_one_process_reads_the_whole_state(written):
    folder, out = written
    storage = CheckpointStorage(str(folder))
    assert storage.checkpoints() == [(1, f"{folder}/step_00000001.dcp"), (2, f"{folder}/step_00000002.dcp")]
    latest = storage.latest()
    assert latest == f"{folder}/step_00000002.dcp"
    files = sorted(p.name for p in Path(latest).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__0_0.distcp.sha256", "__1_0.distcp", "__1_0.distcp.sha256",
                     "plain.pt", "plain.pt.sha256"]
    state = storage.load(latest)
    whole = torch.load(out / "whole_2.pt", weights_only=True)
    assert state["update_step"] == 2
    assert state["model"].keys() == whole["model"].keys()
    for key, tensor in whole["model"].items():
        assert torch.equal(state["model"][key], tensor), key
    moments = state["optimizer"]["state"]
    for index, exp_avg in enumerate(whole["exp_avg"]):
        assert torch.equal(moments[str(index)]["exp_avg"], exp_avg)
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-2  # the plain part, merged in
    assert load_checkpoint(latest)["update_step"] == 2  # by URL alone too (octfw export, replay)


def test_a_flipped_byte_in_one_process_slices_falls_back_to_the_previous_checkpoint(written, tmp_path, caplog):
    storage = copy_of(written[0], tmp_path)
    shard = tmp_path / "checkpoints" / "step_00000002.dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert storage.latest() == storage.location("step_00000001.dcp")
    assert "step_00000002.dcp is damaged (__1_0.distcp does not match" in caplog.text
    with pytest.raises(CorruptCheckpoint, match="__1_0.distcp does not match"):
        storage.load(storage.location("step_00000002.dcp"))


def test_a_missing_slice_file_is_no_checkpoint(written, tmp_path):
    storage = copy_of(written[0], tmp_path)
    (tmp_path / "checkpoints" / "step_00000002.dcp" / "__0_0.distcp").unlink()
    assert storage.latest() == storage.location("step_00000001.dcp")


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_an_index_that_would_run_code_is_refused_without_running_it(written, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    storage = copy_of(written[0], tmp_path)
    (tmp_path / "checkpoints" / "step_00000002.dcp" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    with pytest.raises(UserError, match=r"\.metadata cannot be read safely .*posix.system"):
        storage.load(storage.location("step_00000002.dcp"))
    assert not (tmp_path / "pwned").exists()


def test_pickled_values_in_a_folder_are_refused(tmp_path):
    """DCP loads its non-tensor entries with an unrestricted torch.load: octfw never writes them,
    and refuses a folder that holds one."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step_00000003.dcp"
    dcp.save({"weights": torch.ones(2), "note": {"any": "object"}}, checkpoint_id=str(folder), no_dist=True)
    (folder / "plain.pt").write_bytes(b"")
    with pytest.raises(UserError, match="holds pickled values"):
        from octfw.storage.sharded_checkpoints import read_metadata

        read_metadata((folder / ".metadata").read_bytes(), str(folder))


def test_two_processes_write_a_sharded_checkpoint_to_the_gcs_emulator(gcs, tmp_path):
    """Through the gcs checkpointer's store (fsspec, no rename there): every object each process
    wrote, the pointer last, and one process reads the whole state back from the bucket."""
    gcs.make_bucket("sharded")
    write_two_checkpoints("gs://sharded/run", tmp_path)
    storage = CheckpointStorage("gs://sharded/run")
    latest = storage.latest()
    assert latest == "gs://sharded/run/step_00000002.dcp"
    objects = sorted(p.rsplit("/", 1)[-1] for p in storage.fs.find("sharded/run/step_00000002.dcp"))
    assert objects == [".metadata", "__0_0.distcp", "__0_0.distcp.sha256", "__1_0.distcp", "__1_0.distcp.sha256",
                       "plain.pt", "plain.pt.sha256"]  # no .metadata.tmp left: renamed by upload and delete
    whole = torch.load(tmp_path / "whole_2.pt", weights_only=True)
    state = storage.load(latest)
    assert all(torch.equal(state["model"][k], v) for k, v in whole["model"].items())


def test_a_save_killed_before_its_index_is_never_loaded_and_the_next_save_removes_it(written, tmp_path):
    """A job killed while its processes wrote their slices leaves a folder without DCP's index
    (written last): never a checkpoint, and the next save deletes it."""
    storage = copy_of(written[0], tmp_path)
    folder = tmp_path / "checkpoints"
    (folder / "step_00000002.dcp" / ".metadata").unlink()
    assert storage.latest() == storage.location("step_00000001.dcp")
    assert [step for step, _ in storage.checkpoints()] == [1]
    # one process alone (no process group): DCP writes every tensor itself
    storage.save_sharded(3, {"model": {"w": torch.arange(4.0)}}, {"update_step": 3})
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_00000001.dcp", "step_00000003.dcp"]
    assert storage.load(storage.latest())["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_store_lost_under_a_sharded_job_the_slices_go_to_the_fallback_and_reach_the_store_once_back(
        gcs, tiny_recipe, tmp_path):
    """An fsdp job of 2 processes checkpointing to gs://: the emulator stopped mid-run. Saves fail
    or are skipped, training goes on; the final save, given up at its deadline while its threads
    still wait on the store, goes to RUN/fallback, every process its own slices (over a group of
    its own: the given-up save still holds the saves' group), exit 74. The store back, --resume
    auto continues from the fallback and writes the state to the store."""
    import time

    from octfw.cli.exit_codes import SAVE_FAILED_EXIT_CODE

    gcs.make_bucket("lost")
    url = "gs://lost/run"
    run = [sys.executable, "-m", "octfw.cli", "run", str(tiny_recipe), "--nproc-per-node", "2",
           "--set", "engine.parallelism=fsdp", "--set", "engine.per_device_batch=1", "--set", "run.max_steps=30",
           "--set", "checkpointer.name=gcs", "--set", f"checkpointer.dir={url}", "--set", "checkpointer.retries=1",
           "--set", "checkpointer.backoff_s=0.05", "--set", "checkpointer.timeout_s=3",
           "--set", "engine.checkpoint_every_steps=2", "--set", "engine.save_deadline_s=10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(run, cwd=tiny_recipe.parent, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    storage = CheckpointStorage(url)
    deadline = time.monotonic() + 300
    while storage.latest() is None:  # a first checkpoint in the store, then the store goes away
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    gcs.stop()
    _, err = process.communicate(timeout=600)
    assert process.returncode == SAVE_FAILED_EXIT_CODE, err[-3000:]
    (run_dir,) = (tiny_recipe.parent / "runs" / "tiny").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["update_steps"] == 30 and summary["final_save_failed"] is True
    fallback = run_dir / "fallback" / "step_00000030.dcp"
    assert summary["fallback_checkpoint"] == str(fallback)
    assert sorted(p.name for p in fallback.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    gcs.start()
    gcs.make_bucket("lost")  # the emulator keeps nothing across restarts
    resumed = subprocess.run([*run, "--resume", "auto"], cwd=tiny_recipe.parent, env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert CheckpointStorage(url).latest() == f"{url}/step_00000030.dcp" and not fallback.exists()


def test_read_into_fills_this_runs_tensors_and_refuses_what_it_would_drop(written, monkeypatch):
    """One process reading into tensors of its own (DCP's resharding path, a group of one): filled
    exactly; a checkpoint tensor the targets have no place for is refused, never dropped."""
    import torch.distributed as dist

    from octfw.storage.sharded_checkpoints import read_into

    folder, out = written
    whole = torch.load(out / "whole_2.pt", weights_only=True)
    storage = CheckpointStorage(str(folder))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        moments = {str(i): {"step": torch.zeros(()), "exp_avg": torch.empty_like(m), "exp_avg_sq": torch.empty_like(m)}
                   for i, m in enumerate(whole["exp_avg"])}
        targets = {"model": {k: torch.empty_like(v) for k, v in whole["model"].items()},
                   "optimizer": {"state": moments}}
        state = read_into(storage.fs, str(folder / "step_00000002.dcp"), "step 2", targets)
        assert all(torch.equal(state["model"][k], v) for k, v in whole["model"].items())
        assert torch.equal(state["optimizer"]["state"]["1"]["exp_avg"], whole["exp_avg"][1])
        assert state["update_step"] == 2
        with pytest.raises(UserError, match=r"holds, and this run has no place for, optimizer\.state\.0\.exp_avg"):
            read_into(storage.fs, str(folder / "step_00000002.dcp"), "step 2",
                      {"model": {k: torch.empty_like(v) for k, v in whole["model"].items()}})
    finally:
        dist.destroy_process_group()
