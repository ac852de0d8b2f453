"""Sharded data parallelism (``engine.parallelism = "fsdp"``): FSDP2 on CUDA and the CPU, the
SPMD mesh's "fsdp" axis on XLA (:func:`shard_on_mesh`).

With ``"data"`` every process holds the whole model, its gradients, its AdamW moments and the
EMA target encoder (DDP). With ``"fsdp"`` each of N processes holds 1/N of each
(``torch.distributed.fsdp.fully_shard``): a transformer block's parameters are gathered for
its forward and backward only, one block at a time, and its gradients reduce-scattered, so a
process keeps about 1/N of the model plus the largest block. What it changes is memory and
communication, never the numbers: the same gradients (averaged over the processes, as DDP
does), the same norm, the same update.

- **Units.** One FSDP unit per transformer block (:class:`octfw.models.vit3d.Block`: the
  encoders', the predictor's and the decoders' blocks), then one for the rest of the model,
  as torchtitan does. A third-party model without such blocks is sharded as one unit:
  correct, with the whole model gathered for its forward.
- **The EMA target encoder** is a copy of the online encoder, so its blocks are sharded
  exactly like the online ones (same shapes, same processes): its update is a local lerp of
  each process's slice, with no communication (a teacher sharded otherwise than its student
  is a known way to make a JEPA's loss creep up).
- **Mixed precision.** With ``engine.precision = "bf16"`` parameters are gathered in bf16 for
  compute and gradients reduced in fp32; the sharded master weights stay fp32.
- **Plain values meeting sharded ones.** A guard's clipping scale, the EMA momentum and the
  job's update verdict are the same on every process (the norm and the verdict are the
  job's), so they meet the sharded tensors as replicated values
  (:func:`replicated_scalars`).
- **Checkpoints.** Every process writes its own slices (:mod:`octfw.storage.sharded_checkpoints`,
  through the checkpointer's ``save_sharded``); nothing is gathered. A checkpointer without it
  gets the full state, gathered by a collective every process takes part in
  (:func:`octfw.engine.state.host_copy`). Either is read back whole, and :func:`shard_like`
  splits it over the processes: a checkpoint of either parallelism, on any number of
  processes, resumes the other.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

__all__ = ["shard_model", "shard_on_mesh", "sharding_units", "shard_like", "shard_optimizer_state",
           "replicated_scalars", "whole_outside_blocks", "is_sharded", "meta_twin", "whole_on_main"]


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a slice of a tensor spread over the processes (a DTensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def sharding_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of ``model`` (:class:`octfw.models.vit3d.Block`), each sharded as
    one unit."""
    from octfw.models.vit3d import Block

    return [module for module in model.modules() if isinstance(module, Block)]


def shard_model(model: torch.nn.Module, *, precision: str, reshard_after_forward: bool,
                compile: bool = False) -> torch.nn.Module:
    """``model``, sharded in place over every process of the job (the default process group):
    one unit per block, then the rest. ``reshard_after_forward``: free a block's gathered
    parameters after its forward and gather them again for its backward (less memory, one
    more all-gather per block). ``compile``: each block compiled first (in place), as torchtitan
    does: FSDP's gathers and reductions stay outside the compiled graphs, around each block, and
    the blocks, alike, share one compiled graph."""
    import torch.utils._pytree as pytree
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from octfw.types import ModelOutput

    # FSDP finds the tensors a forward returns to hook the backward that gathers the model's
    # own parameters again; a ModelOutput it cannot look into would leave them freed.
    if ModelOutput not in pytree.SUPPORTED_NODES:
        pytree.register_dataclass(ModelOutput)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if precision == "bf16" else MixedPrecisionPolicy())
    for unit in sharding_units(model):
        if compile:
            unit.compile()
        fully_shard(unit, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def meta_twin(recipe: Any, registry: Any) -> torch.nn.Module:
    """The recipe's model, unsharded, on the meta device (shapes only, no memory): what the FLOP
    count of a sharded run traces. Traced on the sharded model itself, its parameters swapped for
    meta ones under FSDP's hooks, the model was left with slices where a forward needs the whole."""
    with torch.device("meta"):
        return recipe.model.build(recipe.build_context(registry=registry, apply_init=False))


def shard_on_mesh(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``model`` on XLA's SPMD mesh with its state split over the mesh's "fsdp" axis, in place:
    each parameter's first dimension (torch_xla's FSDPv2 layout), where it divides; the EMA
    encoder's alike, so its update stays on each device's slice. XLA's compiler then places
    the gathers and the reduce-scatters, and gradients and AdamW's moments take the
    parameters' layout. A parameter whose first dimension does not divide (a small bias) stays
    whole on every device."""
    import torch_xla.distributed.spmd as xs

    devices = mesh.mesh_shape[mesh.axis_names.index("fsdp")]
    for parameter in model.parameters():
        if parameter.dim() and parameter.shape[0] % devices == 0:
            xs.mark_sharding(parameter, mesh, ("fsdp",) + (None,) * (parameter.dim() - 1))
    return model


@contextlib.contextmanager
def whole_outside_blocks(model: torch.nn.Module, sharded: bool) -> Iterator[None]:
    """While the block runs, the sharded ``model``'s parameters outside its blocks are whole on
    every process: for calls that do not go through the model's own forward (an evaluator's
    ``embed``, which runs the target encoder alone). Each block still gathers its own for its
    forward; every process must make the same calls."""
    if not sharded:
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


@contextlib.contextmanager
def replicated_scalars(sharded: bool) -> Iterator[None]:
    """Where plain tensors that every process holds alike (a clipping scale, the EMA momentum,
    the job's verdict) meet sharded parameters: they count as replicated there."""
    if not sharded:
        yield
        return
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        yield


def _like(full: Any, current: Any) -> Any:
    """``full`` (a whole tensor, every process holding it) split as ``current`` is split."""
    from torch.distributed.tensor import distribute_tensor

    if not (is_sharded(current) and torch.is_tensor(full)) or is_sharded(full):
        return full  # plain values, and slices read in place already
    # every process holds the full value (it read the checkpoint): each keeps its slice, no communication
    return distribute_tensor(full.to(current.device, current.dtype), current.device_mesh, current.placements,
                             src_data_rank=None)


def whole_on_main(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded ``model``'s whole state dict on the host of rank 0 (an empty dict elsewhere):
    gathered one tensor at a time, so no process holds more than one whole tensor beyond rank
    0's copy. A collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def shard_like(full: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """A model's full state dict split as ``current`` (the sharded model's own state dict) is."""
    return {key: _like(value, current.get(key)) for key, value in full.items()}


def shard_optimizer_state(full: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's full state dict (the moments of whole parameters, by parameter index) split
    as the optimizer's parameters are."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: {key: (_like(value, parameters[int(index)]) if torch.is_tensor(value) and value.dim() else value)
                     for key, value in moments.items()}
             for index, moments in full["state"].items()}
    return {**full, "state": state}
