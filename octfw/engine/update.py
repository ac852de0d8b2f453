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

__all__ = ["grad_norm", "step_unless_vetoed"]


def grad_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of all gradients, in fp32; non-finite if any gradient is."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), device=parameters[0].device)
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
