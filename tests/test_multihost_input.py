"""Multi-host input: each process (a TPU host) loads its own part of every
global batch, and the parts add up to the stream one process would draw.

No test here has more than one real process: torch_xla 2.9's CPU client is
single-process (docs/tpu-pods.md says what was tried). The data side runs for
real with every host's loader built in this process; the XLA side runs the
real Trainer in a subprocess with torch_xla's runtime reporting a TPU v4-32
(4 processes x 4 devices), plus torch_xla's minibatch transfer on 4 CPU
devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_RECIPE
from octfw.engine.data import SampleSource, make_loader
from octfw.engine.sampling import BalancedEpochOrder, EpochOrder
from octfw.engine.distributed import BatchLayout
from octfw.types import BatchKey, Provenance, Sample
from test_xla_engine import FAST_COMPILE

REPO = Path(__file__).resolve().parents[1]
N = 50  # not a multiple of any global batch below: the remainder rule shows
DOMAINS = ["a"] * 30 + ["b"] * 15 + ["c"] * 5


class NumberedVolumes:
    """Sample i is a 1-voxel volume holding the number i, in one of three domains."""

    def __len__(self) -> int:
        return N

    def domain(self, index: int) -> str:
        return DOMAINS[index]

    def load(self, index: int) -> Sample:
        return Sample(np.full((1, 1, 1), index, np.float32),
                      Provenance(f"vol{index:02d}", DOMAINS[index], (1.0, 1.0, 1.0), (1, 1, 1)))


class NumberedViews:
    """Both views are the volume; one context and one target patch."""

    def __call__(self, sample: Sample, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"context": sample.volume[None], "target": sample.volume[None],
                "context_idx": np.zeros(1, np.int64), "target_idx": np.zeros(1, np.int64)}

    def batch_spec(self) -> dict[str, BatchKey]:
        view = BatchKey((1, 1, 1, 1), "float32", view=True)
        return {"context": view, "target": view, "context_idx": BatchKey((1,), "int64"),
                "target_idx": BatchKey((1,), "int64")}


SOURCE = SampleSource(NumberedVolumes(), NumberedViews(), seed=7)


def host_loaders(layout: BatchLayout, sampling: str = "natural", start: int = 0) -> list:
    """Every host's loader, as the trainer builds it on that host; ``start`` is that
    host's samples done (the trainer's ``samples_done``)."""
    return [iter(make_loader(SOURCE, layout.process_micro_batch, seed=7, start=start, num_workers=0,
                             rank=rank, world_size=layout.processes, domain_sampling=sampling))
            for rank in range(layout.processes)]


def micro_steps(loaders: list, count: int) -> list[list[list[int]]]:
    """``count`` micro-steps: per micro-step, per host, the sample numbers it loaded."""
    return [[next(loader)["tensors"]["context"].reshape(-1).long().tolist() for loader in loaders]
            for _ in range(count)]


def stream(steps: list[list[list[int]]]) -> list[int]:
    """The global stream the hosts drew: host r's j-th sample of a micro-step is
    position r + j x hosts of that micro-step's block."""
    out = []
    for hosts in steps:
        width = len(hosts)
        out += [hosts[p % width][p // width] for p in range(width * len(hosts[0]))]
    return out


PODS = [BatchLayout(1, 1, processes=1, devices_per_process=8),   # one host of 8 devices
        BatchLayout(1, 1, processes=2, devices_per_process=4),
        BatchLayout(1, 1, processes=4, devices_per_process=2),
        BatchLayout(2, 1, processes=4, devices_per_process=1)]   # torchrun-like: 1 device each


@pytest.mark.parametrize("layout", PODS, ids=lambda l: f"{l.processes}x{l.devices_per_process}")
def test_hosts_together_draw_every_sample_of_an_epoch_exactly_once(layout):
    steps = micro_steps(host_loaders(layout), count=-(-2 * N // layout.global_micro_batch))
    assert all(len(host) == layout.process_micro_batch for step in steps for host in step)
    drawn = stream(steps)
    for epoch in range(2):
        assert sorted(drawn[epoch * N:(epoch + 1) * N]) == list(range(N))  # no duplicate, nothing dropped
    assert drawn[:N] == EpochOrder(N, seed=7).epoch_order(0).tolist()


def test_a_steps_global_batch_holds_the_same_samples_whatever_the_host_count():
    batches = {}
    for layout in PODS:
        steps = micro_steps(host_loaders(layout), count=4)
        batches[(layout.processes, layout.devices_per_process)] = [sorted(i for host in s for i in host)
                                                                   for s in steps]
    first, *others = batches.values()
    assert all(other == first for other in others), batches


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_balanced_sampling_splits_each_epochs_balanced_order_over_the_hosts(hosts):
    layout = BatchLayout(1, 1, processes=hosts, devices_per_process=8 // hosts)
    drawn = stream(micro_steps(host_loaders(layout, "balanced"), count=-(-2 * N // 8)))
    order = BalancedEpochOrder(DOMAINS, seed=7)
    for epoch in range(2):
        # Exactly the epoch's balanced order (small domains repeat by the balancing rule, not per host).
        assert drawn[epoch * N:(epoch + 1) * N] == order.epoch_order(epoch).tolist()
        counts = sorted(np.unique([DOMAINS[i] for i in drawn[epoch * N:(epoch + 1) * N]],
                                  return_counts=True)[1].tolist())
        assert counts == [16, 17, 17]


def test_an_epochs_remainder_starts_the_next_step_and_nothing_is_dropped():
    """50 samples, global batch 8: 6 update steps per epoch take 48; the 7th step
    takes the last 2 of epoch 0 and the first 6 of epoch 1."""
    layout = BatchLayout(1, 1, processes=4, devices_per_process=2)
    steps = [sorted(i for host in s for i in host) for s in micro_steps(host_loaders(layout), count=7)]
    epoch0 = EpochOrder(N, seed=7).epoch_order(0).tolist()
    epoch1 = EpochOrder(N, seed=7).epoch_order(1).tolist()
    assert sorted(i for s in steps[:6] for i in s) == sorted(epoch0[:48])
    assert steps[6] == sorted(epoch0[48:] + epoch1[:6])


def test_resume_with_the_same_host_count_continues_every_host_exactly():
    layout = BatchLayout(1, 1, processes=4, devices_per_process=2)
    uninterrupted = micro_steps(host_loaders(layout), count=9)
    done = 5 * layout.process_micro_batch  # each host's samples_done after 5 micro-steps
    resumed = micro_steps(host_loaders(layout, start=done), count=4)
    assert resumed == uninterrupted[5:]
    balanced = micro_steps(host_loaders(layout, "balanced"), count=9)
    assert micro_steps(host_loaders(layout, "balanced", start=done), count=4) == balanced[5:]


def test_resume_on_another_host_count_is_exact_from_the_new_layouts_per_host_start():
    """The same global batch on 2 hosts after 4: each new host starts from its
    share of the global samples done (update steps x its samples per update),
    not from the old hosts' samples_done."""
    four = BatchLayout(1, 2, processes=4, devices_per_process=2)
    two = BatchLayout(2, 2, processes=2, devices_per_process=2)
    assert four.global_batch == two.global_batch == 16
    updates = 3
    before = micro_steps(host_loaders(four), count=2 * (updates + 2))
    start = updates * two.process_micro_batch * two.grad_accum_steps
    after = micro_steps(host_loaders(two, start=start), count=4)
    assert stream(after) == stream(before)[updates * 16:(updates + 2) * 16]


def test_batch_layout_of_a_tpu_v4_32():
    layout = BatchLayout(per_device_batch=1, grad_accum_steps=2, processes=4, devices_per_process=4)
    assert (layout.devices, layout.process_micro_batch, layout.global_micro_batch, layout.global_batch) == (
        16, 4, 16, 32)
    assert layout.describe() == (
        "global batch 32 = per_device_batch 1 x 16 devices x grad_accum_steps 2; 4 processes x 4 "
        "devices: each process loads 4 samples per micro-step, 8 per update step")
    assert BatchLayout(2, 1).describe() == (
        "global batch 2 = per_device_batch 2 x 1 device x grad_accum_steps 1; 1 process loads "
        "2 samples per micro-step, 2 per update step")


def test_check_prints_the_global_batch_arithmetic_of_the_pod(tmp_path, registry):
    from octfw.diagnostics.check import check_recipe
    from octfw.recipe import load_recipe

    (tmp_path / "tiny.toml").write_text(TINY_RECIPE)
    recipe = load_recipe(tmp_path / "tiny.toml", ["engine.per_device_batch=1", "engine.grad_accum_steps=2",
                                                  "dataset.n_volumes=64", "run.max_steps=1000", "run.epochs=3"],
                         registry)
    lines: list[str] = []
    result = check_recipe(recipe, registry, lines.append, processes=4, devices_per_process=4)
    assert ("layout    global batch 32 = per_device_batch 1 x 16 devices x grad_accum_steps 2; 4 processes "
            "x 4 devices: each process loads 4 samples per micro-step, 8 per update step") in lines
    assert result["global_batch"] == 32 and result["total_update_steps"] == 3 * (64 // 32)
    assert any(line.startswith("schedule") and "(2 per epoch)" in line for line in lines)


# --- the XLA side: the real Trainer on every host of a v4-32, as torch_xla reports it ---


@pytest.fixture(scope="module")
def pod(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pod")
    (folder / "tiny.toml").write_text(TINY_RECIPE)
    overrides = ("run.device=xla engine.per_device_batch=1 engine.grad_accum_steps=2 dataset.n_volumes=50 "
                 "model.depth=1 model.predictor_depth=1")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": FAST_COMPILE}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "xla" / "pod_input.py"),
                          str(folder / "tiny.toml"), overrides, "4"],
                         capture_output=True, text=True, cwd=folder, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_host_marks_its_batch_as_its_part_of_the_global_batch(pod):
    for rank, host in enumerate(pod["hosts"]):
        assert (host["rank"], host["world_size"], host["local_devices"], host["device_count"]) == (rank, 4, 4, 16)
        assert host["mesh"] == {"shape": [16], "axes": ["data"], "device_ids": list(range(16))}
        assert host["sharding"] == {
            "context": {"minibatch": True, "partition_spec": ["data", None, None, None, None]},
            "target": {"minibatch": True, "partition_spec": ["data", None, None, None, None]},
            "context_idx": {"minibatch": True, "partition_spec": ["data", None]},
            "target_idx": {"minibatch": True, "partition_spec": ["data", None]},
            "domain_id": {"minibatch": True, "partition_spec": ["data"]},
        }


def test_each_host_loads_per_device_batch_times_its_devices(pod):
    for rank, host in enumerate(pod["hosts"]):
        assert host["loader"] == {"batch_size": 4, "rank": rank, "world_size": 4, "start": 0}
        assert (host["samples_per_update"], host["local_samples_per_update"], host["global_batch"]) == (32, 8, 32)
        assert all(len(micro) == 4 for micro in host["micro_steps"])


def test_the_hosts_of_a_pod_draw_the_dataset_exactly_once_per_epoch(pod):
    hosts = pod["hosts"]
    drawn = stream([[host["micro_steps"][k] for host in hosts] for k in range(4)])  # 64 positions
    assert sorted(drawn[:50]) == sorted(hosts[0]["dataset"]) and len(set(drawn[:50])) == 50
    assert len(set(drawn[50:])) == 14  # epoch 1 begins within the 4th micro-step


def test_each_host_logs_which_samples_it_loads(pod):
    lines = [host["log"] for host in pod["hosts"]]
    assert all(len(line) == 1 for line in lines)
    for rank, (line,) in enumerate(lines):
        assert line.startswith(f"host {rank} of 4 loads 4 samples per micro-step: offsets "
                               f"{rank}, {rank + 4}, {rank + 8}, {rank + 12} of each global micro-batch of 16")
    firsts = [line.rsplit("first dataset indices ", 1)[1] for (line,) in lines]
    assert len(set(firsts)) == 4


def test_torch_xla_gives_each_local_device_its_rows_of_a_minibatch_input(pod):
    transfer = pod["transfer"]
    for key in ("context", "target", "context_idx", "target_idx", "domain_id"):
        tensor = transfer[key]
        assert tensor["global_shape"][0] == 4  # one process: global = host batch x 4 / 4 devices
        assert tensor["spec"].startswith("{devices=[4") and tensor["spec"].endswith("]0,1,2,3}")
        assert [(s["device"], s["rows"], s["equal"]) for s in tensor["shards"]] == [
            (f"CPU:{i}", [i, i + 1], True) for i in range(4)]
    assert transfer["provenance"] == ["p"]
