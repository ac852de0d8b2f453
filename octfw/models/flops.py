"""FLOPs per sample of a model, counted with ``torch.utils.flop_counter.FlopCounterMode``.

The count is what the model really executes on a real batch: matrix
products, convolutions and attention (``FlopCounterMode`` counts these, two
FLOPs per multiply-add; element-wise ops, norms and softmax are left out).
``6 x parameters x tokens`` misses attention, which is most of the work at the
thousands of tokens an OCT volume gives.

The count runs on the ``meta`` device: parameters, buffers and batch are
replaced by shape-only tensors, so nothing is computed or allocated and the
model and its gradients are left untouched. Attention is pinned to PyTorch's
math implementation there, whose matrix products the counter sees (the fused
CPU kernel is invisible to it). A model that cannot run on ``meta`` is
counted on its own device instead, with autograd gradients that never touch
``.grad`` and the RNG state restored.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["forward_flops_per_sample", "training_flops_per_sample"]


def forward_flops_per_sample(model: nn.Module, batch: Mapping[str, Any]) -> int:
    """FLOPs of one ``model(batch)`` (without autograd), divided by the batch size."""
    return _per_sample(model, batch, backward=False)


def training_flops_per_sample(model: nn.Module, batch: Mapping[str, Any]) -> int:
    """FLOPs of one forward plus the backward of its ``loss`` to every trainable
    parameter, divided by the batch size. For ``vjepa3d`` the forward includes the
    target encoder on the full volume; the optimizer and EMA update (element-wise)
    are not counted."""
    return _per_sample(model, batch, backward=True)


def training_flops_per_sample_on_meta(model: nn.Module, batch: Mapping[str, Any]) -> int | None:
    """Like :func:`training_flops_per_sample`, but only on shape-only tensors: never
    any work on the model's device (the engine calls it mid-run, where an extra
    traced op would recompile an XLA graph). None when the model cannot run on meta."""
    try:
        return _count_on_meta(model, batch, backward=True) // _batch_size(batch)
    except (NotImplementedError, RuntimeError, ValueError, TypeError):
        return None


def _batch_size(batch: Mapping[str, Any]) -> int:
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError("the batch holds no tensor with a batch dimension")


def _per_sample(model: nn.Module, batch: Mapping[str, Any], backward: bool) -> int:
    try:
        total = _count_on_meta(model, batch, backward)
    except (NotImplementedError, RuntimeError):
        # Some operation has no meta kernel (or reads a value on the host).
        total = _count_on_device(model, batch, backward)
    return total // _batch_size(batch)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)


def _count_on_meta(model: nn.Module, batch: Mapping[str, Any], backward: bool) -> int:
    state = {name: _meta(p) for name, p in model.named_parameters()}
    state.update({name: _meta(b) for name, b in model.named_buffers()})
    meta_batch = {k: _meta(v) if torch.is_tensor(v) else v for k, v in batch.items()}
    trainable = [state[name] for name, p in model.named_parameters() if p.requires_grad]

    def call():
        return torch.func.functional_call(model, state, (meta_batch,))

    return _count(call, trainable, backward)


def _count_on_device(model: nn.Module, batch: Mapping[str, Any], backward: bool) -> int:
    trainable = [p for p in model.parameters() if p.requires_grad]
    devices = [p.device for p in trainable if p.device.type == "cuda"][:1]
    with torch.random.fork_rng(devices=devices):
        return _count(lambda: model(batch), trainable, backward)


def _count(call, trainable: list[torch.Tensor], backward: bool) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        if backward:
            loss = _loss(call())
            # autograd.grad, not backward: no parameter's .grad is written.
            torch.autograd.grad(loss, trainable, allow_unused=True)
        else:
            with torch.no_grad():
                call()
    return int(counter.get_total_flops())


def _loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", output)
    if not torch.is_tensor(loss):
        raise TypeError(f"cannot find the loss in a model output of type {type(output).__name__}")
    return loss
