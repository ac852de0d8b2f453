"""Run by tests/test_multihost_input.py in its own process (torch_xla patches
torch process-wide), with PJRT_DEVICE=CPU and CPU_NUM_DEVICES=4.

Part 1, a TPU v4-32 as each of its hosts sees it: the real Trainer is built
four times, once per host, with torch_xla's runtime reporting what it reports
on that slice (4 processes, this one ``rank``, 16 global and 4 addressable
devices). Recorded per host: the backend, the input sharding it gives the
parallel loader, the arguments of the trainer's ``make_loader`` call and the
samples its first micro-steps load (on the host; nothing is sent to a device,
since this machine has 4 real devices, not 16).

Part 2, torch_xla's minibatch transfer for real: one host batch goes through
``Backend.device_batches`` with the minibatch sharding on the 4 real CPU
devices. In one process the global batch equals the host batch (torch_xla
scales it by global / local devices, here 4 / 4); what is checked is that
torch_xla accepts octfw's spec on that path and gives each local device its
own rows.

Prints one JSON object.
"""

import json
import logging
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

import octfw.engine.trainer as trainer_module
from octfw.engine.plan import plan_for_folder
from octfw.engine.backend import Backend
from octfw.types import BatchKey
from octfw.recipe import load_recipe
from octfw.registry import load_registry

HOSTS, LOCAL = 4, 4
MICRO_STEPS = int(sys.argv[3])


def pod_host(recipe, registry, rank: int, run_dir: Path) -> dict:
    run_dir.mkdir()
    calls, lines = [], []
    real_make_loader = trainer_module.make_loader
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    data_log = logging.getLogger("octfw.engine.data")
    data_log.addHandler(handler)
    data_log.setLevel(logging.INFO)

    def recording_make_loader(*args, **kwargs):
        loader = real_make_loader(*args, **kwargs)
        calls.append((args, kwargs, loader))
        return loader

    with mock.patch.object(xr, "process_count", return_value=HOSTS), \
            mock.patch.object(xr, "process_index", return_value=rank), \
            mock.patch.object(xr, "global_runtime_device_count", return_value=HOSTS * LOCAL), \
            mock.patch.object(xr, "addressable_runtime_device_count", return_value=LOCAL), \
            mock.patch.object(trainer_module, "make_loader", recording_make_loader):
        trainer = trainer_module.Trainer(plan_for_folder(recipe, registry, run_dir), registry)
        backend = trainer.backend
        sharding = backend.input_sharding(trainer.parts.transform.batch_spec())
        layout = backend.batch_layout(recipe.engine.per_device_batch, recipe.engine.grad_accum_steps)
    data_log.removeHandler(handler)
    (args, kwargs, loader), = calls
    dataset = trainer.parts.dataset
    batches = iter(loader)
    micro = [[p.source for p in next(batches)["provenance"]] for _ in range(MICRO_STEPS)]
    return {
        "rank": backend.rank, "world_size": backend.world_size, "local_devices": backend.local_devices,
        "device_count": backend.device_count,
        "mesh": {"shape": list(backend.mesh.mesh_shape), "axes": list(backend.mesh.axis_names),
                 "device_ids": backend.mesh.device_ids.tolist()},
        "sharding": {key: {"minibatch": spec.minibatch, "partition_spec": list(spec.partition_spec)}
                     for key, spec in sharding.items()},
        "loader": {"batch_size": loader.batch_size, "rank": loader.sampler.rank,
                   "world_size": loader.sampler.world_size, "start": loader.sampler.start},
        "samples_per_update": trainer.layout.global_batch,
        "local_samples_per_update": trainer.layout.process_batch,
        "global_batch": layout.global_batch, "describe": layout.describe(),
        "micro_steps": micro,
        "dataset": [dataset.source(i) for i in range(len(dataset))],
        "log": lines,
    }


def minibatch_transfer() -> dict:
    mesh = xs.Mesh(np.arange(LOCAL), (LOCAL,), ("data",))
    # world_size 2 only makes the backend choose minibatch=True; the runtime is one real process.
    backend = Backend(kind="xla", device=torch_xla.device(), precision="fp32", rank=0, world_size=2,
                      local_devices=LOCAL, mesh=mesh)
    rows = torch.arange(LOCAL, dtype=torch.float32)
    tensors = {
        "context": rows.reshape(LOCAL, 1, 1, 1, 1).expand(LOCAL, 1, 2, 2, 2).contiguous(),
        "target": rows.reshape(LOCAL, 1, 1, 1, 1).expand(LOCAL, 1, 2, 2, 2).contiguous(),
        "context_idx": torch.arange(LOCAL * 3).reshape(LOCAL, 3),
        "target_idx": torch.arange(LOCAL * 2).reshape(LOCAL, 2),
        "domain_id": torch.arange(LOCAL),
    }
    spec = {"context": BatchKey((1, 2, 2, 2), "float32", view=True), "target": BatchKey((1, 2, 2, 2), "float32", view=True),
            "context_idx": BatchKey((3,), "int64"), "target_idx": BatchKey((2,), "int64")}
    batch = next(iter(backend.device_batches([{"tensors": tensors, "provenance": ["p"], "quarantined": []}], spec)))
    out = {}
    for key, tensor in batch["tensors"].items():
        shards = xs.wrap_if_sharded(tensor).local_shards
        out[key] = {
            "global_shape": list(tensor.shape),
            "spec": torch_xla._XLAC._get_xla_sharding_spec(tensor),
            "shards": [{"device": s.shard_device, "rows": [s.indices[0].start, s.indices[0].stop],
                        "equal": bool(torch.equal(s.data.cpu(), tensors[key][s.indices[0]]))}
                       for s in shards],
        }
    out["provenance"] = batch["provenance"]
    return out


def main() -> None:
    registry = load_registry()
    recipe = load_recipe(Path(sys.argv[1]), sys.argv[2].split(), registry)
    with tempfile.TemporaryDirectory() as scratch:
        hosts = [pod_host(recipe, registry, rank, Path(scratch) / f"host{rank}") for rank in range(HOSTS)]
    print(json.dumps({"hosts": hosts, "transfer": minibatch_transfer()}))


main()
