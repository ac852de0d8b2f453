"""The exponential moving average of an online network's parameters, shared by models that keep
one (V-JEPA's target encoder).

``ema = m * ema + (1 - m) * online``, computed as ``ema + (1 - m) * (online - ema)``: the EMA
exactly unchanged for ``m == 1``, which is how the engine leaves it untouched on a skipped
update. Out-of-place ops and one copy back, not ``lerp_``: torch_xla traces an in-place lerp
about 4 times slower.

Sharded (``engine.parallelism = "fsdp"``), each parameter is a slice held by one process, and
the EMA and the online network are sliced alike (:mod:`octfw.engine.sharding`): the update is
made on each process's own slices, with no communication.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ema_update_"]


def _slice(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of ``tensor``: its local slice if sharded, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def ema_update_(ema: Sequence[torch.Tensor], online: Sequence[torch.Tensor], momentum: torch.Tensor | float) -> None:
    """Move every tensor of ``ema`` toward its counterpart in ``online`` by ``1 - momentum``
    (a float, or a 0-dim tensor on their device: no host sync)."""
    ema, online = [_slice(t) for t in ema], [_slice(t) for t in online]
    if isinstance(momentum, torch.Tensor):
        weight = (1.0 - momentum).to(device=ema[0].device, dtype=ema[0].dtype)
    else:
        weight = 1.0 - float(momentum)
    step = torch._foreach_mul(torch._foreach_sub(online, ema), weight)
    torch._foreach_copy_(ema, torch._foreach_add(ema, step))
