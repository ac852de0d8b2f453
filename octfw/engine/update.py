"""One optimizer update that a guard can veto on the device, without a host sync.

On an accelerator the optimizer always steps; when the verdict is False,
``torch.where`` puts back the parameters and optimizer state saved just
before, so a skipped update leaves them bitwise as they were. The snapshot is
taken only when a guard can veto. On the CPU the verdict already lives on the
host, so reading it costs no sync and a vetoed step is simply not taken.
"""

from __future__ import annotations

import torch

__all__ = ["grad_norm", "GuardedStep"]


def grad_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of all gradients, in fp32; non-finite if any gradient is."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), device=parameters[0].device)
    norms = torch._foreach_norm([g.float() for g in grads])
    return torch.linalg.vector_norm(torch.stack(norms))


class GuardedStep:
    def __init__(self, optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor]):
        self.optimizer = optimizer
        self.parameters = parameters

    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for p in self.parameters:
            for value in self.optimizer.state.get(p, {}).values():
                if torch.is_tensor(value):
                    tensors.append(value)
        return tensors

    @torch.no_grad()
    def __call__(self, verdict: torch.Tensor | None) -> None:
        if verdict is None:
            self.optimizer.step()
            return
        if verdict.device.type == "cpu":
            if bool(verdict):
                self.optimizer.step()
            return
        before = [t.clone() for t in (*self.parameters, *self._state_tensors())]
        self.optimizer.step()
        after = [*self.parameters, *self._state_tensors()]
        if len(after) != len(before):
            # First step: the optimizer created its state just now. Skipping it
            # means restoring parameters and resetting the new state to zero.
            params = after[: len(self.parameters)]
            for p, old in zip(params, before):
                p.copy_(torch.where(verdict, p, old))
            for t in after[len(self.parameters):]:
                t.copy_(torch.where(verdict, t, torch.zeros_like(t)))
            return
        for t, old in zip(after, before):
            t.copy_(torch.where(verdict.to(t.device), t, old))
