"""The tiny V-JEPA on a ("data", "fsdp") SPMD mesh of 4 XLA CPU devices, as the engine shards it,
after one AdamW step: the layout torch_xla holds for a block's weight, its gradient, its AdamW
moment and its EMA copy (``devices=[4,1]``: the first dimension split in 4, a quarter on each).
Prints one JSON line (tests/test_sharded.py reads it)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("CPU_NUM_DEVICES", "4")  # before torch_xla starts its runtime

import torch  # noqa: E402
import torch_xla  # noqa: E402

from octfw.engine.backend import select_backend, training_forward  # noqa: E402
from octfw.engine.distributed import Processes  # noqa: E402
from octfw.recipe import load_recipe  # noqa: E402
from octfw.registry import load_registry  # noqa: E402


def spec(tensor: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def main() -> None:
    registry = load_registry()
    recipe = load_recipe(os.environ["OCTFW_TEST_RECIPE"], ["run.device=xla"], registry)
    backend = select_backend(Processes("xla"), "fp32", parallelism="fsdp")
    model = recipe.model.build(recipe.build_context(registry=registry)).to(backend.device)
    training_forward(model, backend, compile=False)
    weight = model.context_encoder.blocks[0].mlp.fc1.weight
    ema = model.target_encoder.blocks[0].mlp.fc1.weight
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    (weight.square().sum() + (weight * ema).sum()).backward()
    optimizer.step()
    torch_xla.sync()
    moments = optimizer.state[weight]
    print(json.dumps({
        "mesh": list(backend.mesh.mesh_shape), "axes": list(backend.mesh.axis_names),
        "specs": {"weight": spec(weight), "gradient": spec(weight.grad), "exp_avg": spec(moments["exp_avg"]),
                  "ema": spec(ema)},
    }))


if __name__ == "__main__":
    main()
