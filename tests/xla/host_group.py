"""Run by tests/test_distributed.py as one host of a two-host job, in its own process, with
PJRT_DEVICE=CPU, CPU_NUM_DEVICES=2 and MASTER_ADDR/MASTER_PORT naming where the hosts meet.

torch_xla 2.9's CPU client is one process only (docs/tpu-pods.md), so its runtime is told
what a pod's runtime says: this host's ``process_index`` and the ``process_count``
(argv: host, hosts). Everything else is real: octfw's ``join("xla", ...)``, torch_xla's
``xla://`` rendezvous (its TCP store on MASTER_PORT, rank and world size as it derives
them), the gloo groups, and one broadcast and one gather over the hosts' group.

Prints one JSON object.
"""

import json
import sys
from unittest import mock

import torch.distributed as dist
import torch_xla.runtime as xr

from octfw.engine.distributed import join

HOST, HOSTS = int(sys.argv[1]), int(sys.argv[2])

with mock.patch.object(xr, "process_index", return_value=HOST), \
        mock.patch.object(xr, "process_count", return_value=HOSTS):
    processes, peers = join("xla", 60)
    print(json.dumps({
        "processes": [processes.rank, processes.world_size],
        "group": [dist.get_rank(), dist.get_world_size()],
        "spmd": xr.is_spmd(),
        "devices": xr.global_runtime_device_count(),
        "broadcast": peers.broadcast(f"decided on host {HOST}"),
        "gathered": peers.gather(HOST),
    }))
    peers.close()
