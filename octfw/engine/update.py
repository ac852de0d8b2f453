"""One optimizer update that a guard can veto, without a host sync.

On the CPU the verdict already lives on the host, so reading it costs no sync
and a vetoed update is simply not taken. On an accelerator the verdict stays
on the device and goes into the update itself
(:class:`octfw.engine.optim.GatedAdamW`): a vetoed update leaves parameters,
moments and step counts as they were.
"""

from __future__ import annotations

import torch

from octfw.engine.optim import GatedAdamW
from octfw.engine.sharding import is_sharded

__all__ = ["grad_norm", "step_unless_vetoed"]


def grad_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of all gradients, in fp32; non-finite if any gradient is.

    Sharded (:mod:`octfw.engine.sharding`), each process holds a slice of every gradient: the
    squares of the slices' norms are summed over the job, so every process gets the whole
    norm, the one a replicated run measures (torch's ``clip_grad_norm_`` over such gradients
    gives a DTensor that, read as a plain tensor, is each process's own part)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), device=parameters[0].device)
    if is_sharded(grads[0]):
        import torch.distributed as dist

        squares = torch.stack(torch._foreach_norm([g.to_local().float() for g in grads])).square().sum()
        dist.all_reduce(squares)  # over the job's processes, which the parameters are sharded over
        return squares.sqrt()
    norms = torch._foreach_norm([g.float() for g in grads])
    return torch.linalg.vector_norm(torch.stack(norms))


@torch.no_grad()
def step_unless_vetoed(optimizer: torch.optim.Optimizer, verdict: torch.Tensor | None) -> None:
    """The optimizer step, unless the guards' combined verdict is False."""
    if verdict is None:
        optimizer.step()
    elif verdict.device.type == "cpu":
        if bool(verdict):
            optimizer.step()
    elif isinstance(optimizer, GatedAdamW):
        optimizer.step(verdict)
    else:
        raise TypeError(f"a device-side verdict needs GatedAdamW, not {type(optimizer).__name__}")
