"""Run under ``torch.distributed.run`` (gloo, CPU): the bytes one process holds of the tiny
V-JEPA's parameters, gradients, AdamW state and EMA encoder, sharded with the engine's own
``shard_model`` after one update, beside the whole model's. Rank 0 prints one JSON line."""

import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from octfw.engine.backend import Backend, training_forward
from octfw.engine.build import build_components
from octfw.engine.collate import collate_float_views
from octfw.engine.data import SampleSource
from octfw.engine.sharding import sharding_units
from octfw.recipe import load_recipe
from octfw.registry import load_registry


def local_bytes(tensors) -> int:
    """The bytes this process holds of ``tensors``: a sharded one's own slice."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def main() -> None:
    dist.init_process_group("gloo")
    registry = load_registry()
    recipe = load_recipe("tiny.toml", ["model.preset=small", "transform.image_size=[16,64,64]"], registry)
    parts = build_components(recipe, registry, run_dir=None, with_loggers=False)
    model = parts.model
    whole = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    largest_block = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in sharding_units(model))
    backend = Backend(kind="cpu", device=torch.device("cpu"), precision="fp32", rank=dist.get_rank(),
                      world_size=dist.get_world_size(), parallelism="fsdp")
    forward = training_forward(model, backend, compile=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    source = SampleSource(parts.dataset, parts.transform, seed=0)
    batch = collate_float_views([source[(0, i)] for i in range(2)], parts.transform.batch_spec())["tensors"]
    forward(batch).loss.backward()
    optimizer.step()
    ema = [p for name, p in model.named_parameters() if name.startswith("target_encoder.")]
    held = {
        "parameters": local_bytes(trainable),
        "gradients": local_bytes([p.grad for p in trainable if p.grad is not None]),
        "optimizer": local_bytes([v for s in optimizer.state.values() for v in s.values() if v.dim()]),
        "ema": local_bytes(ema),
    }
    replicated = {
        "parameters": sum(v for k, v in whole.items() if not k.startswith("target_encoder.")
                          and model.get_parameter(k).requires_grad),
        "ema": sum(v for k, v in whole.items() if k.startswith("target_encoder.")),
    }
    replicated["gradients"] = replicated["parameters"]
    replicated["optimizer"] = 2 * replicated["parameters"]
    if dist.get_rank() == 0:
        print(json.dumps({"world": dist.get_world_size(), "held": held, "replicated": replicated,
                          "largest_block": largest_block}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
