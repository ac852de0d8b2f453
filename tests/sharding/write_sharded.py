"""Run by tests/test_sharded_checkpoints.py under torchrun: an FSDP2 model and its AdamW state
saved as sharded checkpoints at update steps 1 and 2 into the folder argv[1] (a path or URL),
every process writing its own slices over a gloo group of its own, as the engine's background
saver does; rank 0 also writes the whole state it must read back as argv[2]/whole_<step>.pt."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from octfw.storage.checkpoints import CheckpointStorage


def main() -> None:
    folder, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))  # 6 and 5 rows: uneven slices
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    storage = CheckpointStorage(folder, keep_last=3)
    saves = dist.new_group(backend="gloo")
    for step in (1, 2):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        state = optimizer.state_dict()
        shards = {"model": model.state_dict(), "optimizer": {"state": state["state"]}}
        plain = {"update_step": step, "optimizer": {"param_groups": state["param_groups"]}} if rank == 0 else None
        whole = {"model": {k: v.full_tensor() for k, v in model.state_dict().items()},
                 "exp_avg": [optimizer.state[p]["exp_avg"].full_tensor() for p in model.parameters()]}
        storage.save_sharded(step, shards, plain, saves)
        if rank == 0:
            torch.save(whole, f"{out}/whole_{step}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
