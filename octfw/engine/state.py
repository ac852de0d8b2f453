"""The full training state: what a checkpoint holds and how a run resumes from it.

Everything is converted to CPU tensors and plain Python data so that the
checkpointer can load it with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from octfw.engine.build import Components
from octfw.errors import UserError
from octfw.recipe import Recipe

__all__ = ["save", "restore", "to_cpu"]

FORMAT_VERSION = 1


def to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])


def _component_states(components: list[Any]) -> list[Any]:
    return [c.state_dict() if hasattr(c, "state_dict") else None for c in components]


def save(parts: Components, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         update_step: int, samples_done: int, recipe: Recipe) -> tuple[str | None, str | None]:
    """Save the training state; returns (location, None) or (None, error). Never raises:
    a failed save must not stop training."""
    from octfw.rundir import versions

    state = {
        "format": FORMAT_VERSION,
        "update_step": update_step,
        "samples_done": samples_done,
        "model": to_cpu(model.state_dict()),
        "optimizer": to_cpu(optimizer.state_dict()),
        "guards": _component_states(parts.guards),
        "loggers": _component_states(parts.loggers),
        "rng": _rng_state(),
        "recipe": parts.ctx.recipe,
        "versions": versions(),
    }
    try:
        return parts.checkpointer.save(update_step, state), None
    except Exception as exc:  # noqa: BLE001 - reported in the summary, training goes on
        return None, f"{type(exc).__name__}: {exc}"


def restore(where: str, parts: Components, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Load a checkpoint into the built components; returns (update_step, samples_done)."""
    location = parts.checkpointer.latest() if where == "auto" else where
    if location is None:
        raise UserError("--resume auto: no complete checkpoint found for this run")
    try:
        state = parts.checkpointer.load(location)
    except FileNotFoundError:
        raise UserError(f"--resume {location}: checkpoint not found") from None
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for component, saved in zip(parts.guards + parts.loggers, state["guards"] + state["loggers"]):
        if saved is not None and hasattr(component, "load_state_dict"):
            component.load_state_dict(saved)
    _set_rng_state(state["rng"])
    return int(state["update_step"]), int(state["samples_done"])
