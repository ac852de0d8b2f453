"""AdamW for accelerators, whose update a guard's verdict can veto on the device.

Why octfw has its own AdamW on xla and cuda:

- A guard's verdict is a device tensor there; reading it on the host would
  stall the pipeline every update. torch's AdamW cannot take it, so octfw
  used to snapshot every parameter and moment before the step and put them
  back with ``torch.where``: three extra ops per tensor, traced on the host
  every update on torch_xla.
- :class:`GatedAdamW` folds the verdict into the update itself. When it is
  False the gradients count as zero and the factors that move the state are
  set to identity (beta1 = beta2 = 1, lr = 0), so parameters, moments and
  step counts keep their values. The only extra op per tensor is the
  ``torch.where`` that zeroes the gradient (a non-finite gradient times 0 is
  still NaN), and no copy of anything is kept.
- It is written for torch_xla's tracer: whole lists of tensors at once
  (``torch._foreach_*``), out-of-place ops and one copy back per tensor.
  torch's multi-tensor AdamW refuses ``capturable`` (device step counts) on
  xla, and its per-tensor path steps 3.4 times slower there
  (``benchmarks/engine/optimizer_step.py``). In eager mode (CUDA) the out-of-place
  ops cost extra memory passes: on the CPU it steps 2.8 times slower than
  torch's AdamW, which is why the engine keeps torch's AdamW there.
- Parameters of one group that have stepped together share one step-count
  tensor, so the bias corrections are computed once per group, not once per
  tensor.

The state layout is torch.optim.AdamW's (``step``, ``exp_avg``,
``exp_avg_sq`` per parameter), so a checkpoint moves between the two: a run
saved on a TPU resumes or replays on the CPU, where octfw uses torch's AdamW.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import torch

from octfw.types import ParamGroupsModel

if TYPE_CHECKING:
    from octfw.engine.backend import Backend
    from octfw.recipe import Recipe

__all__ = ["HELD_UNTIL", "GatedAdamW", "apply_schedule", "held_momentum", "make_optimizer", "seed_everything",
           "weight_decay_groups"]

#: A param-group key: the update step before which the group's learning rate is 0 (a published
#: encoder held while its new predictor trains, vjepa3d's ``predictor_warmup_steps``). It is saved
#: with the optimizer's state, so a resumed run holds until the same step.
HELD_UNTIL = "held_until"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_optimizer(model: torch.nn.Module, recipe: Recipe, backend: Backend) -> torch.optim.Optimizer:
    """The run's AdamW: torch's on the CPU, :class:`GatedAdamW` on an accelerator."""
    engine = recipe.engine
    if isinstance(model, ParamGroupsModel):
        # Which groups decay is asked at weight decay 1: at engine.weight_decay
        # = 0 every group would read 0, and a schedule rising from 0
        # (weight_decay_end > 0) could not tell the decaying ones apart.
        groups = model.param_groups(1.0)
        for group in groups:
            group["decays"] = group["weight_decay"] > 0.0
            group["weight_decay"] = engine.weight_decay if group["decays"] else 0.0
            if HELD_UNTIL in group:  # the LR a constant schedule (which never sets one) returns to
                group["initial_lr"] = engine.base_lr
    else:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "decays": True}]
    hyper = {"lr": engine.base_lr, "betas": engine.betas, "eps": engine.eps, "weight_decay": engine.weight_decay}
    if backend.kind == "cpu":  # the verdict is on the host: a vetoed update is simply not taken
        return torch.optim.AdamW(groups, **hyper, foreach=True)
    return GatedAdamW(groups, **hyper)  # takes the device-side verdict into the update itself


def apply_schedule(optimizer: torch.optim.Optimizer, lr: float | None, weight_decay: float | None,
                   update_step: int = 0) -> None:
    """One update step's LR and weight decay into every group; None leaves the value as it is
    (a constant schedule never rewrites the LR). A group held at ``update_step`` (:data:`HELD_UNTIL`)
    gets LR 0, which leaves its parameters exactly as they are (AdamW's step and its decoupled
    weight decay are both scaled by the LR); its moments still follow the gradients."""
    for group in optimizer.param_groups:
        if update_step < group.get(HELD_UNTIL, 0):
            group["lr"] = 0.0
        elif lr is not None:
            group["lr"] = lr
        elif HELD_UNTIL in group:
            group["lr"] = group["initial_lr"]
        # Biases and norms stay at 0. A checkpoint from before "decays"
        # existed tells them by their weight decay.
        if weight_decay is not None and group.get("decays", group["weight_decay"] > 0.0):
            group["weight_decay"] = weight_decay


def held_momentum(optimizer: torch.optim.Optimizer, update_step: int, momentum: float | None) -> float | None:
    """The EMA momentum of ``update_step``: 1.0 (the EMA encoder left as it is) while a group is
    held (:data:`HELD_UNTIL`), so that the target encoder stays put with the encoder it follows."""
    if momentum is not None and any(update_step < group.get(HELD_UNTIL, 0) for group in optimizer.param_groups):
        return 1.0
    return momentum


class GatedAdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam (Loshchilov & Hutter), as torch.optim.AdamW
    computes it, with an optional device-side veto: ``step(applied)``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, applied: torch.Tensor | None = None, closure: None = None) -> None:  # type: ignore[override]
        """One AdamW update; with ``applied`` (a 0-d bool device tensor) False,
        the update leaves every parameter, moment and step count as it was."""
        if closure is not None:
            raise ValueError("GatedAdamW does not take a closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if applied is not None:  # zeros, not grad * 0: NaN * 0 is NaN
                zero = torch.zeros((), dtype=torch.float32, device=params[0].device)
                grads = {id(p): torch.where(applied, p.grad, zero) for p in params}
            else:
                grads = {id(p): p.grad for p in params}
            for counter, members in self._by_counter(group, params):
                self._update(group, counter, members, [grads[id(p)] for p in members], applied)

    def _by_counter(self, group: dict, stepping: list[torch.Tensor]) -> list[tuple[torch.Tensor, list]]:
        """The stepping parameters bucketed by their step-count tensor. Fresh
        parameters share one new counter; a counter that a parameter without a
        gradient also holds is copied for it first, since its count stays."""
        fresh = None
        buckets: dict[int, tuple[torch.Tensor, list]] = {}
        for p in stepping:
            state = self.state[p]
            if not state:
                if fresh is None:
                    fresh = torch.zeros((), dtype=torch.float32, device=p.device)
                state.update(step=fresh, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            buckets.setdefault(id(state["step"]), (state["step"], []))[1].append(p)
        if len(stepping) < len(group["params"]):
            for p in group["params"]:
                state = self.state.get(p)
                if p.grad is None and state and id(state["step"]) in buckets:
                    state["step"] = state["step"].clone()
        return list(buckets.values())

    def _update(self, group: dict, counter: torch.Tensor, params: list[torch.Tensor],
                grads: list[torch.Tensor], applied: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        moments = [self.state[p]["exp_avg"] for p in params]
        squares = [self.state[p]["exp_avg_sq"] for p in params]
        if applied is None:
            counter.add_(1.0)
            keep1, keep2 = beta1, beta2
            steps = counter
        else:
            # 0-d device tensors: identity factors when the verdict is False.
            counter.add_(applied.float())
            lr = torch.where(applied, lr, 0.0)
            keep1, keep2 = torch.where(applied, beta1, 1.0), torch.where(applied, beta2, 1.0)
            steps = counter.clamp(min=1.0)  # a vetoed first update: finite bias corrections
        step_size = lr / (1.0 - beta1 ** steps)
        correction2 = (1.0 - beta2 ** steps).sqrt()

        # Out-of-place ops, then one copy per tensor: torch_xla traces addcmul_
        # or lerp_ in place 4 to 7 times slower than the same arithmetic out of
        # place (benchmarks/engine/optimizer_step.py); xla fuses the intermediates away.
        new_moments = torch._foreach_add(torch._foreach_mul(moments, keep1), grads, alpha=1.0 - beta1)
        new_squares = torch._foreach_add(torch._foreach_mul(squares, keep2), torch._foreach_mul(grads, grads),
                                         alpha=1.0 - beta2)
        denominators = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(new_squares), correction2), eps)
        updates = torch._foreach_mul(torch._foreach_div(new_moments, denominators), step_size)
        decayed = torch._foreach_mul(params, 1.0 - lr * weight_decay) if weight_decay != 0.0 else params
        torch._foreach_copy_(params, torch._foreach_sub(decayed, updates))  # a step size of 0 changes nothing
        torch._foreach_copy_(moments, new_moments)
        torch._foreach_copy_(squares, new_squares)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's layout, each parameter with a step count of its
        own: torch's AdamW would count a shared one once per parameter."""
        packed = super().state_dict()
        packed["state"] = {k: {**v, "step": v["step"].clone()} for k, v in packed["state"].items()}
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads torch.optim.AdamW's layout too. Step counts move to the
        parameter's device, and equal counts within a group share one tensor
        again (one host read, at load time only)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            shared: dict[float, torch.Tensor] = {}
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    count = float(state["step"])
                    if count not in shared:
                        shared[count] = torch.tensor(count, dtype=torch.float32, device=p.device)
                    state["step"] = shared[count]


def weight_decay_groups(parameters: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two optimizer groups over the trainable ones of ``parameters``, kept in
    their order (a saved optimizer state relies on it).

    ``decay`` holds every weight matrix/kernel (``ndim >= 2``) with
    ``weight_decay``; ``no_decay`` holds biases, LayerNorm parameters and every
    other 1-D parameter (mask tokens included) with 0, and a learned position table
    (marked ``no_weight_decay``) too.
    """
    decay, no_decay = [], []
    for param in parameters:
        if param.requires_grad:
            (decay if param.ndim >= 2 and not getattr(param, "no_weight_decay", False) else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
