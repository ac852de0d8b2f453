"""engine.parallelism = "fsdp": FSDP2 over real processes (gloo, CPU), against one process.

Sharding changes memory, never the numbers: a run of 2 and of 4 sharded processes equals the
one-process run step for step (loss, gradient norm, every parameter of the final checkpoint),
accumulation on; a process holds about 1/N of the parameters, gradients, optimizer state and
EMA encoder (measured); and a checkpoint of either parallelism resumes the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_dist
from octfw.storage.checkpoints import CheckpointStorage
from test_distributed import launch, setup

REPO = Path(__file__).resolve().parents[1]
#: Each reduction summed in another order (two or four slices, two or four processes) changes
#: the last float bits; AdamW carries them on. Measured over 20 steps: below 2e-6.
TOLERANCE = 1e-5
#: The global batch of 8 on 1, 2 and 4 processes: 8, 4 and 2 micro-steps of one sample each.
TWENTY_STEPS = ["--set", "run.max_steps=20", "--set", "engine.per_device_batch=1", "--set", "engine.global_batch=8",
                "--set", "engine.checkpoint_every_steps=10",
                "--set", 'guard=[{name="nan-skip"},{name="grad-clip",max_norm=0.05}]']


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model of the run's last checkpoint, whole: a data run's file, a sharded run's folder."""
    storage = CheckpointStorage(str(run_dir / "checkpoints"))
    return storage.load(storage.latest())["model"]


def test_two_and_four_sharded_processes_equal_one_process_for_twenty_steps(tmp_path):
    setup(tmp_path)
    single = launch(tmp_path, TWENTY_STEPS)
    for nproc in (2, 4):
        sharded = launch(tmp_path, [*TWENTY_STEPS, "--set", "engine.parallelism=fsdp"], nproc=nproc)
        alone, apart = metrics(single), metrics(sharded)
        assert len(alone) == len(apart) == 20
        for a, b in zip(alone, apart):
            # the norm clipped and logged is the job's, the one the single process measures
            assert b["loss"] == pytest.approx(a["loss"], rel=TOLERANCE)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=TOLERANCE)
        weights, reference = final_weights(sharded), final_weights(single)
        assert weights.keys() == reference.keys()  # the full state, read back whole
        # every process wrote its own slices: one file each, no process gathered the state
        assert sorted(p.name for p in (sharded / "checkpoints" / "step_00000020.dcp").glob("*.distcp")) == [
            f"__{rank}_0.distcp" for rank in range(nproc)]
        worst = max((weights[k].float() - reference[k].float()).abs().max().item() for k in reference)
        assert worst <= TOLERANCE, (nproc, worst)
        assert (sharded / "encoder").is_dir()  # the whole encoder, gathered once and exported
    # A sharded run's checkpoint folder is read whole by one process, which replays its last update
    # and turns it into the single-file encoder export.
    folder = sharded / "checkpoints" / "step_00000020.dcp"
    for command in (["replay", str(sharded), "--step", "20"], ["export", str(sharded), "--out", str(tmp_path / "e.pt")],
                    ["export", str(folder), "--out", str(tmp_path / "f.pt")]):
        result = subprocess.run([sys.executable, "-m", "octfw.cli", *command], capture_output=True, text=True,
                                cwd=tmp_path, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "e.pt").read_bytes() == (tmp_path / "f.pt").read_bytes()  # the run's checkpoint, named either way


def test_compiled_blocks_train_an_fsdp_run_as_eager_ones_do(tmp_path):
    """engine.compile with fsdp: each block compiled before it is sharded (torchtitan's order),
    FSDP's collectives around the compiled graphs; the same losses and norms as eager."""
    setup(tmp_path)
    steps = ["--set", "run.max_steps=4", "--set", "engine.per_device_batch=1", "--set", "engine.parallelism=fsdp"]
    cache = tmp_path / "inductor"
    eager = launch(tmp_path, steps, nproc=2, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert not cache.exists()  # nothing compiled
    compiled = launch(tmp_path, [*steps, "--set", "engine.compile=true"], nproc=2,
                      env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert any(cache.rglob("*.py"))  # inductor wrote the blocks' compiled code
    for a, b in zip(metrics(eager), metrics(compiled), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=TOLERANCE)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=TOLERANCE)


def test_a_non_finite_gradient_on_one_process_skips_the_update_for_the_job(tmp_path):
    """A NaN on rank 1 only, at update 2: the sharded job skips that update as one, like the
    data-parallel job, and both go on to the same losses."""
    setup(tmp_path)
    poisoned = ["--set", "engine.per_device_batch=1", "--set", "model.name=poisoned", "--set", "model.nan_at=[2]",
                "--set", "model.rank_only=1", "--set", 'guard=[{name="nan-skip"}]']
    data = launch(tmp_path, poisoned, nproc=2)
    sharded = launch(tmp_path, [*poisoned, "--set", "engine.parallelism=fsdp"], nproc=2)
    for run_dir in (data, sharded):
        assert json.loads((run_dir / "summary.json").read_text())["skipped_updates"] == 1
    for a, b in zip(metrics(data), metrics(sharded)):
        if a["loss"] is None:  # the skipped update's loss is not a number: logged as none by both
            assert b["loss"] is None
        else:
            assert b["loss"] == pytest.approx(a["loss"], rel=TOLERANCE)


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_process_holds_a_slice_of_the_state(tmp_path, nproc):
    """Parameters, gradients, AdamW moments and the EMA encoder: at most 1/N of the replicated
    bytes plus the largest block (a block's slices are padded to equal length), measured on the
    tensors one process holds after an update of the `small` V-JEPA."""
    setup(tmp_path)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                          str(REPO / "tests" / "sharding" / "slice_bytes.py")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["world"] == nproc
    for kind, held in report["held"].items():
        whole = report["replicated"][kind]
        bound = whole / nproc + report["largest_block"] * (2 if kind == "optimizer" else 1)
        assert held <= bound, (kind, held, whole)
        assert held < whole / 2 + 1  # not replicated: a real share


#: A logger that preempts its own job, as a spot VM's SIGTERM would: at the update step named by
#: OCTFW_TEST_PREEMPT_AT, rank 0 (the one that logs) sends itself SIGTERM; every process stops
#: at the step, saves and exits 75. A logger, so that the recipe does not change between runs.
PREEMPT_PLUGIN = """
import os, signal
import attrs
from octfw.hookspecs import hookimpl

@attrs.frozen
class PreemptConfig:
    pass

class Preempt:
    def start(self, total, run_dir, recipe): pass
    def log(self, update_step, metrics):
        if update_step == int(os.environ.get("OCTFW_TEST_PREEMPT_AT", "0")):
            os.kill(os.getpid(), signal.SIGTERM)
    def finish(self, summary): pass

@hookimpl
def octfw_register_loggers(register):
    register("preempt", PreemptConfig, lambda c, ctx: Preempt(), "SIGTERM to itself at a step")
"""


def test_a_sharded_checkpoint_resumes_replicated_and_back(tmp_path):
    """fsdp on 2 processes preempted at step 10, data on 1 preempted at 15, fsdp on 4 to 20: no
    flag, no step trained twice, and the same losses as the 20 steps of one uninterrupted run."""
    setup(tmp_path)
    make_dist(tmp_path / "site", "octfw-preempt", "plug_preempt", PREEMPT_PLUGIN)
    loggers = ["--set", 'logger=[{name="jsonl"},{name="preempt"}]']
    whole = metrics(launch(tmp_path, [*TWENTY_STEPS, *loggers]))
    out = tmp_path / "resumed"
    common = [*TWENTY_STEPS, *loggers, "--set", f"run.output_dir={out}", "--resume", "auto"]
    for nproc, stop_at, parallelism, code in ((2, 10, "fsdp", 75), (1, 15, "data", 75), (4, 0, "fsdp", 0)):
        result = octfw_run(tmp_path, [*common, "--set", f"engine.parallelism={parallelism}"], nproc,
                           {"OCTFW_TEST_PREEMPT_AT": str(stop_at)})
        assert result.returncode == code, result.stderr[-3000:]
        assert "changes training" not in result.stderr  # the parallelism is listed, and taken as it is
    (run_dir,) = (out / "tiny").iterdir()
    # the fsdp attempts wrote every process's slices, the data attempt one file; each read the other's
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_00000010.dcp", "step_00000015.pt", "step_00000015.pt.sha256", "step_00000020.dcp"]
    resumed = metrics(run_dir)
    assert [m["step"] for m in resumed] == list(range(1, 21))  # each step once
    for a, b in zip(whole, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=TOLERANCE)


def octfw_run(tmp_path: Path, args: list[str], nproc: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "octfw.cli", "run", str(tmp_path / "tiny.toml"), *args]
    if nproc > 1:
        command = [*command[:4], "--nproc-per-node", str(nproc), *command[4:]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]), **env}
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)


def test_resume_auto_on_4_then_2_then_3_processes_keeps_the_global_batch_without_a_flag(tmp_path):
    """Issue 60: a run of 4 processes (global batch 12 = 1 x 4 x 3 micro-steps, not pinned), resumed
    on 2 and on 3 (fsdp, fsdp, data): the global batch recorded at its first start is kept,
    the accumulation derived (6, then 4), every step trained once, the losses those of one process
    training the same global batch."""
    setup(tmp_path)
    make_dist(tmp_path / "site", "octfw-preempt", "plug_preempt", PREEMPT_PLUGIN)
    shape = ["--set", "run.max_steps=6", "--set", "dataset.n_volumes=24", "--set", "engine.per_device_batch=1",
             "--set", 'logger=[{name="jsonl"},{name="preempt"}]']
    whole = metrics(launch(tmp_path, [*shape, "--set", "engine.grad_accum_steps=12"]))
    out = tmp_path / "resumed"
    common = [*shape, "--set", f"run.output_dir={out}", "--resume", "auto"]
    # 4 fsdp processes write 4 files of slices, which 2 fsdp processes read into their halves
    # (each only what overlaps its slices), and 3 data processes read whole
    for nproc, stop_at, parallelism, accum, code in ((4, 2, "fsdp", 3, 75), (2, 4, "fsdp", 6, 75),
                                                     (3, 0, "data", 4, 0)):
        result = octfw_run(tmp_path, [*common, "--set", "engine.grad_accum_steps=3", "--set",
                                      f"engine.parallelism={parallelism}"], nproc, {"OCTFW_TEST_PREEMPT_AT": str(stop_at)})
        assert result.returncode == code, result.stderr[-3000:]
        assert f"global batch 12 = per_device_batch 1 x {nproc} devices x grad_accum_steps {accum}" in result.stderr
    (run_dir,) = (out / "tiny").iterdir()
    resumed = metrics(run_dir)
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for a, b in zip(whole, resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=TOLERANCE)


def test_evaluators_during_a_sharded_run_score_as_in_a_data_parallel_one(tmp_path):
    """A linear probe every step and a kNN every two, during a 2-process run: sharded, every
    process runs the encoder's forwards (its slices are needed for each), rank 0 logs; the
    scores are those of the data-parallel run."""
    from test_evaluators import PROBES

    setup(tmp_path)
    (tmp_path / "tiny.toml").write_text((tmp_path / "tiny.toml").read_text() + PROBES)
    shape = ["--set", "run.max_steps=2", "--set", "engine.per_device_batch=1"]
    data = metrics(launch(tmp_path, shape, nproc=2))
    sharded = metrics(launch(tmp_path, [*shape, "--set", "engine.parallelism=fsdp"], nproc=2))
    scores = [key for key in data[-1] if key.startswith("eval/")]
    assert scores and any("knn" in key for key in scores), data[-1]
    for a, b in zip(data, sharded):
        for key in (k for k in a if k.startswith("eval/")):
            assert b[key] == pytest.approx(a[key], abs=1e-4), key


def test_the_spmd_fsdp_mesh_on_four_xla_cpu_devices_equals_the_data_mesh(tmp_path):
    """XLA: a ("data", "fsdp") mesh over 4 CPU devices, parameters split over "fsdp", trains as
    the one-axis "data" mesh does, step for step."""
    from test_distributed import losses
    from test_xla_engine import FAST_COMPILE

    setup(tmp_path)
    common = ["--set", "run.device=xla", "--set", "model.depth=1", "--set", "model.predictor_depth=1",
              "--set", "run.max_steps=3", "--set", "engine.per_device_batch=1"]
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XLA_FLAGS": FAST_COMPILE}
    data = launch(tmp_path, common, env=env)
    sharded = launch(tmp_path, [*common, "--set", "engine.parallelism=fsdp"], env=env)
    assert len(losses(sharded)) == 3
    for a, b in zip(losses(data), losses(sharded)):
        assert b == pytest.approx(a, rel=TOLERANCE)


def test_on_the_spmd_fsdp_mesh_weights_gradients_moments_and_ema_are_split_over_its_devices(tmp_path, monkeypatch):
    """What torch_xla holds for a block's weight after an AdamW step on the ("data", "fsdp") mesh
    of 4 CPU devices: the weight, its gradient, its AdamW moment and its EMA copy each split in 4
    along their first dimension (tests/xla/fsdp_mesh.py)."""
    from conftest import TINY_RECIPE, run_xla_script

    (tmp_path / "tiny.toml").write_text(TINY_RECIPE)
    monkeypatch.setenv("OCTFW_TEST_RECIPE", str(tmp_path / "tiny.toml"))
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    report = run_xla_script("fsdp_mesh.py")
    assert report["axes"] == ["data", "fsdp"] and report["mesh"] == [1, 4]
    assert set(report["specs"].values()) == {"{devices=[4,1]0,1,2,3}"}, report["specs"]
